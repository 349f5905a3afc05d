"""Whole deploys through the real pipeline (queue, SQLite, steps, rollback) onto vcsim,
in vCenter and standalone ESXi mode, with the real SSH check against a listener on the
127.0.20.0/24 address the test gives the VM."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from pyVmomi import vim

from backends.vsphere import VSphereBackend
from bot.kinds.deploy.pipeline import STEPS as DEPLOY_STEPS
from bot.models import JobState
from bot.models.errors import Conflict
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder
from tests.support.vsphere.pipeline import (
    SUBNET,
    TIMEOUTS,
    Sshd,
    deploy,
    deployer_for,
    vsphere_settings,
)
from tests.support.vsphere.simulator import (
    PASSWORD,
    Simulated,
    TlsFiles,
    decode,
    esxi_fixture,  # noqa: F401
    simulator,
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

# The steps every deploy walks (register: only with an IPAM record; certify: with a CA).
STEPS = tuple(step.name for step in DEPLOY_STEPS if step.name not in ("register", "certify"))


@pytest.fixture
async def sshd() -> AsyncIterator[Sshd]:
    listeners = Sshd()
    await listeners.listen("127.0.20.50")
    yield listeners
    await listeners.close()


async def test_an_impostor_on_the_address_fails_the_deploy_and_rolls_back(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    """Something else answers on the new VM's address with its own host key: not the one
    deploybot chose and put into the VM's cloud-config, so the deploy fails at the SSH
    check naming both fingerprints, and the VM is rolled back (issue 28)."""
    impostor = asyncssh.generate_private_key("ssh-ed25519")
    sshd.impostors["127.0.20.50"] = impostor.export_private_key().decode()
    async with deployer_for(vsphere_settings(tmp_path, vcenter, sshd)) as (deployer, _b):
        job = await deploy(deployer, "web01 127.0.20.50")
    assert job.state is JobState.FAILED and job.failed_step == "ssh", job.error
    assert job.error is not None
    theirs = impostor.get_fingerprint("sha256")
    assert f"127.0.20.50 answered with host key {theirs}" in job.error
    assert "chosen by deploybot" in job.error and "interception" in job.error
    assert job.error.count("SHA256:") == 2
    assert sshd.accepted["127.0.20.50"] >= 1
    assert job.vm_id is not None and job.vm_id not in vcenter.sim.vms()  # rolled back
    assert "web01" not in vcenter.sim.vms().values()


class StepCalls:
    """The backend's SOAP calls per step, from snapshots taken as each step starts."""

    def __init__(self, recorder: Recorder, backend: VSphereBackend) -> None:
        self.backend = backend
        self.started: list[tuple[str, Counter[str]]] = []
        recorder.on_step = lambda _job, step: self.started.append((step, backend.api_calls()))

    def during(self, step: str) -> Counter[str]:
        """From `step`'s start to the next step's (or to now): read before the backend closes."""
        names = [name for name, _calls in self.started]
        index = names.index(step)
        later = self.started[index + 1 :]
        end = later[0][1] if later else self.backend.api_calls()
        return end - self.started[index][1]


def guest_config(sim: Simulated, vm_id: str) -> tuple[int, int, dict[str, Any]]:
    """numCPU, memoryMB and the decoded cloud-init metadata of a VM, as the server has them."""
    vm = sim.sim.vm(vm_id)
    metadata = decode(sim.sim.extra(vm)["guestinfo.metadata"])
    return vm.config.hardware.numCPU, vm.config.hardware.memoryMB, metadata


def nic_of(vm: Any) -> Any:
    """The VM's one NIC."""
    (nic,) = [
        d for d in vm.config.hardware.device if isinstance(d, vim.vm.device.VirtualEthernetCard)
    ]
    return nic


# --- whole deploys ----------------------------------------------------------------------


