"""Every NIC's address through the built-in IPAM (the store) on the simulator (issue 29):
the next free address of a `+SUBNET` NIC, the conflict check of every address against
jobs and VMs built by hand, a fixed MAC another VM has (`KnowsMacs`) or another job
holds, refused at request time and at the pipeline's check_free, each naming who."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.abilities import KnowsMacs
from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.models import Job, JobState
from bot.models.errors import Conflict
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder, make_settings

IP = ipaddress.IPv4Address
MAC = "52:54:00:12:34:56"


def subnets() -> list[dict[str, Any]]:
    return [
        {"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "name": "lab",
         "pool": "10.0.0.100-10.0.0.199"},
        {"cidr": "10.0.20.0/24", "gateway": "10.0.20.1", "name": "lab20",
         "pool": "10.0.20.10-10.0.20.12"},
    ]  # fmt: skip


@pytest.fixture
async def deployer(tmp_path: Path, sim: SimBackend, recorder: Recorder) -> AsyncIterator[Deployer]:
    settings = make_settings(tmp_path, subnets=subnets())
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:
        yield d


async def ask(deployer: Deployer, text: str, **kw: Any) -> Job:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return await deployer.request_deploy(args, "alice", **kw)


async def test_a_subnet_nic_gets_its_next_free_address_skipping_jobs_and_vms(
    deployer: Deployer, sim: SimBackend
) -> None:
    first = await ask(deployer, "web01 10.0.0.50 +lab20")
    assert [str(a.ip) for a in first.request.addresses] == ["10.0.0.50", "10.0.20.10"]
    assert first.request.nics[0].picked and not first.request.picked
    sim.add_vm("by-hand", address=IP("10.0.20.11"))
    second = await ask(deployer, "web02 subnet=lab +lab20")
    assert second.request.nics[0].address.ip == IP("10.0.20.12")
    assert second.address.startswith("10.0.0.1")  # its first NIC picked too
    with pytest.raises(Conflict, match="No free address is left in"):
        await ask(deployer, "web03 10.0.0.53 +lab20")
    # Nothing of the refused request is held: its first address is free.
    assert (await ask(deployer, "web03 10.0.0.53")).address == "10.0.0.53"


async def test_a_later_nics_address_a_vm_or_a_job_has_is_refused_naming_it(
    deployer: Deployer, sim: SimBackend
) -> None:
    vm_id = sim.add_vm("legacy20", address=IP("10.0.20.5"))
    with pytest.raises(Conflict) as refused:
        await ask(deployer, "web01 10.0.0.50 +10.0.20.5")
    assert f"10.0.20.5 is used by VM legacy20 (id {vm_id}) on sim" in refused.value.message
    held = await ask(deployer, "web02 10.0.0.51 +10.0.20.6")
    with pytest.raises(Conflict) as again:
        await ask(deployer, "web03 10.0.20.6")
    said = again.value.message  # the job is queued, running or ready by now
    assert said.startswith(
        (
            f"10.0.20.6 is already taken by job {held.id} (web02",
            f"10.0.20.6 belongs to web02 (job {held.id})",
        )
    ), said


async def test_a_fixed_mac_another_vm_has_is_refused_naming_it(
    deployer: Deployer, sim: SimBackend
) -> None:
    assert isinstance(sim, KnowsMacs)
    vm_id = sim.add_vm("legacy", macs=(MAC.upper(),))
    assert await sim.macs_in_use() == {MAC: f"legacy ({vm_id})"}
    with pytest.raises(Conflict) as refused:
        await ask(deployer, f"web01 10.0.0.50 +10.0.20.5 mac2={MAC}", check_free_first=True)
    assert f"The MAC {MAC} is used by VM legacy ({vm_id}) on sim" in refused.value.message
    assert "pick another MAC" in refused.value.message


async def test_the_pipelines_check_finds_a_mac_taken_after_the_request(
    deployer: Deployer, sim: SimBackend
) -> None:
    job = await ask(deployer, f"web01 10.0.0.50 mac={MAC}", can_wait_for_approval=True)
    sim.add_vm("legacy", macs=(MAC,))  # made by hand before the job starts
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.FAILED and done.failed_step == "check_free"
    assert f"the MAC {MAC} is used by VM legacy" in (done.error or "")


async def test_a_fixed_mac_another_job_holds_is_refused_naming_the_job(
    deployer: Deployer,
) -> None:
    held = await ask(deployer, f"web01 10.0.0.50 +10.0.20.5 mac2={MAC}")
    with pytest.raises(Conflict) as refused:
        await ask(deployer, f"web02 10.0.0.51 mac={MAC}")
    said = refused.value.message
    assert f"the MAC {MAC}" in said and held.id in said and "pick another MAC" in said


async def test_a_whole_deploy_with_two_nics_and_a_fixed_mac(
    deployer: Deployer, sim: SimBackend
) -> None:
    """From the text to a ready VM on the simulator: both addresses in the guest, the
    fixed MAC on the second NIC; then the MAC and the address are held until destroyed."""
    job = await ask(deployer, f"web01 10.0.0.50 +lab20 mac2={MAC}")
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.SUCCEEDED and done.vm_id is not None
    vm = sim.vms[done.vm_id]
    assert vm.macs[1] == MAC and len(vm.macs) == 2
    used = {str(u.address) for u in await sim.addresses_in_use() if u.vm_id == done.vm_id}
    assert used == {"10.0.0.50", "10.0.20.10"}
    with pytest.raises(Conflict, match=f"the MAC {MAC} belongs to web01"):
        await ask(deployer, f"web02 10.0.0.51 mac={MAC}")
    await deployer.request_destroy("web01", "alice")
    await deployer.drain()
    again = await ask(deployer, f"web02 10.0.0.51 +10.0.20.10 mac={MAC}")
    assert again.request.nics[0].address.ip == IP("10.0.20.10")
