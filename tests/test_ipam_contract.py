"""The shared IPAM contract (tests/support/ipam_contract.py), run against every provider:
the built-in one (two stores on one SQLite file) and NetBox (the real application,
tests/support/netbox/, started once per run; 10.0.0.0/29 exists only as its data)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from backends.ipam.base import Ipam, ReservedFor
from backends.ipam.builtin import Builtin
from backends.ipam.config import IpamConfig
from backends.ipam.netbox import NetBox as NetBoxIpam
from bot.addresses.subnets import Subnet
from bot.models import Job, JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from store.db import DuplicateActive, Store
from tests.support.deployer import make_settings
from tests.support.ipam_contract import *  # noqa: F403
from tests.support.ipam_contract import Subject, Take
from tests.support.netbox.harness import NetBox

SUBNET = {"name": "lab", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["10.0.0.2"]}
POOL = Subnet.model_validate(SUBNET).as_pool()
TOKEN_ENV = "DEPLOYBOT_NETBOX_TOKEN"


@pytest.fixture(params=["builtin", "netbox"])
async def ipam_subject(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Subject]:
    if request.param == "netbox":
        subject = netbox_subject(request.getfixturevalue("clean_netbox"))
    else:
        subject = builtin_subject(tmp_path)
    try:
        yield subject
    finally:
        await subject.ipam.close()


# --- built-in: the store is the record ----------------------------------------------


def builtin_subject(tmp_path: Path) -> Subject:
    settings = make_settings(tmp_path, subnets=[SUBNET])

    def taker(store: Store) -> Take:
        ipam = Builtin()

        async def take(reserved_for: ReservedFor) -> ipaddress.IPv4Address:
            """What the intake does (bot/requests/intake.py): skip what jobs hold, record
            the job; a loser of the insert picks again."""
            lost: set[ipaddress.IPv4Address] = set()
            while True:
                held = {ipaddress.IPv4Address(a) for a in await store.addresses.held()}
                made = await ipam.reserve(POOL, reserved_for, skip=frozenset(held | lost))
                args = parse(f"{reserved_for.name} {made.address}")
                assert isinstance(args, DeployArgs)
                job = Job.for_request(build_request(args, settings, "alice"), JobState.QUEUED)
                try:
                    await store.jobs.insert(job)
                except DuplicateActive as dup:
                    assert dup.what == "address"
                    lost.add(made.address)
                    continue
                return made.address

        return take

    @asynccontextmanager
    async def takers() -> AsyncIterator[tuple[Take, Take]]:
        # Two connections, two writer threads: SQLite's file lock is all they share.
        first = await Store.open(settings.database)
        second = await Store.open(settings.database)
        try:
            yield taker(first), taker(second)
        finally:
            await first.close()
            await second.close()

    return Subject(Builtin(), POOL, takers, None, None, None)


# --- NetBox -------------------------------------------------------------------------


def netbox_subject(nb: NetBox) -> Subject:
    api = nb.api()
    api.ipam.prefixes.create({"prefix": str(POOL.cidr), "status": "active"})
    api.extras.tags.create({"name": "deploybot", "slug": "deploybot"})

    def provider(url: str = nb.url, token: str = nb.token) -> NetBoxIpam:
        return NetBoxIpam.create(IpamConfig(provider="netbox", url=url), {TOKEN_ENV: token})

    def opened(make: Callable[[], Ipam]) -> Callable[[], AbstractAsyncContextManager[Ipam]]:
        @asynccontextmanager
        async def context() -> AsyncIterator[Ipam]:
            ipam = make()
            try:
                yield ipam
            finally:
                await ipam.close()

        return context

    def taker(ipam: Ipam) -> Take:
        async def take(reserved_for: ReservedFor) -> ipaddress.IPv4Address:
            return (await ipam.reserve(POOL, reserved_for)).address

        return take

    @asynccontextmanager
    async def takers() -> AsyncIterator[tuple[Take, Take]]:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(opened(provider)())
            second = await stack.enter_async_context(opened(provider)())
            yield taker(first), taker(second)

    async def hold_by_hand(ip: ipaddress.IPv4Address, dns_name: str) -> None:
        fields = {"address": f"{ip}/{POOL.cidr.prefixlen}", "dns_name": dns_name}
        await asyncio.to_thread(api.ipam.ip_addresses.create, fields)

    return Subject(
        ipam=provider(),
        pool=POOL,
        takers=takers,
        hold_by_hand=hold_by_hand,
        unreachable=opened(lambda: provider(url=f"http://127.0.0.1:{closed_port()}")),
        refusing=opened(lambda: provider(token=nb.invalid_token)),
    )


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