async def test_a_vcenter_deploy_end_to_end(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = vsphere_settings(tmp_path, vcenter, sshd)
    recorder = Recorder()
    async with deployer_for(settings, recorder) as (deployer, backend):
        steps = StepCalls(recorder, backend)
        job = await deploy(deployer, "web01 127.0.20.50 cpu=2 mem=1G disk=+2G")
        calls = backend.api_calls()
        cloning, identity = steps.during("clone"), steps.during("identity")
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.ssh_line == "ssh ubuntu@127.0.20.50"
    assert [s for _j, s, phase in recorder.steps if phase == "ok"] == list(STEPS)
    assert sshd.accepted["127.0.20.50"] >= 1  # the SSH check really connected
    # The job stored the instance UUID and the pool the clone went to.
    vm = vcenter.sim.vm(str(job.vm_id))
    assert vm.name == "web01" and job.vm_placement == "DC0_C0"
    assert vm.runtime.powerState == "poweredOn"
    # The clone carried CPU, memory and guestinfo: the identity step read them and wrote
    # only the host key deploybot chose (one reconfigure; issue 28).
    # (vcsim drops the annotation and, from a clone, CPU and memory: the clone's own check
    # sets them in its one ReconfigVM_Task; a vCenter keeps them and needs none.)
    assert cloning["CloneVM_Task"] == 1 and cloning["ReconfigVM_Task"] <= 1
    assert identity["ReconfigVM_Task"] == 1 and identity["RetrievePropertiesEx"] == 1
    cores, memory, metadata = guest_config(vcenter, str(job.vm_id))
    assert (cores, memory) == (2, 1024)
    assert metadata["instance-id"] == job.vm_id and metadata["local-hostname"] == "web01.lab.test"
    pg = next(n for n in vcenter.sim.datacenter.network if n.name == "DC0_DVPG0")
    backing = nic_of(vm).backing
    assert isinstance(backing, vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo)
    assert (backing.port.switchUuid, backing.port.portgroupKey) == (
        pg.config.distributedVirtualSwitch.uuid,
        pg.key,
    )
    # What the guest read from guestinfo at boot: its NIC by the MAC the clone's NIC has
    # (vCenter's to assign; read back after the clone), its name in the subnet's domain.
    booted = vcenter.guests.booted[str(job.vm_id)]
    assert booted.metadata["instance-id"] == job.vm_id
    assert (booted.name, booted.fqdn) == ("web01", "web01.lab.test")
    (nic,) = booted.metadata["network"]["config"]
    assert nic["mac_address"] == nic_of(vm).macAddress.lower() == booted.mac
    assert (nic["type"], nic["name"]) == ("physical", "eth0")
    assert nic["subnets"] == [
        {
            "type": "static",
            "address": "127.0.20.50/24",
            "gateway": "127.0.20.1",
            "dns_nameservers": ["127.0.20.2"],
            "dns_search": ["lab.test"],
        }
    ]
    assert booted.userdata["users"][0]["name"] == "ubuntu"
    assert booted.userdata["package_upgrade"] is False
    assert (booted.userdata["hostname"], booted.userdata["fqdn"]) == ("web01", "web01.lab.test")
    assert booted.userdata["manage_etc_hosts"] is True
    # Tasks were waited for through collectors, never by reading properties in a loop.
    assert calls["Fetch"] == 0
    assert calls["CloneVM_Task"] == 1 and calls["Login"] == 1
    assert PASSWORD not in caplog.text


async def test_an_esxi_deploy_end_to_end_never_clones(
    esxi: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    """vcsim accepts CloneVM_Task in ESX mode, a real ESXi does not: the ESXi path must
    copy the disk and create the VM instead, which the client's calls and the server's
    events both show."""
    overrides = {"thin_provisioned": False, "eagerly_scrub": True}
    settings = vsphere_settings(tmp_path, esxi, sshd, backends=[esxi.sim.config(**overrides)])
    recorder = Recorder()
    async with deployer_for(settings, recorder) as (deployer, backend):
        steps = StepCalls(recorder, backend)
        job = await deploy(deployer, "web01 127.0.20.50 cpu=3 mem=1536M disk=+1G")
        calls = backend.api_calls()
        creating, identity = steps.during("clone"), steps.during("identity")
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.ssh_line == "ssh ubuntu@127.0.20.50" and sshd.accepted["127.0.20.50"] >= 1
    assert calls["CloneVM_Task"] == 0
    assert calls["MakeDirectory"] == 1
    assert calls["CopyVirtualDisk_Task"] == 1 and calls["CreateVM_Task"] == 1
    done = esxi.sim.task_history()
    assert "VirtualDiskManager.copyVirtualDisk" in done and "Folder.createVm" in done
    assert not [d for d in done if "clone" in d.lower()]
    vm = esxi.sim.vm(str(job.vm_id))
    (disk,) = [d for d in vm.config.hardware.device if isinstance(d, vim.vm.device.VirtualDisk)]
    backing: Any = disk.backing
    assert backing.fileName == f"[LocalDS_0] web01-{str(job.vm_id)[:8]}/web01.vmdk"
    assert (backing.thinProvisioned, backing.eagerlyScrub) == (False, True)
    nic = nic_of(vm)
    assert isinstance(nic.backing, vim.vm.device.VirtualEthernetCard.NetworkBackingInfo)
    # The host would generate a MAC only at power-on: the create spec set one, in VMware's
    # static range, and the metadata in the same spec names it.
    assert nic.addressType == "manual" and nic.macAddress.startswith("00:50:56:")
    assert int(nic.macAddress.split(":")[3], 16) <= 0x3F
    booted = esxi.guests.booted[str(job.vm_id)]
    assert (booted.fqdn, booted.mac) == ("web01.lab.test", nic.macAddress)
    # CreateVM_Task's spec carried CPU, memory and guestinfo: nothing was reconfigured
    # for them after the create; the identity step wrote only the chosen host key.
    assert creating["CreateVM_Task"] == 1 and creating["ReconfigVM_Task"] == 0
    assert identity["ReconfigVM_Task"] == 1 and identity["RetrievePropertiesEx"] == 1
    cores, memory, metadata = guest_config(esxi, str(job.vm_id))
    assert (cores, memory) == (3, 1536)
    assert metadata["instance-id"] == job.vm_id
    assert metadata["network"]["config"][0]["subnets"][0]["address"] == "127.0.20.50/24"


# --- rollback -------------------------------------------------------------------------


def leftovers(sim: Simulated, before: dict[str, str]) -> dict[str, str]:
    """VMs in the inventory now that were not there before the deploy."""
    now = sim.sim.vms()
    assert set(before) <= set(now), "a VM that was there before has gone"
    return {uuid: name for uuid, name in now.items() if uuid not in before}


# The SOAP call each step waits on, made slower (0.6 s) than the step's timeout (0.3 s),
# so that the timeout lands while the call is in flight; the address step waits for a
# guest that never reports, the SSH step for a port where nothing listens. The identity
# step, whose clone carried the identity, only reads the VM (found by the clone), so
# every property read is slowed there.
IN_FLIGHT = {
    "clone": "CloneVM_Task=600,CopyVirtualDisk_Task=600",
    "identity": "RetrievePropertiesEx=600",
    "resize": "ReconfigVM_Task=600",
    "power_on": "PowerOnVM_Task=600",
    "address": "",
    "ssh": "",
}


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
@pytest.mark.parametrize("step", list(IN_FLIGHT))
async def test_a_step_that_times_out_mid_call_leaves_nothing(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path, step: str, mode: str
) -> None:
    """The timeout lands while the step's call runs in its thread: the backend stops it
    or lets vSphere finish, and only then returns, so the rollback finds what there is
    and removes it. The inventory and the datastore are as they were before."""
    esx = mode == "esxi"
    with simulator(vcsim_binary, vcsim_tls, tmp_path, esx=esx, delay=IN_FLIGHT[step]) as sim:
        sim.guests.silent.add("web01" if step == "address" else "")
        ssh = Sshd()
        if step == "ssh":
            ssh.port = 2  # nothing listens there
        else:
            await ssh.listen("127.0.20.50")
        timeouts = {**TIMEOUTS, f"{step}_s": 0.3}
        settings = vsphere_settings(tmp_path, sim, ssh, timeouts=timeouts)
        before, history = sim.sim.vms(), Counter(sim.sim.task_history())
        folders = sim.sim.datastore_folders()
        recorder = Recorder()
        async with deployer_for(settings, recorder) as (deployer, _backend):
            job = await deploy(deployer, "web01 127.0.20.50 disk=+1G")
        await ssh.close()
        assert job.state is JobState.FAILED and job.failed_step == step
        assert "timed out" in (job.error or "")
        assert leftovers(sim, before) == {}
        assert sim.sim.datastore_folders() == folders  # no copied disk left either
        _job, report = recorder.finished[job.id]
        assert report is not None and report.clean, report
        done = Counter(sim.sim.task_history()) - history
        # The call that timed out had finished (or, for the ESXi copy, was undone) when
        # the rollback ran: from the clone on (vCenter) there was a VM to remove, from
        # power-on a running VM to stop first.
        created = step != "clone" or not esx
        assert done["VirtualMachine.destroy"] == int(created)
        powered = STEPS.index(step) >= STEPS.index("power_on")
        assert done["VirtualMachine.powerOff"] == int(powered)


async def test_a_cancel_while_waiting_for_the_guest_stops_and_removes_the_vm(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    vcenter.guests.silent.add("web01")
    before = vcenter.sim.vms()
    recorder = Recorder()
    async with deployer_for(vsphere_settings(tmp_path, vcenter, sshd), recorder) as (d, _b):
        args = parse("web01 127.0.20.50")
        assert isinstance(args, DeployArgs)
        job = await d.request_deploy(args, "alice")
        await recorder.seen("address").wait()
        await d.cancel(job.id, "alice")
        await d.drain()
        job = (await d.status(job.id)).job
    assert job.state is JobState.CANCELLED
    assert leftovers(vcenter, before) == {}
    _job, report = recorder.finished[job.id]
    assert report is not None and report.clean
    assert [u.split()[0] for u in report.undone] == ["stop", "destroy"]


async def test_an_unknown_datastore_fails_the_clone_before_anything_exists(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    entry = vcenter.sim.config(datastore="NoSuchDS")
    before = vcenter.sim.vms()
    settings = vsphere_settings(tmp_path, vcenter, sshd, backends=[entry])
    async with deployer_for(settings) as (deployer, _backend):
        job = await deploy(deployer, "web01 127.0.20.50")
    assert job.state is JobState.FAILED and job.failed_step == "clone"
    assert "no datastore 'NoSuchDS'" in (job.error or "") and "LocalDS_0" in (job.error or "")
    assert job.vm_id is None
    assert leftovers(vcenter, before) == {}


# --- many at once ---------------------------------------------------------------------


async def test_twenty_concurrent_deploys_share_one_session(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    """Twenty deploys at once on one session: every task wait gets a collector to
    itself (reused by later waits, never shared), so each deploy sees its own tasks
    end, and every VM gets its own identity."""
    addresses = [f"127.0.20.{100 + i}" for i in range(20)]
    await sshd.listen(*addresses)
    async with deployer_for(vsphere_settings(tmp_path, vcenter, sshd)) as (deployer, backend):
        requested = []
        for i, address in enumerate(addresses):
            args = parse(f"web{i:02d} {address}")
            assert isinstance(args, DeployArgs)
            requested.append(await deployer.request_deploy(args, "alice"))
        await deployer.drain()
        jobs = [(await deployer.status(j.id)).job for j in requested]
        calls = backend.api_calls()
    assert [j.state for j in jobs] == [JobState.SUCCEEDED] * 20, [j.error for j in jobs]
    for job, address in zip(jobs, addresses, strict=True):
        assert job.final_address == address and sshd.accepted[address] >= 1
        booted = vcenter.guests.booted[str(job.vm_id)]
        assert (booted.name, booted.address) == (job.name, address)
        assert vcenter.sim.vm(str(job.vm_id)).name == job.name
    assert len({j.vm_id for j in jobs}) == 20
    assert calls["Login"] == 1
    tasks = sum(n for method, n in calls.items() if method.endswith("_Task"))
    # Only the filters of ended tasks stay (on idle collectors; the VM tracker's is the
    # other one); every address wait's goes. Collectors are reused: at most one per
    # concurrent wait (and the tracker's) at a time, not one per wait.
    assert calls["CreateFilter"] == tasks + calls["DestroyPropertyFilter"] + 1
    assert calls["DestroyPropertyFilter"] == 20
    assert calls["CreatePropertyCollector"] - calls["DestroyPropertyCollector"] <= 20 + 1
    assert calls["WaitForUpdatesEx"] >= tasks and calls["Fetch"] == 0


async def test_an_address_a_vm_built_by_hand_reports_is_refused_and_skipped(
    vcenter: Simulated, sshd: Sshd, tmp_path: Path
) -> None:
    """A VM someone made without deploybot whose Tools report 127.0.20.50 (guest.net):
    asking for it is refused naming that VM; the next free address skips it."""
    await asyncio.to_thread(vcenter.sim.build_by_hand, "legacy01", "127.0.20.50")
    subnet = {**SUBNET, "name": "lab", "pool": "127.0.20.50-127.0.20.60"}
    approval = {"approvers": ["bob"], "always": True}  # recorded, not run
    settings = vsphere_settings(tmp_path, vcenter, sshd, subnets=[subnet], approval=approval)
    async with deployer_for(settings) as (deployer, _backend):
        asked = parse("web01 127.0.20.50")
        assert isinstance(asked, DeployArgs)
        with pytest.raises(Conflict, match=r"127\.0\.20\.50 is used by VM legacy01 \(id "):
            await deployer.request_deploy(asked, "alice")
        picked = parse("web02")
        assert isinstance(picked, DeployArgs)
        assert (await deployer.request_deploy(picked, "alice")).address == "127.0.20.51"
