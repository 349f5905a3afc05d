"""Addresses from a real NetBox (tests/support/netbox/harness.py starts one on 127.0.0.1): the
next free address, reservations that are released whatever happens to the job, a
NetBox that goes away mid-deploy, a bad token. The VMs are the simulator's; the
addresses (10.0.0.0/24) exist only as NetBox data: nothing connects to them."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from backends.ipam.base import ReservedFor
from backends.ipam.config import IpamConfig
from backends.ipam.netbox import NetBox as NetBoxIpam
from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import IpamState, Job, JobState, utcnow
from bot.models.errors import Conflict, RequestInvalid
from bot.operations.check import check_ipam
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import FAST_TIMEOUTS, SIM_SCALE, Recorder, make_settings
from tests.support.netbox.harness import NetBox

TOKEN_ENV = "DEPLOYBOT_NETBOX_TOKEN"
SUBNET = {
    "name": "lab",
    "cidr": "10.0.0.0/24",
    "gateway": "10.0.0.1",
    "dns": ["10.0.0.2", "10.0.0.3"],
    "search_domain": "lab.example",
}


@pytest.fixture
def nb(clean_netbox: NetBox, monkeypatch: pytest.MonkeyPatch) -> Iterator[NetBox]:
    """A NetBox with the prefix and the tag deploybot needs; the token in the
    environment, where deploybot reads it."""
    api = clean_netbox.api()
    api.ipam.prefixes.create({"prefix": "10.0.0.0/24", "status": "active"})
    if api.extras.tags.get(slug="deploybot") is None:
        api.extras.tags.create({"name": "deploybot", "slug": "deploybot"})
    monkeypatch.setenv(TOKEN_ENV, clean_netbox.token)
    yield clean_netbox


def netbox_settings(tmp_path: Path, nb: NetBox, **overrides: Any) -> Settings:
    data: dict[str, Any] = {
        "subnets": [SUBNET],
        "ipam": {"provider": "netbox", "url": nb.url, "stale_after_s": 600},
        # The register step waits for NetBox while it restarts (seconds).
        "timeouts": {**FAST_TIMEOUTS, "check_free_s": 60.0, "retry_max_s": 0.2},
    }
    return make_settings(tmp_path, **{**data, **overrides})


@pytest.fixture
async def deployer(
    tmp_path: Path, nb: NetBox, recorder: Recorder, sim: SimBackend
) -> AsyncIterator[Deployer]:
    settings = netbox_settings(tmp_path, nb)
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:
        yield d


async def ask(deployer: Deployer, text: str, who: str = "alice") -> Job:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return await deployer.request_deploy(args, who)


async def finish(deployer: Deployer, job: Job) -> Job:
    await deployer.drain()
    return (await deployer.status(job.id)).job


def records(nb: NetBox, address: str) -> list[Any]:
    return list(nb.api().ipam.ip_addresses.filter(address=address))


def take_by_hand(nb: NetBox, *addresses: str, dns_name: str = "") -> None:
    for address in addresses:
        nb.api().ipam.ip_addresses.create(
            {"address": f"{address}/24", "status": "active", "dns_name": dns_name}
        )


async def test_the_next_free_address_comes_from_netbox_and_ends_active(
    deployer: Deployer, nb: NetBox
) -> None:
    take_by_hand(nb, "10.0.0.4", "10.0.0.5")  # .1 gateway and .2/.3 DNS: skipped too
    job = await ask(deployer, "web01")
    assert job.address == "10.0.0.6"
    assert job.ipam_state is IpamState.RESERVED and job.ipam_ref is not None
    (reserved,) = records(nb, "10.0.0.6")
    assert reserved.status.value == "reserved"
    assert reserved.dns_name == "web01.lab.example"
    assert f"job {job.id}" in reserved.description
    assert [t.slug for t in reserved.tags] == ["deploybot"]
    done = await finish(deployer, job)
    assert done.state is JobState.SUCCEEDED and done.ipam_state is IpamState.ACTIVE
    assert records(nb, "10.0.0.6")[0].status.value == "active"
    # NetBox knows the gateway and DNS servers only if someone recorded them:
    assert not records(nb, "10.0.0.1") and not records(nb, "10.0.0.2")


async def test_an_asked_address_netbox_records_is_refused_naming_it(
    deployer: Deployer, nb: NetBox
) -> None:
    take_by_hand(nb, "10.0.0.50", dns_name="printer.lab.example")
    with pytest.raises(Conflict, match=r"10\.0\.0\.50 is recorded in NetBox as printer"):
        await ask(deployer, "web01 10.0.0.50")
    assert await deployer.history() == []
    job = await ask(deployer, "web02 10.0.0.51")  # a free one: reserved as asked
    assert records(nb, "10.0.0.51")[0].description.endswith(f"job {job.id}: web02")


async def test_two_installations_racing_get_different_addresses(tmp_path: Path, nb: NetBox) -> None:
    """Two deploybots with their own databases: NetBox is all they share, and its
    available-ips endpoint must give each its own address."""

    async def one(n: int) -> list[str]:
        settings = netbox_settings(tmp_path / f"inst{n}", nb)
        sim = SimBackend("sim", time_scale=SIM_SCALE)
        async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as d:
            jobs = await asyncio.gather(*(ask(d, f"i{n}vm{i}") for i in range(4)))
            return [j.address for j in jobs]

    first, second = await asyncio.gather(one(1), one(2))
    assert len(set(first + second)) == 8
    assert sorted(first + second, key=ipaddress.IPv4Address) == [
        f"10.0.0.{n}" for n in range(4, 12)
    ]


async def test_a_rollback_releases_the_address(
    deployer: Deployer, nb: NetBox, sim: SimBackend
) -> None:
    sim.inject("power_on", "error")
    job = await ask(deployer, "web01")
    assert records(nb, job.address)
    done = await finish(deployer, job)
    assert done.state is JobState.FAILED and done.ipam_state is IpamState.RELEASED
    assert records(nb, job.address) == []
    events = (await deployer.status(job.id)).events
    assert f"release {job.address} in NetBox" in [e.detail for e in events if e.phase == "undo"]


async def test_a_rejected_request_releases_its_address(tmp_path: Path, nb: NetBox) -> None:
    approval = {"approvers": ["bob"], "always": True}
    settings = netbox_settings(tmp_path, nb, approval=approval)
    async with running_deployer(
        settings, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
    ) as d:
        job = await ask(d, "web01")
        assert records(nb, job.address)
        rejected = await d.reject(job.id, "bob", "not today")
        assert rejected.state is JobState.REJECTED
        assert records(nb, job.address) == []
        assert (await d.status(job.id)).job.ipam_state is IpamState.RELEASED


class NoteWatcher(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    async def job_note(self, job: Job, text: str) -> None:
        await super().job_note(job, text)
        if text.startswith("waiting for NetBox"):
            self.waiting.set()


async def test_netbox_going_away_mid_deploy_makes_the_job_wait_and_say_so(
    tmp_path: Path, nb: NetBox
) -> None:
    watcher = NoteWatcher()

    async def stop_before_register(job: Job, step: str) -> None:
        if step == "ssh":
            await asyncio.to_thread(nb.stop)

    watcher.on_step = stop_before_register
    settings = netbox_settings(tmp_path, nb)
    try:
        async with running_deployer(
            settings, watcher, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
        ) as d:
            job = await ask(d, "web01")
            await watcher.waiting.wait()
            assert (await d.status(job.id)).job.state is JobState.RUNNING
            await asyncio.to_thread(nb.start)
            done = await finish(d, job)
    finally:
        if not nb.running:
            nb.start()
    assert done.state is JobState.SUCCEEDED and done.ipam_state is IpamState.ACTIVE
    notes = [text for _job, text in watcher.notes]
    assert any(n.startswith("waiting for NetBox (unreachable since") for n in notes)
    assert "NetBox answers again; carrying on." in notes
    assert records(nb, job.address)[0].status.value == "active"


async def test_a_bad_token_is_refused_clearly_and_records_nothing(
    tmp_path: Path, nb: NetBox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, nb.invalid_token)
    settings = netbox_settings(tmp_path, nb)
    async with running_deployer(
        settings, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
    ) as d:
        with pytest.raises(RequestInvalid) as refused:
            await ask(d, "web01")
        assert await d.history() == []
    message = refused.value.message
    assert f"NetBox refused the token in {TOKEN_ENV}" in message
    assert "try again" not in message  # waiting will not fix a token


async def test_check_proves_the_token_may_add_addresses(
    tmp_path: Path, nb: NetBox, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = netbox_settings(tmp_path, nb)
    (ok,) = await check_ipam(settings)
    assert ok.ok, ok.detail
    assert list(nb.api().ipam.ip_addresses.all()) == []  # the probe reservation is gone
    monkeypatch.setenv(TOKEN_ENV, nb.read_only_token)
    results = await check_ipam(settings)
    assert not any(r.ok for r in results)
    assert "refused the token" in results[0].detail
    missing = netbox_settings(
        tmp_path, nb, subnets=[{**SUBNET, "cidr": "10.0.9.0/24", "gateway": "10.0.9.1", "dns": []}]
    )
    monkeypatch.setenv(TOKEN_ENV, nb.token)
    (no_prefix,) = await check_ipam(missing)
    assert "NetBox has no prefix 10.0.9.0/24 for subnet lab" in no_prefix.detail


async def test_a_pool_takes_addresses_from_the_netbox_ip_range(tmp_path: Path, nb: NetBox) -> None:
    nb.api().ipam.ip_ranges.create(
        {"start_address": "10.0.0.100/24", "end_address": "10.0.0.110/24", "status": "active"}
    )
    subnet = {**SUBNET, "pool": "10.0.0.100-10.0.0.110"}
    settings = netbox_settings(tmp_path, nb, subnets=[subnet])
    async with running_deployer(
        settings, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
    ) as d:
        assert (await ask(d, "web01")).address == "10.0.0.100"
    elsewhere = netbox_settings(
        tmp_path / "b", nb, subnets=[{**SUBNET, "pool": "10.0.0.20-10.0.0.30"}]
    )
    async with running_deployer(
        elsewhere, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
    ) as d:
        with pytest.raises(
            RequestInvalid, match=r"NetBox has no IP range 10\.0\.0\.20-10\.0\.0\.30"
        ):
            await ask(d, "web02")


async def test_a_reservation_a_crash_left_is_released_once_stale(
    deployer: Deployer, nb: NetBox
) -> None:
    """A process that reserved and died before recording its job leaves a record that
    names a job the store never saw: released only after stale_after_s (another
    process may still be about to record it), never before."""
    config = IpamConfig(provider="netbox", url=nb.url)
    ipam = NetBoxIpam.create(config, {TOKEN_ENV: nb.token})
    pool = deployer.settings.subnets[0].as_pool()
    reserved_for = ReservedFor(
        "jcrashed01", deployer.store.installation_id, "lost01", "lost01.lab.example"
    )
    try:
        orphan = await ipam.reserve(pool, reserved_for)
    finally:
        await ipam.close()
    other = ReservedFor("jother0001", "otherinst1", "theirs", "theirs")  # another installation's
    ipam = NetBoxIpam.create(config, {TOKEN_ENV: nb.token})
    try:
        theirs = await ipam.reserve(pool, other)
    finally:
        await ipam.close()
    assert await deployer.reconcile_addresses() == []
    assert records(nb, str(orphan.address))
    deployer.addressing.clock = lambda: utcnow() + timedelta(seconds=601)
    assert await deployer.reconcile_addresses() == [f"{orphan.address} left by job jcrashed01"]
    assert records(nb, str(orphan.address)) == []
    assert records(nb, str(theirs.address))  # never another installation's


# --- a NetBox that does not answer, in a sentence (issue 25, item 17) ----------------


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then let go)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def assert_said_once(message: str) -> None:
    assert message.count("did not answer") == 1, message
    for raw in ("HTTPConnectionPool", "NewConnectionError", "MaxRetryError", "Errno", "(("):
        assert raw not in message, message


async def test_a_closed_port_is_said_in_a_few_words(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.base import Unreachable
    from bot.addresses.subnets import Subnet

    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv(TOKEN_ENV, "nbt_abc.secret-value-never-shown")
    ipam = NetBoxIpam.create(IpamConfig(provider="netbox", url=url), dict(os.environ))
    pool = Subnet.model_validate(SUBNET).as_pool()
    try:
        with pytest.raises(Unreachable) as caught:
            await ipam.reserve(pool, ReservedFor("jabc12345", "inst", "web01", "alice"))
    finally:
        await ipam.close()
    message = caught.value.message
    assert message == (
        f"NetBox at {url} did not answer (connection refused: nothing listens at that "
        "address and port)"
    )
    assert "secret-value" not in message


async def test_a_request_while_netbox_is_down_says_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the Deployer, as the shell and Slack ask: one sentence, then "try again"."""
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv(TOKEN_ENV, "nbt_abc.secret-value-never-shown")
    settings = make_settings(tmp_path, subnets=[SUBNET], ipam={"provider": "netbox", "url": url})
    async with running_deployer(
        settings, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
    ) as d:
        with pytest.raises(RequestInvalid) as refused:
            await ask(d, "web01")
        assert await d.history() == []
    message = refused.value.message
    assert message == (
        f"NetBox at {url} did not answer (connection refused: nothing listens at that "
        "address and port); try again in a minute."
    )
    assert_said_once(message)


async def test_a_stopped_netbox_is_said_once(tmp_path: Path, nb: NetBox) -> None:
    settings = netbox_settings(tmp_path, nb)
    try:
        async with running_deployer(
            settings, backends={"sim": SimBackend("sim", time_scale=SIM_SCALE)}
        ) as d:
            await asyncio.to_thread(nb.stop)
            with pytest.raises(RequestInvalid) as refused:
                await ask(d, "web01")
    finally:
        if not nb.running:
            nb.start()
    message = refused.value.message
    assert message.startswith(f"NetBox at {nb.url} did not answer (") and message.endswith(
        "); try again in a minute."
    ), message
    assert_said_once(message)
