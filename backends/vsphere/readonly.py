# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""A vCenter or ESXi host opened for reading only: the source of a migration (issue 30).

Read-only by construction, twice over. `ReadOnlyVSphere` has no method that changes
anything (it is not a backend with a flag: it holds a session and an inventory and
offers reads alone), and its SOAP stub (`ReadOnlyStub`) refuses, before anything is
sent, every method outside `READS`: property reads, searches, the session's login and
logout, and the few objects a read needs that belong to the session itself (container
views, property collectors and their filters, which it may destroy again, and no other).
A refused call raises `WriteRefused` and is counted in `refused`; it never reaches the
server.

The reads are the backend's own (`Session`, `Conn`, `Inventory`), composed: one
container view of the VMs under the datacenter (or `--folder`) for the template marks,
then the facts of the templates alone in one more request. The VMs' facts take the same
marks, one request for the VMs, and one each for what names them from elsewhere: the VM
folders, the distributed portgroups and the clusters' DRS rules (all reads).

vSphere tags are not in that inventory: vCenter keeps them in its vAPI tagging service,
which `TagReader` (backends/vsphere/tagging.py) reads over REST, read-only by
construction too: one login for the life of this session, one batch request for the
tags of every template (and one for every VM) in scope, each tag and category named
once, the logout at `close`. A server without the service (a standalone ESXi host is
not even asked) leaves the facts' tags unread (None) and says why in
`tags_unreadable`: the plan reports "tags not readable", it does not fail.
"""

from __future__ import annotations

import fnmatch
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from pyVmomi import vim

from backends.base import PermanentError
from backends.config import BackendConfig
from backends.migrating import Scope, TemplateFacts, VMFacts, extra_facts
from backends.vsphere.config import Config, endpoint_of, password_of
from backends.vsphere.conn import Props, Stub
from backends.vsphere.inventory import Inventory
from backends.vsphere.session import Op, Session
from backends.vsphere.tagging import TagReader, TagsUnreadable
from backends.vsphere.vmfacts import VM_PATHS, drs_rules, folder_paths, model_of, vm_facts
from backends.vsphere.vms import KnownVMs

Facts = TypeVar("Facts", TemplateFacts, VMFacts)
# Why a standalone ESXi host's tags are not read: it has no vAPI (tags are vCenter's).
ESXI_HAS_NO_TAGS = "a standalone ESXi host has no tagging service (tags are vCenter's)"

# Methods that only read, and those of a session's login. `Fetch` is pyvmomi's read of
# one property.
READS = frozenset(
    {
        "RetrieveServiceContent",
        "Login",
        "Logout",
        "CurrentTime",
        "Fetch",
        "RetrieveProperties",
        "RetrievePropertiesEx",
        "ContinueRetrievePropertiesEx",
        "CancelRetrievePropertiesEx",
        "WaitForUpdatesEx",
        "CancelWaitForUpdates",
        "FindByUuid",
        "FindByInventoryPath",
        "FindChild",
    }
)
# Objects of the session a read may need, and how each is destroyed: only those the
# session itself made may be.
OWN_OBJECTS = {
    "CreateContainerView": "DestroyView",
    "CreatePropertyCollector": "DestroyPropertyCollector",
    "CreateFilter": "DestroyPropertyFilter",
}
# What the plan reads of each template (one request for all of them).
FACT_PATHS = [
    "name",
    "config.template",
    "config.instanceUuid",
    "config.guestId",
    "config.annotation",
    "config.extraConfig",
    "config.hardware.device",
    "config.version",
]
NIC_MODELS: dict[type, str] = {
    vim.vm.device.VirtualVmxnet3: "vmxnet3",
    vim.vm.device.VirtualVmxnet2: "vmxnet2",
    vim.vm.device.VirtualE1000e: "e1000e",
    vim.vm.device.VirtualE1000: "e1000",
    vim.vm.device.VirtualPCNet32: "pcnet32",
}
CONTROLLER_MODELS: dict[type, str] = {
    vim.vm.device.ParaVirtualSCSIController: "pvscsi",
    vim.vm.device.VirtualLsiLogicSASController: "lsilogic-sas",
    vim.vm.device.VirtualLsiLogicController: "lsilogic",
    vim.vm.device.VirtualBusLogicController: "buslogic",
    vim.vm.device.VirtualAHCIController: "sata",
    vim.vm.device.VirtualIDEController: "ide",
    vim.vm.device.VirtualNVMEController: "nvme",
}


class WriteRefused(PermanentError):
    """A call that is not a read, refused by a read-only session before it was sent."""


class ReadOnlyStub(Stub):
    """The SOAP stub of a read-only session: `Stub` (counts, re-login) that sends
    nothing outside READS, but the session's own views and collectors."""

    def __init__(self, soap: Any, login: Callable[[Stub], None]) -> None:
        super().__init__(soap, login)
        self.refused: Counter[str] = Counter()
        self._own: set[str] = set()  # managed object ids this session made
        self._own_lock = threading.Lock()

    def InvokeMethod(self, mo: Any, info: Any, args: Any) -> Any:  # pyvmomi names it
        name = str(info.wsdlName)
        if not self._allowed(name, str(getattr(mo, "_moId", ""))):
            with self._own_lock:
                self.refused[name] += 1
            raise WriteRefused(
                f"{name} is not a read: a read-only session never sends it (nothing was sent)"
            )
        result = super().InvokeMethod(mo, info, args)
        if name in OWN_OBJECTS and result is not None:
            with self._own_lock:
                self._own.add(str(result._moId))
        return result

    def _allowed(self, name: str, target: str) -> bool:
        if name in READS:
            return True
        with self._own_lock:
            own = target in self._own
        if name == "CreateFilter":  # only on a collector of its own
            return own
        if name in OWN_OBJECTS:
            return True
        return name in OWN_OBJECTS.values() and own


