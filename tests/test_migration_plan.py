"""`deploybot migrate plan` (issue 30): a vcsim inventory made for the plan (templates
with and without build marks, a datasource pinned in extraConfig, a VMware NIC, one of
no known OS, one of an unknown profile; VMs with snapshots, changed block tracking, a
custom attribute, DRS rules, reservations and shares, e1000/e1000e/vmxnet3 NICs on a
distributed and a standard portgroup, a MAC set by hand, pvscsi and LSI Logic
controllers, thin, thick lazy and thick eager disks and one impossible) read through
the read-only session type, the fake Proxmox as the target, a counting proxy in front of
vcsim that sees every SOAP method: the counts per category are exact and no mutating
method reaches the source.

vSphere tags are vCenter's vAPI tagging service (REST), which vcsim serves too: the
operator attaches them straight to vcsim (`Tagger`, not through the proxy), the plan
reads them through the proxy, which judges its REST requests as it judges SOAP's.

What vcsim cannot represent, so these tests do not cover it: a raw device mapping
(vcsim 0.24 panics on one, or wants its mapping file, whose creation task it reports on
the wrong object), and a guest reporting qemu-guest-agent (no vSphere property says
it). vcsim keeps thin and eager at once, which a real vSphere
would not: that is the impossible disk the plan must report."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import ssl
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import Unreachable
from backends.migrating import Scope
from backends.proxmox.buildmarks import build_description, build_tags
from backends.vsphere.config import Config, endpoint_of
from backends.vsphere.readonly import (
    ESXI_HAS_NO_TAGS,
    ReadOnlyStub,
    ReadOnlyVSphere,
    WriteRefused,
    create,
)
from backends.vsphere.session import Session
from backends.vsphere.tagging import SESSION, TAG, TagReader, TagsUnreadable
from bot.addresses.subnets import Subnet
from bot.images.profiles import catalogue
from bot.migration.apply import SourceChanged, check_source
from bot.migration.classify import Category, MatchedBy, Missing, NoteKind
from bot.migration.plan import (
    PlanFileError,
    make_plan,
    read_plan,
    source_digest,
    source_unchanged,
    write_plan,
)
from handlers.messages.migration import plan_lines
from tests.support.cli import run_async
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE
from tests.support.vsphere.migration import (
    PINNED_KEY,
    Tagger,
    build_plan,
    find_vm,
    make_template,
    mark,
)
from tests.support.vsphere.simulator import (
    PASSWORD,
    PASSWORD_ENV,
    Simulated,
    TlsFiles,
    simulator,
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)
from tests.support.vsphere.soapproxy import (
    READ_METHODS,
    RestSeen,
    SoapProxy,
    counting_proxy,
    rest_mutating,
)

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

PROFILES = catalogue()
EXPECTED = {
    "ubuntu-24.04": (Category.REBUILDABLE, "ubuntu-24.04"),
    "rocky-9-golden": (Category.REBUILDABLE, "rocky-9"),
    "el-base": (Category.REBUILDABLE, "rocky-9"),
    "debian-12": (Category.ON_TARGET, "debian-12"),
    "win2019": (Category.NOT_MAPPABLE, None),
    "debian-old": (Category.NOT_MAPPABLE, None),
    "legacy-build": (Category.NOT_MAPPABLE, None),
}
EXPECTED_VMS = {
    "DC0_C0_RP0_VM3": Category.MOVES_AS_IS,  # vcsim's own: e1000 on DC0_DVPG0, pvscsi, thin
    "db01": Category.NEEDS_DECISIONS,
    "web01": Category.NEEDS_DECISIONS,
    "legacy01": Category.BLOCKED,  # on VM Network: its subnet has no segment on pve
    "broken-disk": Category.BLOCKED,  # thin and eager at once (and on VM Network)
}
VM_COUNTS = {"moves-as-is": 1, "needs-decisions": 2, "blocked": 2}
# vSphere tags ("Category/Tag") the operator attached, on VMs whose category they do not
# change (the counts above stay) and on a template; every other object has none.
TAGS = {
    "db01": ("Backup/daily", "Owner/Team DB"),
    "web01": ("Env/production",),
    "legacy01": ("Env/production",),
    "el-base": ("Golden/approved",),
}
MANUAL_MAC = "00:50:56:01:02:03"
# DC0_DVPG0 is 10.20 on pve's vmbr0 VLAN 20; VM Network is 10.40, with no segment on pve.
SUBNETS = (
    Subnet.model_validate(
        {
            "cidr": "127.0.20.0/24",
            "gateway": "127.0.20.1",
            "segments": {
                "vcenter": {"network": "DC0_DVPG0"},
                "pve": {"bridge": "vmbr0", "vlan": 20},
            },
        }
    ),
    Subnet.model_validate(
        {
            "cidr": "127.0.40.0/24",
            "gateway": "127.0.40.1",
            "segments": {"vcenter": {"network": "VM Network"}},
        }
    ),
)


def build_inventory(sim: Any) -> None:
    """Seven templates (see EXPECTED) and the VMs; el-base and win2019 in folder golden;
    the TAGS."""
    ubuntu = find_vm(sim, "ubuntu-24.04")  # the simulator's own template: give it its OS
    compute = next(c for c in sim.datacenter.hostFolder.childEntity if c.name == "DC0_H0")
    ubuntu.MarkAsVirtualMachine(pool=compute.resourcePool, host=compute.host[0])
    WaitForTask(ubuntu.ReconfigVM_Task(vim.vm.ConfigSpec(guestId="ubuntu64Guest")))
    ubuntu.MarkAsTemplate()
    debian = mark("debian-12", "debian", 3, "jdeb01a")
    make_template(sim, "DC0_H0_VM1", "debian-12", "debian10_64Guest", debian)
    rocky = mark("rocky-9", "el", 2, "jroc01a")
    make_template(sim, "DC0_H0_VM2", "rocky-9-golden", "rhel7_64Guest", rocky, vmxnet3=True)
    make_template(
        sim,
        "DC0_H0_VM3",
        "el-base",
        "rhel7_64Guest",
        "Rocky Linux 9 golden image from the old deployer; NIC ens192",
        {PINNED_KEY: "[VMware]", "guestinfo.metadata": "aW5zdGFuY2UtaWQ6IG9sZA=="},
    )
    make_template(sim, "DC0_C0_RP0_VM0", "win2019", "windows9Server64Guest", "Windows Server 2019")
    make_template(sim, "DC0_C0_RP0_VM1", "debian-old", "debian10_64Guest", "Debian 10 (buster)")
    legacy = mark("centos-7", "el", 1, "jcen01a")
    make_template(sim, "DC0_C0_RP0_VM2", "legacy-build", "centos7_64Guest", legacy)
    folder = sim.datacenter.vmFolder.CreateFolder("golden")
    WaitForTask(folder.MoveIntoFolder_Task([find_vm(sim, "el-base"), find_vm(sim, "win2019")]))
    build_vms(sim)
    tagger = Tagger(sim)  # the operator's vAPI session, straight to vcsim
    for name, tags in TAGS.items():
        tagger.attach(name, *tags)


def _add(device: Any, create: bool = False) -> Any:
    spec = vim.vm.device.VirtualDeviceSpec(operation="add", device=device)
    if create:
        spec.fileOperation = vim.vm.device.VirtualDeviceSpec.FileOperation.create
    return spec


def _disk(key: int, controller: int, unit: int, gib: int, thin: bool, eager: bool) -> Any:
    backing = vim.vm.device.VirtualDisk.FlatVer2BackingInfo(
        diskMode="persistent", thinProvisioned=thin, eagerlyScrub=eager, fileName=""
    )
    return _add(
        vim.vm.device.VirtualDisk(
            key=key,
            controllerKey=controller,
            unitNumber=unit,
            capacityInKB=gib * 1024 * 1024,
            backing=backing,
        ),
        create=True,
    )


def _renamed(sim: Any, vm_name: str, name: str, spec: Any) -> Any:
    vm = find_vm(sim, vm_name)
    WaitForTask(vm.ReconfigVM_Task(spec))
    WaitForTask(vm.Rename_Task(name))
    return vm


def build_vms(sim: Any) -> None:
    """Four VMs besides vcsim's own DC0_C0_RP0_VM3 (see EXPECTED_VMS), made by an
    operator's (writing) session before any plan."""
    pg = next(n for n in sim.datacenter.networkFolder.childEntity if n.name == "DC0_DVPG0")
    port = vim.dvs.PortConnection(
        portgroupKey=pg.key, switchUuid=pg.config.distributedVirtualSwitch.uuid
    )
    lsi = vim.vm.device.VirtualLsiLogicController(key=-10, busNumber=1, sharedBus="noSharing")
    db = _renamed(
        sim,
        "DC0_C0_RP0_VM4",
        "db01",
        vim.vm.ConfigSpec(
            changeTrackingEnabled=True,
            cpuAllocation=vim.ResourceAllocationInfo(
                reservation=500, shares=vim.SharesInfo(level="high", shares=2000)
            ),
            deviceChange=[
                _add(lsi),
                _disk(-20, -10, 0, 2, thin=False, eager=False),
                _disk(-21, -10, 1, 3, thin=False, eager=True),
            ],
        ),
    )
    WaitForTask(db.CreateSnapshot_Task("before-upgrade", "", False, False))
    WaitForTask(db.CreateSnapshot_Task("after-upgrade", "", False, False))
    fields = sim.content.customFieldsManager
    owner = fields.AddCustomFieldDef(name="owner", moType=vim.VirtualMachine)
    fields.SetField(entity=db, key=owner.key, value="team-db")
    vmxnet3 = vim.vm.device.VirtualVmxnet3(
        key=-30,
        addressType="manual",
        macAddress=MANUAL_MAC,
        backing=vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo(port=port),
    )
    running = [
        vim.option.OptionValue(key="SET.guest.toolsRunningStatus", value="guestToolsRunning"),
        vim.option.OptionValue(key="SET.guest.toolsVersion", value="12352"),
    ]
    web = _renamed(
        sim,
        "DC0_C0_RP0_VM5",
        "web01",
        vim.vm.ConfigSpec(extraConfig=running, deviceChange=[_add(vmxnet3)]),
    )
    apps = sim.datacenter.vmFolder.CreateFolder("apps")
    WaitForTask(apps.MoveIntoFolder_Task([web]))
    e1000e = vim.vm.device.VirtualE1000e(
        key=-31,
        backing=vim.vm.device.VirtualEthernetCard.NetworkBackingInfo(deviceName="VM Network"),
    )
    _renamed(sim, "DC0_H0_VM4", "legacy01", vim.vm.ConfigSpec(deviceChange=[_add(e1000e)]))
    impossible = [_add(lsi), _disk(-22, -10, 0, 1, thin=True, eager=True)]
    _renamed(sim, "DC0_H0_VM5", "broken-disk", vim.vm.ConfigSpec(deviceChange=impossible))
    cluster = next(
        c
        for c in sim.datacenter.hostFolder.childEntity
        if isinstance(c, vim.ClusterComputeResource)
    )
    apart = vim.cluster.AntiAffinityRuleSpec(name="keep-apart", enabled=True, vm=[db, web])
    rack = vim.cluster.HostGroup(name="rack1", host=[cluster.host[0]])
    dbs = vim.cluster.VmGroup(name="dbs", vm=[db])
    on_rack = vim.cluster.VmHostRuleInfo(
        name="dbs-on-rack1", enabled=True, vmGroupName="dbs", affineHostGroupName="rack1"
    )
    spec = vim.cluster.ConfigSpecEx(
        groupSpec=[vim.cluster.GroupSpec(operation="add", info=g) for g in (rack, dbs)],
        rulesSpec=[vim.cluster.RuleSpec(operation="add", info=r) for r in (apart, on_rack)],
    )
    WaitForTask(cluster.ReconfigureComputeResource_Task(spec, True))


