"""Next free addresses and the conflict check, with the built-in IPAM (the store) on the
simulator: what a request without an address gets, what it skips, who a refusal names."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path

import pytest

from backends.base import Backend
from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import Job, JobState
from bot.models.errors import Conflict, RequestInvalid
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder, make_settings
from tests.support.jumphost import JumpHost

IP = ipaddress.IPv4Address


async def ask(deployer: Deployer, text: str, who: str = "alice") -> Job:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return await deployer.request_deploy(args, who)


async def test_no_address_takes_the_first_of_the_pool(deployer: Deployer) -> None:
    job = await ask(deployer, "web01")
    assert job.address == "10.0.0.100"  # the example's pool: 10.0.0.100-10.0.0.199
    assert job.request.picked and job.request.subnet == "lab"
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.SUCCEEDED and done.final_address == "10.0.0.100"


async def test_the_next_free_skips_jobs_and_vms_built_by_hand(
    deployer: Deployer, sim: SimBackend
) -> None:
    await ask(deployer, "web01 10.0.0.100")
    sim.add_vm("by-hand", address=IP("10.0.0.101"))
    sim.add_vm("stopped-by-hand", address=IP("10.0.0.102"), running=False)
    job = await ask(deployer, "web02")
    assert job.address == "10.0.0.103"


async def test_an_asked_address_a_vm_built_by_hand_has_is_refused_naming_it(
    deployer: Deployer, sim: SimBackend
) -> None:
    vm_id = sim.add_vm("legacy01", address=IP("10.0.0.60"))
    with pytest.raises(Conflict) as refused:
        await ask(deployer, "web01 10.0.0.60")
    text = refused.value.message
    assert f"10.0.0.60 is used by VM legacy01 (id {vm_id}) on sim" in text
    assert "leave it out to get the next free one" in text
    assert (await deployer.store.jobs.history(limit=10)) == []  # nothing recorded


async def test_a_vm_built_by_hand_after_the_request_fails_the_check_before_the_clone(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    async def build_by_hand(job: Job, step: str) -> None:
        if step == "check_free":
            sim.add_vm("sneaky", address=IP("10.0.0.70"))

    recorder.on_step = build_by_hand
    job = await ask(deployer, "web01 10.0.0.70")
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.FAILED and done.failed_step == "check_free"
    assert done.error is not None and "used by VM sneaky" in done.error
    assert [vm.name for vm in sim.vms.values()] == ["sneaky"]  # nothing cloned


async def test_two_requests_racing_get_different_addresses(deployer: Deployer) -> None:
    jobs = await asyncio.gather(*(ask(deployer, f"race{i}") for i in range(6)))
    addresses = [j.address for j in jobs]
    assert len(set(addresses)) == 6
    assert sorted(addresses) == [f"10.0.0.{100 + i}" for i in range(6)]


async def test_a_failed_deploy_frees_its_address_for_the_next(
    deployer: Deployer, sim: SimBackend
) -> None:
    sim.inject("clone", "error")
    failed = await ask(deployer, "web01")
    await deployer.drain()
    assert (await deployer.status(failed.id)).job.state is JobState.FAILED
    again = await ask(deployer, "web02")
    assert again.address == failed.address


async def test_a_full_pool_is_refused_with_what_to_do(tmp_path: Path, recorder: Recorder) -> None:
    subnet = {
        "name": "tiny",
        "cidr": "10.0.0.0/24",
        "gateway": "10.0.0.1",
        "pool": "10.0.0.10-10.0.0.11",
    }
    settings = make_settings(tmp_path, subnets=[subnet])
    sim = SimBackend("sim")
    sim.add_vm("a", address=IP("10.0.0.10"))
    sim.add_vm("b", address=IP("10.0.0.11"))
    async with running_deployer(settings, recorder, backends={"sim": sim}) as deployer:
        with pytest.raises(Conflict, match=r"No free address is left in tiny .*widen its pool"):
            await ask(deployer, "web01")


def two_subnets(tmp_path: Path) -> Settings:
    return make_settings(
        tmp_path,
        backends=[{"kind": "sim", "name": "sim"}, {"kind": "sim", "name": "lab2"}],
        subnets=[
            {"name": "front", "cidr": "10.0.0.0/24", "gateway": "10.0.0.1"},
            {"name": "back", "cidr": "10.0.1.0/24", "gateway": "10.0.1.1", "backends": ["lab2"]},
        ],
    )


async def test_the_subnet_follows_from_the_name_or_the_backend(
    tmp_path: Path, recorder: Recorder
) -> None:
    settings = two_subnets(tmp_path)
    backends: dict[str, Backend] = {"sim": SimBackend("sim"), "lab2": SimBackend("lab2")}
    async with running_deployer(settings, recorder, backends=backends) as deployer:
        assert (await ask(deployer, "a subnet=front")).address == "10.0.0.2"
        assert (await ask(deployer, "b subnet=10.0.1.0/24")).address == "10.0.1.2"
        assert (await ask(deployer, "c on=lab2")).address == "10.0.1.3"
        with pytest.raises(RequestInvalid, match=r"Say which subnet .*subnet=NAME, one of front"):
            await ask(deployer, "d")


async def test_addresses_on_another_backend_count_too(tmp_path: Path, recorder: Recorder) -> None:
    """Two hypervisors on one network: a VM on either holds its address."""
    settings = two_subnets(tmp_path)
    other = SimBackend("lab2")
    other.add_vm("elsewhere", address=IP("10.0.0.2"))
    backends: dict[str, Backend] = {"sim": SimBackend("sim"), "lab2": other}
    async with running_deployer(settings, recorder, backends=backends) as deployer:
        assert (await ask(deployer, "a subnet=front")).address == "10.0.0.3"
        with pytest.raises(Conflict, match=r"used by VM elsewhere .* on lab2"):
            await ask(deployer, "b 10.0.0.2")


async def test_the_probe_finds_a_host_that_answers(tmp_path: Path, recorder: Recorder) -> None:
    """With `probe`, an address where something accepts a TCP connection is taken, and
    so is one where a host refuses it (on loopback every address is such a host). Only
    loopback is probed here: the subnet is 127.0.0.0/24."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.3", 0)
    port = server.sockets[0].getsockname()[1]
    pool = {"name": "loop", "cidr": "127.0.0.0/24", "gateway": "127.0.0.1"}
    settings = make_settings(
        tmp_path,
        subnets=[{**pool, "pool": "127.0.0.3-127.0.0.5"}],
        ipam={"probe": True, "probe_ports": [port], "probe_timeout_s": 1},
    )
    try:
        async with running_deployer(settings, recorder, backends={"sim": SimBackend("sim")}) as d:
            with pytest.raises(Conflict, match=f"127.0.0.3 answers on the network .*{port}"):
                await ask(d, "web01 127.0.0.3")
            with pytest.raises(Conflict, match="No free address is left in loop"):
                await ask(d, "web02")
            assert await d.store.jobs.history(limit=5) == []
    finally:
        server.close()
        await server.wait_closed()