def create(config: BackendConfig, environ: Mapping[str, str]) -> ReadOnlyVSphere:
    """A read-only session of a `[[backends]]` vSphere entry (not connected yet)."""
    if not isinstance(config, Config):
        raise PermanentError(f"backend {config.name} is {config.kind}, not vsphere")
    return ReadOnlyVSphere(config, password_of(config, environ))


class ReadOnlyVSphere:
    """Reads of a vCenter or ESXi host, and nothing else (see the module docstring)."""

    def __init__(self, config: Config, password: str) -> None:
        self.name = config.name
        self._session = Session(endpoint_of(config), password, stub=ReadOnlyStub)
        self._inventory = Inventory(config.name, config, KnownVMs())
        self._password = password  # for the vAPI's login, as for SOAP's
        self._tags: TagReader | None = None
        self.tags_unreadable: str | None = None  # why the tags were not read, once not

    async def template_facts(self, scope: Scope) -> list[TemplateFacts]:
        def work(op: Op) -> tuple[bool, list[tuple[str, TemplateFacts]]]:
            dc = self._inventory.datacenter(op.conn)
            root = self._inventory.folder(op.conn, dc, scope.folder)
            marks = op.conn.contained(root, vim.VirtualMachine, ["name", "config.template"])
            chosen = [
                obj
                for obj, p in marks
                if p.get("config.template") and _named(str(p.get("name")), scope.name)
            ]
            rows = op.conn.retrieve(chosen, vim.VirtualMachine, FACT_PATHS)
            found = [(str(o._moId), _facts(p)) for o, p in rows if p.get("config.template")]
            return op.conn.vcenter, found

        vcenter, found = await self._session.run(work, changes=False)
        facts = await self._tagged(vcenter, found)
        return sorted(facts, key=lambda f: (f.name, f.source_id))

    async def vm_facts(self, scope: Scope) -> list[VMFacts]:
        def work(op: Op) -> tuple[bool, list[tuple[str, VMFacts]]]:
            dc = self._inventory.datacenter(op.conn)
            root = self._inventory.folder(op.conn, dc, scope.folder)
            marks = op.conn.contained(root, vim.VirtualMachine, ["name", "config.template"])
            chosen = [
                obj
                for obj, p in marks
                if p.get("config.template") is not True and _named(str(p.get("name")), scope.name)
            ]
            if not chosen:
                return op.conn.vcenter, []
            rows = op.conn.retrieve(chosen, vim.VirtualMachine, VM_PATHS)
            folders = folder_paths(
                op.conn.contained(dc.vm_folder, vim.Folder, ["name", "parent"]),
                str(dc.vm_folder._moId),
            )
            pgs = op.conn.contained(dc.obj, vim.dvs.DistributedVirtualPortgroup, ["name", "key"])
            portgroups = {str(p.get("key") or o._moId): str(p.get("name")) for o, p in pgs}
            rules = drs_rules(
                op.conn.contained(dc.host_folder, vim.ClusterComputeResource, ["configurationEx"])
            )
            found = [
                (
                    str(o._moId),
                    vm_facts(o, p, folders, portgroups, rules, NIC_MODELS, CONTROLLER_MODELS),
                )
                for o, p in rows
                if p.get("config.template") is not True
            ]
            return op.conn.vcenter, found

        vcenter, found = await self._session.run(work, changes=False)
        facts = await self._tagged(vcenter, found)
        return sorted(facts, key=lambda f: (f.name, f.source_id))

    async def _tagged(self, vcenter: bool, found: Sequence[tuple[str, Facts]]) -> list[Facts]:
        """The facts with their tags ("Category/Tag"), or as they are (tags None) when
        the tags cannot be read, and `tags_unreadable` says why."""
        if not vcenter:
            self.tags_unreadable = ESXI_HAS_NO_TAGS
        if self.tags_unreadable is not None:
            return [facts for _id, facts in found]
        if self._tags is None:
            endpoint = self._session.endpoint
            self._tags = TagReader(endpoint, self._password, self._session.ssl_context())
        try:
            tags = await self._tags.attached([vm for vm, _facts in found])
        except TagsUnreadable as exc:
            self.tags_unreadable = exc.message
            return [facts for _id, facts in found]
        return [replace(facts, tags=tags[vm]) for vm, facts in found]

    def api_calls(self) -> Counter[str]:
        """SOAP calls by method name, and the vAPI's as "REST <method> <what>"."""
        calls = self._session.api_calls()
        if self._tags is not None:
            calls.update({f"REST {k}": n for k, n in self._tags.calls.items()})
        return calls

    async def close(self) -> None:
        tags, self._tags = self._tags, None
        try:
            if tags is not None:
                await tags.close()
        finally:  # a cancelled tags' logout still ends the SOAP session
            await self._session.close()


def _named(name: str, pattern: str | None) -> bool:
    return pattern is None or fnmatch.fnmatchcase(name, pattern)


def _facts(p: Props) -> TemplateFacts:
    devices = p.get("config.hardware.device") or []
    by_key = {d.key: d for d in devices}
    holding = {d.controllerKey for d in devices if isinstance(d, vim.vm.device.VirtualDisk)}
    controllers = sorted(model_of(CONTROLLER_MODELS, by_key[k]) for k in holding if k in by_key)
    nics = [
        model_of(NIC_MODELS, d) for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard)
    ]
    pairs = [(str(o.key), str(o.value)) for o in p.get("config.extraConfig") or []]
    return TemplateFacts(
        source_id=str(p.get("config.instanceUuid") or ""),
        name=str(p.get("name") or ""),
        guest_id=str(p.get("config.guestId") or ""),
        annotation=str(p.get("config.annotation") or ""),
        extra=extra_facts(pairs),
        nics=tuple(nics),
        disk_controllers=tuple(controllers),
        hardware_version=str(p.get("config.version") or ""),
    )