@pytest.fixture(scope="module")
def lab(vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path_factory: Any) -> Iterator[Simulated]:
    """One simulator for the module: every test here only reads it."""
    workdir = tmp_path_factory.mktemp("migrate-vcsim")
    with simulator(vcsim_binary, vcsim_tls, workdir, esx=False, vms_per_pool=6) as simulated:
        build_inventory(simulated.sim)
        yield simulated


@pytest.fixture
async def proxy(lab: Simulated) -> AsyncIterator[SoapProxy]:
    async with counting_proxy(lab.sim.port, lab.sim.tls) as counting:
        yield counting


def _target(fake: FakePVE) -> None:
    """The target holds debian-12, built by deploybot (its marks), besides the fake's own
    unmarked templates."""
    plan = build_plan("debian-12", "debian", 1, "jpve01a")
    config = fake.cluster.vms[9001].config
    config["description"] = build_description(plan)
    config["tags"] = build_tags(plan)


def _source_config(lab: Simulated, proxy: SoapProxy) -> Config:
    return Config.model_validate(lab.sim.config(port=proxy.port))


async def _plan_of(lab: Simulated, proxy: SoapProxy, fake: FakePVE, scope: Scope) -> Any:
    _target(fake)
    source = create(_source_config(lab, proxy), {PASSWORD_ENV: PASSWORD})
    target = testing.make_backend(fake)
    try:
        versions = await target.template_versions()
        return await make_plan(source, "pve", versions, PROFILES, scope, subnets=SUBNETS)
    finally:
        await source.close()
        await target.close()


