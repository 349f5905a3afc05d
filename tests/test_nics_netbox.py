"""Several NICs' addresses in a real NetBox (tests/support/netbox/harness.py starts one on
127.0.0.1; issue 29): reserved together, each record naming the job, active together,
released together by a rollback and by a destroy; one taken makes the whole request
refused and nothing kept. The addresses exist only as NetBox data: nothing connects."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.models import IpamState, Job, JobState
from bot.models.errors import Conflict
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import FAST_TIMEOUTS, Recorder, make_settings
from tests.support.netbox.harness import NetBox

TOKEN_ENV = "DEPLOYBOT_NETBOX_TOKEN"
SUBNETS = [
    {"name": "lab", "cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "search_domain": "lab.example"},
    {"name": "lab20", "cidr": "10.0.20.0/24", "gateway": "10.0.20.1"},
]


@pytest.fixture
def nb(clean_netbox: NetBox, monkeypatch: pytest.MonkeyPatch) -> Iterator[NetBox]:
    api = clean_netbox.api()
    for prefix in ("10.0.0.0/24", "10.0.20.0/24"):
        api.ipam.prefixes.create({"prefix": prefix, "status": "active"})
    if api.extras.tags.get(slug="deploybot") is None:
        api.extras.tags.create({"name": "deploybot", "slug": "deploybot"})
    monkeypatch.setenv(TOKEN_ENV, clean_netbox.token)
    yield clean_netbox


@pytest.fixture
async def deployer(
    tmp_path: Path, nb: NetBox, recorder: Recorder, sim: SimBackend
) -> AsyncIterator[Deployer]:
    settings = make_settings(
        tmp_path,
        subnets=SUBNETS,
        ipam={"provider": "netbox", "url": nb.url, "stale_after_s": 600},
        timeouts={**FAST_TIMEOUTS, "check_free_s": 60.0, "retry_max_s": 0.2},
    )
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:
        yield d


async def ask(deployer: Deployer, text: str) -> Job:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return await deployer.request_deploy(args, "alice")


def records(nb: NetBox, address: str) -> list[Any]:
    return list(nb.api().ipam.ip_addresses.filter(address=address))


def every_record(nb: NetBox) -> list[str]:
    return sorted(str(r.address) for r in nb.api().ipam.ip_addresses.all())


async def test_two_addresses_are_reserved_activated_and_destroyed_together(
    deployer: Deployer, nb: NetBox
) -> None:
    job = await ask(deployer, "web01 10.0.0.50 +lab20")
    second = str(job.request.nics[0].address.ip)
    assert second == "10.0.20.2"  # the next free of lab20 (.1 is its gateway)
    assert job.ipam_ref is not None and len(job.ipam_ref.split()) == 2
    for address in ("10.0.0.50", second):
        (record,) = records(nb, address)
        assert record.status.value == "reserved" and f"job {job.id}" in record.description
        assert record.dns_name == "web01.lab.example"
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.SUCCEEDED and done.ipam_state is IpamState.ACTIVE
    assert [records(nb, a)[0].status.value for a in ("10.0.0.50", second)] == ["active"] * 2
    await deployer.request_destroy("web01", "alice")
    await deployer.drain()
    gone = (await deployer.status(job.id)).job
    assert gone.state is JobState.DESTROYED and gone.ipam_state is IpamState.RELEASED
    assert every_record(nb) == []


async def test_a_rollback_releases_every_address(
    deployer: Deployer, nb: NetBox, sim: SimBackend
) -> None:
    sim.inject("power_on", "error")
    job = await ask(deployer, "web01 10.0.0.50 +10.0.20.7")
    assert every_record(nb) == ["10.0.0.50/24", "10.0.20.7/24"]
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.FAILED and done.ipam_state is IpamState.RELEASED
    assert every_record(nb) == []
    undone = [e.detail for e in (await deployer.status(job.id)).events if e.phase == "undo"]
    assert "release 10.0.0.50, 10.0.20.7 in NetBox" in undone


async def test_one_address_taken_refuses_the_whole_request_and_keeps_nothing(
    deployer: Deployer, nb: NetBox
) -> None:
    api = nb.api()
    api.ipam.ip_addresses.create(
        {"address": "10.0.20.7/24", "status": "active", "dns_name": "printer"}
    )
    with pytest.raises(Conflict, match=r"10\.0\.20\.7 is recorded in NetBox as printer"):
        await ask(deployer, "web01 10.0.0.50 +10.0.20.7")
    assert every_record(nb) == ["10.0.20.7/24"]
    # The second NIC's subnet full: its first NIC's address was reserved, then given back.
    api.ipam.ip_addresses.create(
        [{"address": f"10.0.20.{n}/24", "status": "active"} for n in range(1, 255) if n != 7]
    )
    with pytest.raises(Conflict, match="No free address is left in"):
        await ask(deployer, "web01 10.0.0.50 +lab20")
    assert records(nb, "10.0.0.50") == []
    assert await deployer.store.addresses.held() == {}  # no job was recorded
