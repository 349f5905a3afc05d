# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)
"""vcsim inventories for the migration tests: templates made as an operator would have
made them (a guest id, notes, extraConfig, a VMware NIC), some carrying deploybot's
build mark, in folders a plan's scope can pick; and vSphere tags, which an operator
attaches through vCenter's vAPI (`Tagger`), straight to vcsim, never through the
counting proxy a test judges the plan's requests by."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.building import BuildPlan
from backends.vsphere import buildmark

PINNED_KEY = "guestinfo.cloudinit.datasource_list"


def build_plan(profile: str, family: str, version: int, job: str) -> BuildPlan:
    """What a build of `profile` recorded (its build mark), on either backend."""
    return BuildPlan(
        job_id=job,
        profile=profile,
        os_family=family,
        version=version,
        name=profile,
        cpu="x86-64-v2-AES",
        ostype="l26",
        nic="vmxnet3",
        disk_bus="scsi",
        user="debian",
        built_at=datetime(2026, 3, 1, tzinfo=UTC),
        source_digest="sha256:" + "ab" * 32,
    )


def mark(profile: str, family: str, version: int, job: str) -> str:
    """The annotation of a template deploybot built on vSphere from `profile`."""
    return buildmark.annotation(build_plan(profile, family, version, job))


def find_vm(sim: Any, name: str) -> Any:
    view = sim.content.viewManager.CreateContainerView(
        sim.content.rootFolder, [vim.VirtualMachine], True
    )
    try:
        return next(v for v in view.view if v.name == name)
    finally:
        view.DestroyView()


def make_template(
    sim: Any,
    vm_name: str,
    name: str,
    guest_id: str,
    note: str,
    extra: dict[str, str] | None = None,
    vmxnet3: bool = False,
) -> Any:
    """One of vcsim's VMs made into a template."""
    vm = find_vm(sim, vm_name)
    if vm.runtime.powerState == "poweredOn":
        WaitForTask(vm.PowerOffVM_Task())
    options = [vim.option.OptionValue(key=k, value=v) for k, v in (extra or {}).items()]
    spec = vim.vm.ConfigSpec(guestId=guest_id, annotation=note, extraConfig=options)
    if vmxnet3:
        card = vim.vm.device.VirtualVmxnet3(key=-1)
        spec.deviceChange = [
            vim.vm.device.VirtualDeviceSpec(
                operation=vim.vm.device.VirtualDeviceSpec.Operation.add, device=card
            )
        ]
    WaitForTask(vm.ReconfigVM_Task(spec))
    WaitForTask(vm.Rename_Task(name))
    vm.MarkAsTemplate()
    return vm


def edit_notes(sim: Any, name: str, note: str) -> None:
    """An operator edits a template's notes (a template takes no reconfigure: it is
    made a VM for the edit and a template again)."""
    vm = find_vm(sim, name)
    host = vm.runtime.host
    vm.MarkAsVirtualMachine(pool=host.parent.resourcePool, host=host)
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(annotation=note)))
    vm.MarkAsTemplate()


# What `apply_inventory` makes in folder golden, with the profile each maps to.
GOLDEN = {
    "debian-13-golden": "debian-13",  # its build mark
    "alma-9-golden": "alma-9",  # its build mark, a vmxnet3 NIC
    "alma-base": "alma-9",  # "AlmaLinux 9" in its notes, a pinned datasource
    "ubuntu-jammy": "ubuntu-22.04",  # "Ubuntu 22.04" in its notes
    "win2019": None,  # no profile is for Windows
}