async def test_the_plan_classifies_every_template_and_sends_no_change(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    plan = await _plan_of(lab, proxy, pve, Scope())
    found = {f.name: (f.category, f.profile) for f in plan.findings if f.kind == "template"}
    assert found == EXPECTED
    assert {f.name: f.category for f in plan.findings if f.kind == "vm"} == EXPECTED_VMS
    assert plan.counts() == {
        "template": {"rebuildable": 3, "on-target": 1, "not-mappable": 3},
        "vm": VM_COUNTS,
    }
    # Nothing but reads reached vcsim, for the templates and the VMs: every method the
    # proxy saw is a read.
    assert proxy.mutations() == []
    assert set(proxy.methods()) <= READ_METHODS, proxy.methods()
    assert proxy.session_objects_ok()
    # The marks and the templates; the marks again, the VMs, their folders, the
    # portgroups and the clusters' rules.
    assert proxy.methods()["RetrievePropertiesEx"] >= 7
    # The target was only read too.
    assert [r.method for r in pve.requests if r.method != "GET"] == []


async def test_the_reasons_say_how_each_profile_was_found_and_what_is_missing(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    plan = await _plan_of(lab, proxy, pve, Scope())
    by_name = {f.name: f for f in plan.findings}
    assert by_name["rocky-9-golden"].matched_by is MatchedBy.BUILD_MARK
    assert ("vmware-nic", "vmxnet3") in {
        (n.kind.value, n.value) for n in by_name["rocky-9-golden"].notes
    }
    el = by_name["el-base"]
    assert el.matched_by is MatchedBy.GUEST_OS and "'Rocky Linux 9'" in el.evidence
    kinds = {n.kind: n.value for n in el.notes}
    assert kinds[NoteKind.DATASOURCE_PINNED] == f"{PINNED_KEY}=[VMware]"
    assert kinds[NoteKind.GUESTINFO] == "guestinfo.metadata"
    assert kinds[NoteKind.VMWARE_INTERFACE] == "ens192"
    assert by_name["ubuntu-24.04"].evidence.endswith("name 'ubuntu-24.04'")
    on = by_name["debian-12"]
    assert (on.target_name, on.target_version) == ("debian-12", 1)
    assert by_name["win2019"].missing is Missing.UNKNOWN_OS
    assert by_name["debian-old"].missing is Missing.NO_VERSION
    assert by_name["debian-old"].detail == ("debian", "debian-12", "debian-13")
    assert by_name["legacy-build"].missing is Missing.UNKNOWN_PROFILE
    assert by_name["legacy-build"].detail[0] == "centos-7"
    # The guestinfo document's value is not kept in the facts: only its digest.
    facts = next(f for f in plan.facts if f.name == "el-base")
    assert dict(facts.extra)["guestinfo.metadata"].startswith("sha256:")
    assert "aW5zdGFuY2Ut" not in json.dumps(plan.document())


def _notes(plan: Any, name: str) -> dict[NoteKind, list[tuple[str, tuple[str, ...]]]]:
    (finding,) = [f for f in plan.findings if f.name == name]
    notes: dict[NoteKind, list[tuple[str, tuple[str, ...]]]] = {}
    for note in finding.notes:
        notes.setdefault(note.kind, []).append((note.value, note.detail))
    return notes


async def test_each_vm_says_what_does_not_travel_and_what_needs_a_decision(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    plan = await _plan_of(lab, proxy, pve, Scope())
    as_is = _notes(plan, "DC0_C0_RP0_VM3")
    assert as_is[NoteKind.NIC_MODEL] == [("ethernet-0", ("e1000", "e1000"))]
    ((_, (network, backing, subnet, segment)),) = as_is[NoteKind.NETWORK]
    assert (network, backing, subnet, segment) == (
        "DC0_DVPG0",
        "distributed portgroup",
        "127.0.20.0/24",
        "vmbr0 VLAN 20",
    )
    assert as_is[NoteKind.CONTROLLER] == [("disk-202-0", ("pvscsi", "scsihw=pvscsi"))]
    assert [d[1][:2] for d in as_is[NoteKind.DISK]] == [("1 MiB", "thin")]
    assert as_is[NoteKind.HARDWARE_VERSION] == [("vmx-13", ())]
    assert as_is[NoteKind.TOOLS] == [("not running", ("none reported",))]
    assert NoteKind.MAC_GENERATED in as_is and NoteKind.FOLDER not in as_is

    db = _notes(plan, "db01")
    assert db[NoteKind.SNAPSHOTS] == [("2", ("before-upgrade", "after-upgrade"))]
    assert db[NoteKind.CHANGE_TRACKING] == [("enabled", ())]
    assert db[NoteKind.CUSTOM_ATTRIBUTES] == [("1", ("owner",))]
    assert db[NoteKind.DRS_RULES] == [
        ("2", ("dbs-on-rack1 (vm-host)", "keep-apart (anti-affinity)"))
    ]
    assert db[NoteKind.ALLOCATION] == [("cpu", ("500 MHz", "none", "custom:2000"))] or db[
        NoteKind.ALLOCATION
    ] == [("cpu", ("500 MHz", "none", "high"))]
    changes = {value: detail for value, detail in db[NoteKind.CONTROLLER_CHANGE]}
    assert set(changes.values()) == {("lsilogic", "scsihw=lsi")} and len(changes) == 2
    states = sorted(detail[:2] for _label, detail in db[NoteKind.DISK])
    assert states == [
        ("1 MiB", "thin"),
        ("2 GiB", "thick-lazy-zeroed"),
        ("3 GiB", "thick-eager-zeroed"),
    ]

    web = _notes(plan, "web01")
    assert [d for _v, d in web[NoteKind.NIC_MODEL_CHANGE]] == [("vmxnet3", "e1000")]
    assert [d for _v, d in web[NoteKind.MAC_MANUAL]] == [(MANUAL_MAC,)]
    assert web[NoteKind.DRS_RULES] == [("1", ("keep-apart (anti-affinity)",))]
    assert web[NoteKind.FOLDER] == [("apps", ())]
    assert web[NoteKind.TOOLS] == [("running", ("12352",))]

    legacy = _notes(plan, "legacy01")
    blocked = {d[0]: d for _v, d in legacy[NoteKind.NO_SEGMENT]}
    # Its subnet is known; that subnet has no segment on pve.
    assert blocked["VM Network"] == ("VM Network", "standard network", "127.0.40.0/24", "")
    assert [d for _v, d in legacy[NoteKind.NIC_MODEL]][-1] == ("e1000e", "e1000e")
    broken = _notes(plan, "broken-disk")
    assert [d for _v, d in broken[NoteKind.DISK_IMPOSSIBLE]] == [("1 GiB",)]
    # Provisioning is the two flags as read, never a fourth state.
    facts = next(f for f in plan.vm_facts if f.name == "broken-disk")
    assert [(d.thin, d.eager) for d in facts.disks if d.capacity_kib > 1024] == [(True, True)]
    assert proxy.mutations() == []


async def test_the_plan_reads_the_tags_of_each_vm_and_template_and_changes_nothing(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    plan = await _plan_of(lab, proxy, pve, Scope())
    tagged = {f.name: f.tags for f in plan.facts} | {f.name: f.tags for f in plan.vm_facts}
    assert set(tagged) == set(EXPECTED) | set(EXPECTED_VMS)
    assert tagged == {name: TAGS.get(name, ()) for name in tagged}
    assert plan.tags_unreadable is None
    assert _notes(plan, "db01")[NoteKind.TAGS] == [("2", ("Backup/daily", "Owner/Team DB"))]
    assert _notes(plan, "web01")[NoteKind.TAGS] == [("1", ("Env/production",))]
    assert _notes(plan, "el-base")[NoteKind.TAGS] == [("1", ("Golden/approved",))]
    assert NoteKind.TAGS not in _notes(plan, "DC0_C0_RP0_VM3")
    # Tagged VMs needed decisions (or were blocked) already: the counts are the same.
    assert plan.counts()["vm"] == VM_COUNTS
    # The vAPI: one login, one batch for the templates and one for the VMs, each of the
    # 4 tags and 4 categories named once, one logout; none of it a change.
    calls = proxy.rest_calls()
    assert calls["POST /rest/com/vmware/cis/session"] == 1
    assert calls["DELETE /rest/com/vmware/cis/session"] == 1
    batch = "POST /rest/com/vmware/cis/tagging/tag-association?list-attached-tags-on-objects"
    assert calls[batch] == 2
    gets = [r.path for r in proxy.rest if r.method == "GET"]
    assert len(gets) == len(set(gets)) == 8
    assert sum("/tagging/tag/id:" in g for g in gets) == 4
    assert sum(calls.values()) == 12
    assert proxy.rest_mutations() == [] and proxy.mutations() == []
    assert set(proxy.methods()) <= READ_METHODS


def test_the_proxy_judges_rest_requests_by_what_they_do() -> None:
    """What the proxy counts as a vAPI change (the judge of the test above)."""
    session, tags = "/rest/com/vmware/cis/session", "/rest/com/vmware/cis/tagging"
    reads = [
        RestSeen("POST", session, ""),
        RestSeen("DELETE", session, ""),
        RestSeen("POST", "/api/session", ""),
        RestSeen("GET", f"{tags}/tag/id:x", ""),
        RestSeen("POST", f"{tags}/tag-association", "list-attached-tags-on-objects"),
    ]
    changes = [
        RestSeen("POST", f"{tags}/tag", ""),
        RestSeen("POST", f"{tags}/tag-association/id:x", "attach"),
        RestSeen("POST", f"{tags}/tag-association", "attach-multiple-tags-to-object"),
        RestSeen("PATCH", f"{tags}/category/id:x", ""),
        RestSeen("DELETE", f"{tags}/tag/id:x", ""),
        RestSeen("PUT", "/api/vcenter/vm/vm-1", ""),
        RestSeen("POST", session, "refresh"),
    ]
    assert [rest_mutating(r) for r in reads] == [False] * len(reads)
    assert [rest_mutating(r) for r in changes] == [True] * len(changes)


async def test_the_proxy_counts_every_request_it_cannot_read_as_a_change(
    lab: Simulated,
) -> None:
    """No request is dropped from the count: a PUT or DELETE outside the vAPI (a
    datastore upload, an NFC lease), a POST whose body is no SOAP call, and a SOAP read
    sent with another method are changes; a plain GET reads. (In front of a closed port:
    nothing reaches the simulator.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        closed = taken.getsockname()[1]
    read = b"<soapenv:Envelope><soapenv:Body><RetrievePropertiesEx></RetrievePropertiesEx>"
    sent = [
        ("PUT", "/folder/x.iso", b"data"),
        ("DELETE", "/nfc/52a1/disk-0.vmdk", b""),
        ("POST", "/sdk", b"<not-soap/>"),
        ("PUT", "/sdk", read),
        ("GET", "/sdk/vimServiceVersions.xml", b""),
        ("POST", "/sdk", read),
    ]
    async with (
        counting_proxy(closed, lab.sim.tls) as counting,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=_tls(lab.sim.tls))) as client,
    ):
        for method, path, body in sent:
            url = f"https://127.0.0.1:{counting.port}{path}"
            async with client.request(method, url, data=body) as answer:
                await answer.read()
    assert [s.request for s in counting.mutations()] == [
        "PUT /folder/x.iso",
        "DELETE /nfc/52a1/disk-0.vmdk",
        "POST /sdk",
        "PUT /sdk",
    ]
    assert counting.reads == ["GET /sdk/vimServiceVersions.xml"]
    assert counting.methods()["RetrievePropertiesEx"] == 1


async def test_a_tag_added_after_the_plan_makes_the_apply_refuse_the_source(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    plan = await _plan_of(lab, proxy, pve, Scope(name="*01"))
    operator = Tagger(lab.sim)  # straight to vcsim, not through the proxy
    operator.attach("web01", "Change/after-the-plan")
    source = create(_source_config(lab, proxy), {PASSWORD_ENV: PASSWORD})
    try:
        try:
            with pytest.raises(SourceChanged) as refused:
                await check_source(plan, source)  # the apply's check of its source
        finally:
            operator.detach("web01", "Change/after-the-plan")
        assert await source_unchanged(plan, source)  # as it was: the plan applies again
    finally:
        await source.close()
    assert "changed since this plan was made (web01 changed)" in refused.value.message
    assert proxy.rest_mutations() == [] and proxy.mutations() == []


async def test_a_plan_made_without_tags_applies_once_they_can_be_read(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    """A plan whose tags were not read (unreadable then, or made before tags were read)
    is compared without them once they can be read; a plan made with tags whose tags
    cannot be read now is refused saying so, not that everything changed."""
    plan = await _plan_of(lab, proxy, pve, Scope(name="*01"))
    assert any(f.tags for f in plan.vm_facts)  # the lab's VMs have tags attached
    facts = tuple(dataclasses.replace(f, tags=None) for f in plan.facts)
    vms = tuple(dataclasses.replace(v, tags=None) for v in plan.vm_facts)
    digest = source_digest(plan.source, plan.scope, facts, vms)
    untagged = dataclasses.replace(
        plan, facts=facts, vm_facts=vms, digest=digest, tags_unreadable="refused (401)"
    )
    before_tags = dataclasses.replace(untagged, tags_unreadable=None)
    source = create(_source_config(lab, proxy), {PASSWORD_ENV: PASSWORD})
    try:
        for made_without in (untagged, before_tags):
            await check_source(made_without, source)
            assert await source_unchanged(made_without, source)
    finally:
        await source.close()
    proxy.rest_answers[""] = 404  # the tagging service is gone now
    source = create(_source_config(lab, proxy), {PASSWORD_ENV: PASSWORD})
    try:
        with pytest.raises(SourceChanged) as refused:
            await check_source(plan, source)
        assert not await source_unchanged(plan, source)
        await check_source(untagged, source)  # made without tags: none needed now
    finally:
        await source.close()
    assert f"The tags of {plan.source} could not be read now: " in refused.value.message
    assert "changed" not in refused.value.message.split(". This plan")[0]
    assert proxy.rest_mutations() == [] and proxy.mutations() == []


async def test_the_plan_file_keeps_the_vms_and_their_digest(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE, tmp_path: Path
) -> None:
    plan = await _plan_of(lab, proxy, pve, Scope())
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    again = read_plan(path)
    assert again.vm_facts == plan.vm_facts and again.findings == plan.findings
    assert again.counts() == plan.counts()
    # A VM's changed fact changes the digest: the plan would be stale.
    first, *rest = plan.vm_facts
    edited = [dataclasses.replace(first, change_tracking=not first.change_tracking), *rest]
    assert source_digest(plan.source, plan.scope, plan.facts, edited) != plan.digest
    # A plan without VMs digests as before VMs were read (older plan files stay valid).
    assert source_digest(plan.source, plan.scope, plan.facts, []) == source_digest(
        plan.source, plan.scope, plan.facts
    )
    document = json.loads(path.read_text())
    (db,) = [f for f in document["vm_facts"] if f["name"] == "db01"]
    db["snapshots"] = []  # an edited plan: the snapshots "gone"
    path.write_text(json.dumps(document))
    with pytest.raises(PlanFileError, match="do not match its digest"):
        read_plan(path)


async def test_folder_and_name_scopes_and_the_digest(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE
) -> None:
    golden = await _plan_of(lab, proxy, pve, Scope(folder="golden"))
    assert sorted(f.name for f in golden.findings) == ["el-base", "win2019"]
    assert golden.counts()["template"] == {"rebuildable": 1, "on-target": 0, "not-mappable": 1}
    assert golden.counts()["vm"] == {"moves-as-is": 0, "needs-decisions": 0, "blocked": 0}
    apps = await _plan_of(lab, proxy, pve, Scope(folder="apps"))
    assert [(f.kind, f.name) for f in apps.findings] == [("vm", "web01")]
    webs = await _plan_of(lab, proxy, pve, Scope(name="*01"))
    assert sorted(f.name for f in webs.findings) == ["db01", "legacy01", "web01"]
    debian = await _plan_of(lab, proxy, pve, Scope(name="debian-*"))
    assert sorted(f.name for f in debian.findings) == ["debian-12", "debian-old"]
    # The digest covers the facts read: the same reads give the same digest, any
    # changed fact another.
    again = await _plan_of(lab, proxy, pve, Scope(name="debian-*"))
    assert again.digest == debian.digest != golden.digest
    facts = list(debian.facts)
    changed = [facts[0].__class__(**{**facts[0].__dict__, "annotation": "edited"}), *facts[1:]]
    assert source_digest(debian.source, debian.scope, changed) != debian.digest
    assert proxy.mutations() == []


def _found(conn: Any, uuid: str) -> Any:
    vm = conn.find_vm(uuid)
    assert vm is not None
    return vm


async def test_a_standalone_esxi_host_is_read_the_same_way(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path
) -> None:
    """ESXi (HostAgent) through the same proxy: its one template, only reads, and a
    source changed after the plan is noticed by reading it again."""
    with simulator(vcsim_binary, vcsim_tls, tmp_path, esx=True) as esxi:
        counting = SoapProxy(esxi.sim.port, esxi.sim.tls)
        await counting.start()
        try:
            config = Config.model_validate(esxi.sim.config(port=counting.port))
            source = create(config, {PASSWORD_ENV: PASSWORD})
            try:
                plan = await make_plan(source, "pve", [], PROFILES, Scope())
                # An ESXi host has no tagging service: not asked, and said so.
                assert plan.tags_unreadable == ESXI_HAS_NO_TAGS and counting.rest == []
                assert [f.tags for f in plan.facts] + [f.tags for f in plan.vm_facts] == [None] * 2
                text = "\n".join(plan_lines(plan, None))
                assert f"\n  Tags not readable: {ESXI_HAS_NO_TAGS}. The plan lists no" in text
                # Asked all the same, its /rest answers 404: not readable, not a failure.
                reader = TagReader(endpoint_of(config), PASSWORD, _tls(esxi.sim.tls))
                async with reader:
                    with pytest.raises(TagsUnreadable, match="has no vAPI tagging service"):
                        await reader.attached(["vm-1"])
                assert await source_unchanged(plan, source)
                # An operator edits the template's notes: the source changed since.
                (uuid,) = [u for u, n in esxi.sim.vms().items() if n == "ubuntu-24.04"]
                template = esxi.sim.vm(uuid)
                pool = esxi.sim.datacenter.hostFolder.childEntity[0]
                template.MarkAsVirtualMachine(pool=pool.resourcePool, host=pool.host[0])
                esxi.sim.set_annotation(uuid, "Ubuntu 24.04, edited")
                template.MarkAsTemplate()
                assert not await source_unchanged(plan, source)
                # An operator turns changed block tracking on for a VM: a plan made
                # before that is stale too.
                fresh = await make_plan(source, "pve", [], PROFILES, Scope())
                assert await source_unchanged(fresh, source)
                (vm_uuid,) = [f.source_id for f in fresh.vm_facts if f.name == "ha-host_VM1"]
                cbt = vim.vm.ConfigSpec(changeTrackingEnabled=True)
                WaitForTask(esxi.sim.vm(vm_uuid).ReconfigVM_Task(cbt))
                assert not await source_unchanged(fresh, source)
            finally:
                await source.close()
        finally:
            await counting.stop()
    # Its VM is on VM Network, which no subnet maps (none given): blocked, and said so.
    vms = [f for f in plan.findings if f.kind == "vm"]
    assert [(f.name, f.category) for f in vms] == [("ha-host_VM1", Category.BLOCKED)]
    assert NoteKind.NO_SEGMENT in {n.kind for n in vms[0].notes}
    # Its guest id says no OS (vcsim's otherGuest): the name says which profile.
    ((finding),) = [f for f in plan.findings if f.kind == "template"]
    assert (finding.name, finding.category, finding.profile) == (
        "ubuntu-24.04",
        Category.REBUILDABLE,
        "ubuntu-24.04",
    )
    assert finding.evidence == "guest id 'otherGuest', name 'ubuntu-24.04'"
    assert counting.mutations() == [] and set(counting.methods()) <= READ_METHODS


def _tls(files: TlsFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(files.ca))


async def test_the_tag_reader_says_why_tags_cannot_be_read(
    lab: Simulated, proxy: SoapProxy
) -> None:
    """A refused vAPI login is "not readable" (the plan goes on); a server that does not
    answer is Unreachable, as it is for SOAP; the password never shows."""
    endpoint = endpoint_of(_source_config(lab, proxy))
    async with TagReader(endpoint, "", _tls(lab.sim.tls)) as refused:  # vcsim wants one
        with pytest.raises(TagsUnreadable, match=r"refuses the vAPI login to .* \(401\)"):
            await refused.attached(["vm-1"])
    assert refused.calls == {"POST login": 1}  # no logout: there was no session
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        closed = taken.getsockname()[1]  # nothing listens there once closed
    gone = dataclasses.replace(endpoint, port=closed)
    async with TagReader(gone, PASSWORD, _tls(lab.sim.tls)) as reader:
        with pytest.raises(Unreachable, match="does not answer the login") as unreachable:
            await reader.attached(["vm-1"])
    assert PASSWORD not in unreachable.value.message
    assert proxy.rest_mutations() == []


async def test_the_tag_reader_leaves_out_a_deleted_tag_and_follows_no_redirect(
    lab: Simulated, proxy: SoapProxy
) -> None:
    """A tag deleted between the batch that named it and its GET (404) is no longer
    attached: left out, not "no tagging service". A redirect is not followed (the
    session id would go elsewhere): tags not readable, saying so."""
    endpoint = endpoint_of(_source_config(lab, proxy))
    operator = Tagger(lab.sim)  # straight to vcsim, not through the proxy
    operator.attach("web01", "Change/vanishing", "Change/staying")
    web01 = find_vm(lab.sim, "web01")._moId
    try:
        proxy.rest_answers[f"{TAG}/id:{operator.tag_id('Change/vanishing')}"] = 404
        async with TagReader(endpoint, PASSWORD, _tls(lab.sim.tls)) as reader:
            tags = await reader.attached([web01])
    finally:
        operator.detach("web01", "Change/vanishing")
        operator.detach("web01", "Change/staying")
    assert "Change/staying" in tags[web01] and "Change/vanishing" not in tags[web01]
    proxy.rest_answers = {SESSION: 302}
    sent = len(proxy.rest)
    async with TagReader(endpoint, PASSWORD, _tls(lab.sim.tls)) as redirected:
        with pytest.raises(TagsUnreadable, match=r"with a redirect \(302\), which is not"):
            await redirected.attached([web01])
    assert [r.path for r in proxy.rest[sent:]] == [SESSION] and proxy.reads == []
    assert proxy.rest_mutations() == []


async def test_a_cancelled_close_still_ends_the_soap_session(
    lab: Simulated, proxy: SoapProxy
) -> None:
    """The source's close cancelled while the tags' logout is on its way: the SOAP
    session is logged out all the same."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def hold_the_logout(seen: RestSeen) -> None:
        if seen.method == "DELETE":
            arrived.set()
            await release.wait()

    source = create(_source_config(lab, proxy), {PASSWORD_ENV: PASSWORD})
    await source.vm_facts(Scope(name="web01"))  # logged in to SOAP and to the vAPI
    assert source.tags_unreadable is None
    proxy.rest_gate = hold_the_logout
    closing = asyncio.create_task(source.close())
    try:
        await arrived.wait()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
    finally:
        release.set()
    assert proxy.methods()["Logout"] == 1


def test_the_read_only_type_has_no_method_that_changes_anything() -> None:
    """Read-only by construction: what the type offers is reads (and its own close)."""
    public = {name for name in dir(ReadOnlyVSphere) if not name.startswith("_")}
    assert public == {"template_facts", "vm_facts", "api_calls", "close"}
    # Its tags' reader too: the tags of some objects, and its logout.
    assert {name for name in dir(TagReader) if not name.startswith("_")} == {
        "attached",
        "close",
    }


async def test_the_read_only_stub_refuses_a_change_before_sending_it(
    lab: Simulated, proxy: SoapProxy
) -> None:
    session = Session(endpoint_of(_source_config(lab, proxy)), PASSWORD, stub=ReadOnlyStub)
    uuid = next(u for u, name in lab.sim.vms().items() if name == "DC0_C0_RP0_VM3")
    operator_view = lab.sim.content.viewManager.CreateContainerView(
        lab.sim.content.rootFolder, [vim.Folder], True
    )
    try:
        conn = await session.connection()
        with pytest.raises(WriteRefused, match="Destroy_Task is not a read"):
            await session.run(lambda op: _found(op.conn, uuid).Destroy_Task(), changes=False)
        with pytest.raises(WriteRefused, match="MarkAsTemplate"):
            await session.run(lambda op: _found(op.conn, uuid).MarkAsTemplate(), changes=False)
        # A view this session did not make is not its own to destroy.
        foreign = vim.view.ContainerView(operator_view._moId, conn.stub)
        with pytest.raises(WriteRefused, match="DestroyView"):
            await session.run(lambda op: foreign.DestroyView(), changes=False)
        # Its own view it may destroy again.
        own = await session.run(
            lambda op: op.conn.content.viewManager.CreateContainerView(
                op.conn.content.rootFolder, [vim.Folder], True
            ),
            changes=False,
        )
        await session.run(lambda op: own.DestroyView(), changes=False)
        stub = conn.stub
        assert isinstance(stub, ReadOnlyStub)
        assert stub.refused == {"Destroy_Task": 1, "MarkAsTemplate": 1, "DestroyView": 1}
        sent = proxy.methods()
        assert sent["Destroy_Task"] == sent["MarkAsTemplate"] == 0
        assert sent["DestroyView"] == 1 and proxy.mutations() == []
        assert "Destroy_Task" not in session.api_calls()
    finally:
        await session.close()
        operator_view.DestroyView()
    assert lab.sim.vms()[uuid] == "DC0_C0_RP0_VM3"  # still there


async def test_the_proxy_sees_the_changes_a_full_session_sends(
    lab: Simulated, proxy: SoapProxy
) -> None:
    """The counting is honest: the backend's own (writing) session through the same
    proxy shows up in its count."""
    session = Session(endpoint_of(_source_config(lab, proxy)), PASSWORD)

    def scratch(conn: Any) -> None:
        root = conn.content.rootFolder.childEntity[0].vmFolder
        folder = root.CreateFolder("scratch")
        WaitForTask(folder.Destroy_Task())

    try:
        await session.run(lambda op: scratch(op.conn))
    finally:
        await session.close()
    assert [s.method for s in proxy.mutations()] == ["CreateFolder", "Destroy_Task"]


def _toml(entry: dict[str, Any]) -> str:
    lines = []
    for key, value in entry.items():
        text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
        lines.append(f"{key} = {text}")
    return "\n".join(lines)


def _cli_config(lab: Simulated, proxy: SoapProxy, pve: FakePVE, tmp_path: Path) -> Path:
    """A configuration with vcsim (through the proxy) as vcenter and the fake as pve."""
    _target(pve)
    config = tmp_path / "deploybot.toml"
    source = lab.sim.config(port=proxy.port)
    config.write_text(
        f'database = "{tmp_path / "db.sqlite"}"\nlog_file = "{tmp_path / "bot.log"}"\n\n'
        f"[[backends]]\n{_toml(source)}\n\n"
        f"[[backends]]\n{_toml(testing.config_data(pve, storage='bulk-nfs'))}\n\n"
        '[[subnets]]\ncidr = "127.0.10.0/24"\ngateway = "127.0.10.1"\n'
        'dns = ["127.0.10.2"]\n'
        '[subnets.segments.vcenter]\nnetwork = "DC0_DVPG0"\n'
        '[subnets.segments.pve]\nbridge = "vmbr0"\nvlan = 20\n\n'
        '[[subnets]]\ncidr = "127.0.40.0/24"\ngateway = "127.0.40.1"\n'
        '[subnets.segments.vcenter]\nnetwork = "VM Network"\n\n'
        '[defaults]\nbackend = "pve"\n'
    )
    return config


async def test_the_cli_prints_the_table_and_writes_the_plan_file(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE, tmp_path: Path
) -> None:
    config = _cli_config(lab, proxy, pve, tmp_path)
    out = tmp_path / "plan.json"
    code, text = await _deploybot(
        config, tmp_path, pve, "migrate", "plan", "--from", "vcenter", "--to", "pve",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, text
    assert "Templates: 7 in scope: 3 rebuild, 1 on target, 3 not mappable." in text
    assert "Target pve: 1 template(s) deploybot built: debian-12 (debian-12 v1)." in text
    assert "el-base" in text and "cloud-init datasource pinned" in text
    assert "VMs: 5 in scope: 1 moves as is, 2 decisions, 2 blocked." in text
    assert "decide: 2 snapshot(s) (before-upgrade, after-upgrade)" in text
    assert "(1 GiB): thin and eagerly scrubbed at once, which vSphere cannot have" in text
    assert "subnet 127.0.40.0/24 has no segment on pve" in text
    assert "on vmbr0 VLAN 20 on the target" in text
    # The target's storage (bulk-nfs) is NFS: the disks become qcow2 and stay thin.
    assert "thin: qcow2 on the target, stays thin" in text
    assert "(3 GiB) thick eager zeroed: qcow2 on the target, thin there" in text
    assert "qemu-guest-agent not known" in text and "Tags not readable" not in text
    assert (
        "decide: 2 vSphere tag(s) (Backup/daily, Owner/Team DB): kept in vCenter's tagging "
        "service, they do not travel; Proxmox tags have no categories: they could be set as "
        "Backup.daily, Owner.Team-DB"
    ) in text
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    document = json.loads(out.read_text())
    assert document["counts"]["template"] == {
        "rebuildable": 3,
        "on-target": 1,
        "not-mappable": 3,
    }
    assert document["source_digest"] in text
    assert document["counts"]["vm"] == VM_COUNTS
    assert sorted(f["name"] for f in document["vm_facts"]) == sorted(EXPECTED_VMS)
    assert {f["name"]: tuple(f["tags"]) for f in document["vm_facts"] if f["tags"]} == {
        n: t for n, t in TAGS.items() if n in EXPECTED_VMS
    }
    assert [f["tags"] for f in document["facts"] if f["name"] == "el-base"] == [["Golden/approved"]]
    assert PASSWORD not in out.read_text() + text
    code, text = await _deploybot(
        config, tmp_path, pve, "migrate", "plan", "--from", "vcenter", "--to", "pve",
        "--name", "win*", "--json",
    )  # fmt: skip
    assert code == 0, text
    (only,) = json.loads(text)["findings"]
    assert only["name"] == "win2019" and "no build profile is for its guest OS" in only["reason"]
    code, text = await _deploybot(
        config, tmp_path, pve, "migrate", "plan", "--from", "pve", "--to", "vcenter"
    )
    assert code == 2 and "a migration reads a vSphere backend" in text
    code, text = await _deploybot(
        config, tmp_path, pve, "migrate", "plan", "--from", "pve", "--to", "pve"
    )
    assert code == 2 and "--from and --to both name pve" in text
    code, text = await _deploybot(
        config, tmp_path, pve, "migrate", "plan", "--from", "nope", "--to", "pve"
    )
    assert code == 2 and "--from nope: no such backend" in text
    assert proxy.mutations() == []


async def test_the_cli_apply_refuses_a_plan_whose_vm_was_tagged_since(
    lab: Simulated, proxy: SoapProxy, pve: FakePVE, tmp_path: Path
) -> None:
    config = _cli_config(lab, proxy, pve, tmp_path)
    out = tmp_path / "plan.json"
    code, text = await _deploybot(
        config, tmp_path, pve, "migrate", "plan", "--from", "vcenter", "--to", "pve",
        "--name", "*01", "--out", str(out),
    )  # fmt: skip
    assert code == 0 and "1 vSphere tag(s) (Env/production)" in text, text
    operator = Tagger(lab.sim)  # straight to vcsim, not through the proxy
    operator.attach("db01", "Change/tagged-by-the-cli-test")
    try:
        code, text = await _deploybot(config, tmp_path, pve, "migrate", "apply", str(out))
    finally:
        operator.detach("db01", "Change/tagged-by-the-cli-test")
    assert code != 0 and "changed since this plan was made (db01 changed)" in text, text
    assert "Nothing was started" in text
    assert proxy.rest_mutations() == [] and proxy.mutations() == []
    assert [r.method for r in pve.requests if r.method != "GET"] == []


async def _deploybot(config: Path, cwd: Path, fake: FakePVE, *args: str) -> tuple[int, str]:
    secrets = {"PVE_TOKEN_SECRET": fake.token_secret, "VCSIM_PASSWORD": PASSWORD}
    code, out, err = await run_async(config, cwd, secrets, *args)
    return code, out + err