async def test_a_vm_a_rollback_left_behind_keeps_its_address(
    deployer: Deployer, sim: SimBackend
) -> None:
    """The job failed, so the store's index no longer guards its address, but its VM is
    still there with it: neither picked nor given when asked."""
    sim.inject("power_on", "error")
    sim.inject("destroy", "error", times=1000)
    failed = await ask(deployer, "web01")
    await deployer.drain()
    done = (await deployer.status(failed.id)).job
    assert done.state is JobState.FAILED and done.wreckage
    assert (await ask(deployer, "web02")).address == "10.0.0.101"
    with pytest.raises(Conflict, match=f"held by the VM job {failed.id} left behind"):
        await ask(deployer, "web03 10.0.0.100")


async def test_the_probe_goes_through_the_backends_jump_host(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A backend whose guests sit behind a jump host is probed from there: the test
    bastion forwards 10.0.0.60:22 to a loopback listener, refuses the connection for
    other addresses (a host said no: taken) and will not forward to 10.0.0.62 at all
    (nothing known: free). No packet leaves loopback."""
    listener = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]

    def route(host: str, dest_port: int) -> tuple[str, int] | None:
        return ("127.0.0.1", port) if (host, dest_port) == ("10.0.0.60", 22) else None

    jump = await JumpHost(tmp_path / "jump", route).start()
    jump.prohibited.add("10.0.0.62")
    backend = {"kind": "sim", "name": "sim", "time_scale": 0.001, "ssh_jump": jump.config()}
    settings = make_settings(tmp_path, backends=[backend], ipam={"probe": True})
    try:
        async with running_deployer(settings, recorder, backends={"sim": SimBackend("sim")}) as d:
            with pytest.raises(Conflict, match=r"10\.0\.0\.60 answers on the network"):
                await ask(d, "web01 10.0.0.60")
            with pytest.raises(Conflict, match=r"10\.0\.0\.61 answers on the network"):
                await ask(d, "web02 10.0.0.61")
            assert (await ask(d, "web03 10.0.0.62")).address == "10.0.0.62"
        assert ("10.0.0.60", 22) in jump.requests
    finally:
        await jump.close()
        listener.close()
        await listener.wait_closed()


def test_a_subnets_pool_is_made_once(tmp_path: Path) -> None:
    """Every request and every deploy's check asks for its subnet's pool: the subnet is
    frozen, so its range is parsed once, not at each (~40 us each time)."""
    (subnet, *_rest) = make_settings(tmp_path).subnets
    pool = subnet.as_pool()
    assert subnet.as_pool() is pool
    assert pool.first <= pool.last and subnet.gateway in pool.excluded