def apply_inventory(sim: Any) -> None:
    """Templates for an apply on the simulator as the target (which ships hand-made
    ubuntu-24.04, debian-12 and rocky-9 templates, so those profiles are not used in
    folder golden): GOLDEN there, and in folder legacy one of profile debian-12 (a build
    the simulator refuses: the name is its hand-made template's)."""
    make_template(sim, "DC0_C0_RP0_VM2", "debian-13-golden", "debian10_64Guest", mark(
        "debian-13", "debian", 2, "jdeb13a"))  # fmt: skip
    make_template(
        sim, "DC0_H0_VM1", "alma-9-golden", "rhel7_64Guest", mark("alma-9", "el", 4, "jalm9a"),
        vmxnet3=True,
    )  # fmt: skip
    make_template(
        sim, "DC0_H0_VM2", "alma-base", "rhel7_64Guest",
        "AlmaLinux 9 base from the old deployer; NIC ens192", {PINNED_KEY: "[VMware]"},
    )  # fmt: skip
    make_template(sim, "DC0_H0_VM3", "ubuntu-jammy", "ubuntu64Guest", "Ubuntu 22.04 LTS")
    make_template(sim, "DC0_C0_RP0_VM0", "win2019", "windows9Server64Guest", "Windows 2019")
    make_template(sim, "DC0_C0_RP0_VM1", "deb-old", "debian10_64Guest", "Debian 12 (bookworm)")
    golden = sim.datacenter.vmFolder.CreateFolder("golden")
    WaitForTask(golden.MoveIntoFolder_Task([find_vm(sim, n) for n in GOLDEN]))
    legacy = sim.datacenter.vmFolder.CreateFolder("legacy")
    WaitForTask(legacy.MoveIntoFolder_Task([find_vm(sim, "deb-old")]))


VAPI = "/rest/com/vmware/cis"


@dataclass
class Tagger:
    """An operator's vAPI session on vcsim (`sim`: tests/support/vsphere/simulator's
    Vcsim) that makes categories and tags and attaches them to VMs by name."""

    sim: Any
    _session: str = ""
    _categories: dict[str, str] = field(default_factory=dict)  # name -> id
    _tags: dict[str, str] = field(default_factory=dict)  # "Category/Tag" -> id

    def attach(self, vm_name: str, *tags: str) -> None:
        """Attach each "Category/Tag" to the VM or template `vm_name`."""
        target = {"type": "VirtualMachine", "id": find_vm(self.sim, vm_name)._moId}
        for tag in tags:
            path = f"/tagging/tag-association/id:{self._tag(tag)}?~action=attach"
            self._call("POST", path, {"object_id": target})

    def detach(self, vm_name: str, tag: str) -> None:
        target = {"type": "VirtualMachine", "id": find_vm(self.sim, vm_name)._moId}
        path = f"/tagging/tag-association/id:{self._tag(tag)}?~action=detach"
        self._call("POST", path, {"object_id": target})

    def tag_id(self, tag: str) -> str:
        """The vAPI id of "Category/Tag" (made when it is not there yet)."""
        return self._tag(tag)

    def _tag(self, tag: str) -> str:
        if not self._categories:  # what earlier sessions made (the lab is shared)
            self._known()
        if tag not in self._tags:
            category, name = tag.split("/", 1)
            if category not in self._categories:
                spec = {"name": category, "cardinality": "MULTIPLE", "associable_types": []}
                self._categories[category] = self._call(
                    "POST", "/tagging/category", {"create_spec": spec}
                )
            spec = {"name": name, "category_id": self._categories[category]}
            self._tags[tag] = self._call("POST", "/tagging/tag", {"create_spec": spec})
        return self._tags[tag]

    def _known(self) -> None:
        names = {}
        for category in self._call("GET", "/tagging/category", None) or []:
            names[category] = self._call("GET", f"/tagging/category/id:{category}", None)["name"]
            self._categories[names[category]] = category
        for tag in self._call("GET", "/tagging/tag", None) or []:
            found = self._call("GET", f"/tagging/tag/id:{tag}", None)
            self._tags[f"{names[found['category_id']]}/{found['name']}"] = tag

    def _call(self, method: str, path: str, body: Any) -> Any:
        if not self._session:
            user, password = self.sim.login
            basic = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._session = self._send(
                "POST", "/session", None, {"Authorization": f"Basic {basic}"}
            )
        return self._send(method, path, body, {"vmware-api-session-id": self._session})

    def _send(self, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
        context = ssl.create_default_context(cafile=str(self.sim.tls.ca))
        conn = http.client.HTTPSConnection("127.0.0.1", self.sim.port, context=context, timeout=30)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, VAPI + path, data, {**headers, "Content-Type": "application/json"})
            answer = conn.getresponse()
            text = answer.read()
        finally:
            conn.close()
        if answer.status != 200:
            raise AssertionError(f"vcsim {method} {path}: {answer.status} {text[:200]!r}")
        return json.loads(text).get("value") if text else None
