# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)
"""The vSphere backend's cost does not grow with the inventory: a deploy's checks and
moves (the template list, the name check, the plan, the clone or disk copy with its
MAC check on ESXi, the power-on) make the same SOAP requests, and read the same bytes
(within a small constant: longer object ids), with 200 VMs more in vcsim; container
views and the VM tracker are made once per session, not per lookup. Counted at the
SOAP transport, not timed. Whole deploys through the real queue, pipeline and store
(with the address conflict check at admission and in `check_free`) stay within the
goal of requests (25, and 9 more since deploybot chooses the guest's host key:
issue 28), and their bytes within 10%, with 400 VMs more; the check still
refuses an address a VM took after the tracker's first read; and a subnet's `vms_on`
keeps the check from asking (and logging in to) backends its VMs do not live on.

The tracker answers only what changed since its last look, so these tests also check
that it still sees what others do meanwhile: a VM renamed, made or removed, a VM
turned into a template, and that a VM remembered by instance UUID is found again when
that object no longer has it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec, VMNotFound, VMRef
from backends.vsphere import VSphereBackend
from bot.app.runtime import make_backend, running_deployer
from bot.models import JobState
from bot.models.errors import BackendError, Conflict
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder
from tests.support.vsphere.pipeline import SUBNET, Sshd, deploy, deployer_for, vsphere_settings
from tests.support.vsphere.simulator import (
    PASSWORD,
    PASSWORD_ENV,
    TEMPLATE,
    Simulated,
    TlsFiles,
    esxi_fixture,  # noqa: F401
    simulator,
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

EXTRA = 200  # VMs more than vcsim's default inventory (2 per resource pool)
SLACK_BYTES = 2000  # ids like vm-1234 instead of vm-12, in a few answers
PIPELINE_EXTRA = (400, 2000)  # the same, for whole deploys (issue 25's sizes)
# Per whole deploy (benchmarks/bench_vsphere.py --scale): 25, plus what the host key
# deploybot chooses costs (issue 28): written at the identity step and removed once SSH
# answered, each a reconfigure and its task, and the check that it is gone.
GOAL_REQUESTS = 25 + 9


async def deploy_moves(backend: VSphereBackend, i: int) -> VMRef:
    """What a deploy asks of the backend up to its power-on (the address and SSH
    steps need a guest; their cost is one watch and no inventory read)."""
    await backend.templates()
    assert await backend.find_by_name(f"web0{i}") == []
    spec = CloneSpec(f"jsc000{i}", f"web0{i}", TEMPLATE)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.power_on(ref)
    return ref


async def deploy_cost(
    binary: Path, tls: TlsFiles, tmp: Path, esx: bool, extra: int
) -> tuple[Counter[str], int]:
    """SOAP calls and bytes of two deploys' moves, after a first one that logged in
    and learnt the inventory."""
    pools = 1 if esx else 2  # vcsim makes its VMs per resource pool
    with simulator(binary, tls, tmp, esx=esx, vms_per_pool=2 + extra // pools) as lab:
        assert len(lab.sim.vms()) >= 2 * pools + extra
        backend = lab.sim.backend()
        try:
            await deploy_moves(backend, 0)
            calls, sent = backend.api_calls(), backend.api_bytes()
            for i in (1, 2):
                await deploy_moves(backend, i)
            return backend.api_calls() - calls, sum((backend.api_bytes() - sent).values())
        finally:
            await backend.close()


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_deploy_cost_does_not_grow_with_the_vms(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path, mode: str
) -> None:
    esx = mode == "esxi"
    small_calls, small_bytes = await deploy_cost(vcsim_binary, vcsim_tls, tmp_path, esx, 0)
    big_calls, big_bytes = await deploy_cost(vcsim_binary, vcsim_tls, tmp_path, esx, EXTRA)
    print(
        f"{mode}, per 2 deploys: {sum(small_calls.values())} calls, {small_bytes} B with 0 "
        f"extra VMs; {sum(big_calls.values())} calls, {big_bytes} B with {EXTRA}"
    )
    assert big_calls == small_calls
    assert abs(big_bytes - small_bytes) < SLACK_BYTES, (small_bytes, big_bytes)
    # Views and the tracker's collector are kept for the session: none is made or
    # destroyed by a later deploy, and no later read goes through every VM.
    assert big_calls["CreateContainerView"] == 0
    assert big_calls["DestroyView"] == 0


@pytest.fixture
async def backend(vcenter: Simulated) -> AsyncIterator[VSphereBackend]:
    vsphere = vcenter.sim.backend()
    yield vsphere
    await vsphere.close()


def operator_vm(lab: Simulated, name: str) -> Any:
    return next(v for v in lab.sim.datacenter.vmFolder.childEntity if v.name == name)


async def test_the_name_check_sees_what_others_did_since_its_last_look(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    assert await backend.find_by_name("db01") == []  # the tracker's first, full look
    vm = operator_vm(vcenter, "DC0_H0_VM1")
    WaitForTask(vm.Rename_Task("db01"))
    assert [v.vm_id for v in await backend.find_by_name("db01")] == [vm.config.instanceUuid]
    assert await backend.find_by_name("DC0_H0_VM1") == []
    # A VM made by someone else, in another folder.
    folder = vcenter.sim.datacenter.vmFolder.CreateFolder("elsewhere")
    pool = vm.resourcePool
    config = vim.vm.ConfigSpec(name="db02", files=vim.vm.FileInfo(vmPathName="[LocalDS_0]"))
    task = folder.CreateVM_Task(config=config, pool=pool)
    WaitForTask(task)
    made = task.info.result
    assert [v.name for v in await backend.find_by_name("db02")] == ["db02"]
    WaitForTask(made.Destroy_Task())
    WaitForTask(vm.PowerOffVM_Task())
    WaitForTask(vm.Destroy_Task())
    assert await backend.find_by_name("db01") == []
    assert await backend.find_by_name("db02") == []
    calls = backend.api_calls()
    assert calls["CreatePropertyCollector"] == 1  # one tracker, whose filter stays
    assert calls["RetrievePropertiesEx"] == 2  # only the details of the two found


async def test_a_vm_turned_into_a_template_is_listed_at_once(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    assert [t.name for t in await backend.templates()] == [TEMPLATE]
    before = backend.api_calls()
    assert [t.name for t in await backend.templates()] == [TEMPLATE]
    # Nothing changed: the listing is the one read before, after one look for changes.
    assert backend.api_calls() - before == Counter(WaitForUpdatesEx=1)
    # A template made by cloning a VM (vcsim's MarkAsTemplate announces no change,
    # which vCenter does; its clone's first state already has the mark).
    vm = operator_vm(vcenter, "DC0_H0_VM1")
    location = vim.vm.RelocateSpec(pool=vm.resourcePool)
    spec = vim.vm.CloneSpec(location=location, template=True)
    WaitForTask(vm.CloneVM_Task(folder=vm.parent, name="debian-13", spec=spec))
    assert [t.name for t in await backend.templates()] == ["debian-13", TEMPLATE]
    # A template renamed.
    WaitForTask(operator_vm(vcenter, "debian-13").Rename_Task("debian-13.1"))
    assert [t.name for t in await backend.templates()] == ["debian-13.1", TEMPLATE]


async def test_a_remembered_vm_that_lost_its_instance_uuid_is_not_ours(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """The object a UUID was found at is tried first, and used only while it still has
    that instance UUID (after a database rebuild an id can name another VM)."""
    spec = CloneSpec("jsc0009", "web09", TEMPLATE)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    assert await backend.find_vm(ref) is not None
    vm = vcenter.sim.vm(ref.vm_id)
    other = "4210a1b2-0000-4000-8000-00000000abcd"
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(instanceUuid=other)))
    assert await backend.find_vm(ref) is None
    with pytest.raises(VMNotFound):
        await backend.power_on(ref)
    with pytest.raises(VMNotFound):
        await backend.wait_for_address(ref, None)
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(instanceUuid=ref.vm_id)))
    found = await backend.find_vm(ref)
    assert found is not None and found.name == "web09"


async def test_an_esxi_mac_check_sees_a_vm_made_since_its_last_look(esxi: Simulated) -> None:
    backend = esxi.sim.backend()
    try:
        spec = CloneSpec("jsc0010", "web10", TEMPLATE)
        ref = await backend.prepare_clone(spec)
        await backend.clone(spec, ref)  # the tracker has read every VM's devices
        vm = esxi.sim.vm(ref.vm_id)
        card = vim.vm.device.VirtualEthernetCard
        (nic,) = [d for d in vm.config.hardware.device if isinstance(d, card)]
        # Someone else's VM, made afterwards, takes a MAC by hand.
        folder, pool = esxi.sim.datacenter.vmFolder, vm.resourcePool
        mac = "00:50:56:3f:00:01"
        added = vim.vm.device.VirtualVmxnet3(key=-1, addressType="manual", macAddress=mac)
        device = vim.vm.device.VirtualDeviceSpec(operation="add", device=added)
        files = vim.vm.FileInfo(vmPathName="[LocalDS_0]")
        config = vim.vm.ConfigSpec(name="manual", files=files, deviceChange=[device])
        WaitForTask(folder.CreateVM_Task(config=config, pool=pool))
        conn = await backend._session.connection()
        macs = await backend._session.run(lambda op: backend._known.macs(op.conn))
        assert {mac, str(nic.macAddress).lower()} <= macs
        assert conn.vcenter is False
    finally:
        await backend.close()


async def test_only_a_retried_clone_looks_for_its_vm_first(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """The first clone after prepare_clone skips the FindByUuid (its UUID was drawn a
    moment ago); a retry of the step looks, and finds the VM the first attempt made."""
    spec = CloneSpec("jsc0011", "web11", TEMPLATE)
    ref = await backend.prepare_clone(spec)
    before = backend.api_calls()
    await backend.clone(spec, ref)
    assert (backend.api_calls() - before)["FindByUuid"] == 0
    note = await backend.clone(spec, ref)
    assert note == "the VM was already there (an earlier attempt finished)"
    assert list(vcenter.sim.vms().values()).count("web11") == 1


async def test_name_checks_at_the_same_time_share_the_trackers_looks(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """Each check is answered by a look that started after it was asked (so it sees
    what was there when it asked), but checks waiting for the same look share it."""
    assert await backend.find_by_name("web99") == []  # the first, full look
    before = backend.api_calls()
    found = await asyncio.gather(*(backend.find_by_name(f"web{i:02d}") for i in range(12)))
    assert found == [[]] * 12
    looks = (backend.api_calls() - before)["WaitForUpdatesEx"]
    print(f"12 checks at once: {looks} looks")
    assert 1 <= looks < 12, looks


async def test_waits_and_the_tracker_outlive_an_expired_session(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """Idle collectors and the tracker's belong to the login that made them: after a
    new login, waits take new ones and the tracker reads again from the start."""
    spec = CloneSpec("jsc0012", "web12", TEMPLATE)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)  # leaves idle collectors and the tracker
    manager = vcenter.sim.content.sessionManager
    user = vcenter.sim.config()["user"]
    (session,) = [s.key for s in manager.sessionList if s.userName == user]
    manager.TerminateSession([session])
    # The first call after the expiry is a wait's CreateFilter on an idle collector.
    task = operator_vm(vcenter, "DC0_H0_VM1").Rename_Task("db03")
    info = await backend._session.run(lambda op: op.wait(task))
    assert info is None and backend.api_calls()["Login"] == 2
    await backend.power_on(ref)
    assert [v.vm_id for v in await backend.find_by_name("web12")] == [ref.vm_id]
    assert backend.api_calls()["Login"] == 2


async def test_a_failed_clone_forgets_the_remembered_shape(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """A clone refused by the server may have been planned with a pool, datastore or
    network that went since it was remembered: the retry plans from a fresh read.
    (Here the template goes between the plan and the clone: vcsim crashes on a clone
    into a pool that went.)"""
    clone = CloneSpec("jsc0013", "web13", TEMPLATE)
    ref = await backend.prepare_clone(clone)
    WaitForTask(operator_vm(vcenter, TEMPLATE).Destroy_Task())
    with pytest.raises(BackendError):
        await backend.clone(clone, ref)
    assert backend._inventory.forget() is False  # nothing left to forget


# --- whole deploys: the address conflict check among the steps ----------------------


async def pipeline_cost(
    binary: Path, tls: TlsFiles, tmp: Path, esx: bool, extra: int
) -> tuple[float, float]:
    """SOAP requests and bytes per deploy of two whole deploys, one after the other
    (admission with its address check, check_free with its second, clone, identity,
    power-on, the guest's address, the SSH check), after a first that logged in and
    let the VM tracker read every VM."""
    pools = 1 if esx else 2  # vcsim makes its VMs per resource pool
    sshd = Sshd()
    await sshd.listen("127.0.20.50", "127.0.20.51", "127.0.20.52")
    try:
        with simulator(binary, tls, tmp, esx=esx, vms_per_pool=2 + extra // pools) as lab:
            settings = vsphere_settings(tmp / f"x{extra}", lab, sshd)
            async with deployer_for(settings) as (deployer, backend):
                assert (await deploy(deployer, "web00 127.0.20.50")).state is JobState.SUCCEEDED
                calls, sent = backend.api_calls(), backend.api_bytes()
                for i in (1, 2):
                    job = await deploy(deployer, f"web0{i} 127.0.20.5{i}")
                    assert job.state is JobState.SUCCEEDED, job.error
                calls, sent = backend.api_calls() - calls, backend.api_bytes() - sent
    finally:
        await sshd.close()
    print(f"{'esxi' if esx else 'vcenter'}, {extra} extra VMs, per deploy: {dict(calls)}")
    return sum(calls.values()) / 2, sum(sent.values()) / 2


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_whole_deploys_cost_the_same_whatever_the_number_of_vms(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path, mode: str
) -> None:
    """The address check reads the session's tracker (what changed since its last
    look), not every VM's addresses twice per deploy (780 KB per deploy at 400 extra
    VMs on vCenter, against 61 KB at none)."""
    esx = mode == "esxi"
    small = await pipeline_cost(vcsim_binary, vcsim_tls, tmp_path, esx, 0)
    assert small[0] <= GOAL_REQUESTS, small
    for extra in PIPELINE_EXTRA:
        big = await pipeline_cost(vcsim_binary, vcsim_tls, tmp_path, esx, extra)
        print(f"{mode}: {small} at 0 extra VMs; {big} at {extra} (requests, bytes)")
        assert big[0] <= GOAL_REQUESTS, (extra, big)
        assert abs(big[1] - small[1]) <= small[1] / 10, (extra, small, big)


async def test_an_address_a_vm_took_after_the_trackers_first_read_is_refused(
    vcenter: Simulated, tmp_path: Path
) -> None:
    """At admission and again in check_free: the tracker's look starts after the
    check is asked, so it sees a VM that took the address a moment ago."""
    sshd = Sshd()
    await sshd.listen("127.0.20.50")
    approval = {"approvers": ["bob"], "always": True}
    settings = vsphere_settings(tmp_path, vcenter, sshd, approval=approval)
    try:
        async with deployer_for(settings) as (deployer, backend):
            first = await deployer.request_deploy(deploy_args("web00 127.0.20.50"), "alice")
            await deployer.approve(first.id, "bob")
            await deployer.drain()
            assert (await deployer.status(first.id)).job.state is JobState.SUCCEEDED
            assert backend.api_calls()["WaitForUpdatesEx"] > 0  # the tracker is under way
            # At admission: a VM built by hand since.
            await asyncio.to_thread(vcenter.sim.build_by_hand, "legacy01", "127.0.20.60")
            with pytest.raises(Conflict, match=r"127\.0\.20\.60 is used by VM legacy01 "):
                await deployer.request_deploy(deploy_args("web01 127.0.20.60"), "alice")
            # In check_free: a VM that took the address while the request waited.
            waiting = await deployer.request_deploy(deploy_args("web02 127.0.20.61"), "alice")
            vm = operator_vm(vcenter, "DC0_C0_RP0_VM1")
            await asyncio.to_thread(vcenter.sim.set_guest_address, vm, "127.0.20.61")
            await deployer.approve(waiting.id, "bob")
            await deployer.drain()
            job = (await deployer.status(waiting.id)).job
    finally:
        await sshd.close()
    assert job.state is JobState.FAILED
    assert job.error is not None and "127.0.20.61 is used by VM DC0_C0_RP0_VM1" in job.error
    assert job.vm_id is None  # refused before the clone


def deploy_args(text: str) -> DeployArgs:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return args


async def test_a_subnet_asks_only_the_backends_its_vms_live_on(
    vcenter: Simulated, esxi: Simulated, tmp_path: Path
) -> None:
    """A deploy on the vCenter into a subnet whose `vms_on` names the vCenter alone
    never logs in to the ESXi host; into a subnet without it, every backend is asked."""
    here = {**SUBNET, "vms_on": ["vcenter"]}
    everywhere = {"cidr": "127.0.21.0/24", "gateway": "127.0.21.1"}
    approval = {"approvers": ["bob"], "always": True}  # recorded after the checks, not run
    no_guests = Sshd()
    no_guests.port = 22  # never connected to: nothing is deployed
    settings = vsphere_settings(
        tmp_path,
        vcenter,
        no_guests,
        backends=[vcenter.sim.config(), esxi.sim.config()],
        subnets=[here, everywhere],
        approval=approval,
    )
    made = {c.name: make_backend(c, {PASSWORD_ENV: PASSWORD}) for c in settings.backends}
    on_esxi = made["esxi"]
    assert isinstance(on_esxi, VSphereBackend)
    async with running_deployer(settings, Recorder(), backends=made, grace_s=30) as deployer:
        await deployer.request_deploy(deploy_args("web01 127.0.20.50"), "alice")
        assert on_esxi.api_calls() == Counter()  # never logged in
        await deployer.request_deploy(deploy_args("web02 127.0.21.50"), "alice")
        assert on_esxi.api_calls()["Login"] == 1
