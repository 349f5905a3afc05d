"""The IPAM contract (backends/ipam/base.py) as tests that every provider must pass.

Not collected by itself: tests/test_ipam_contract.py defines an `ipam_subject` fixture
(`Subject`: a provider and what the contract needs around it) per provider and does
`from tests.support.ipam_contract import *`, so the same tests run against each.

The built-in provider keeps no record of its own: the store's unique index over the
addresses of jobs in flight is the record, so its reservations have no `ref`, and what
the contract asks of a record (who holds it, `NotOurs`, `records`) is the store's job,
covered where the store is (tests/test_ipam.py). Those tests skip it, saying so; its
atomicity is tested here, with two stores on the same SQLite file.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime

import pytest

from backends.base import PermanentError, Unreachable
from backends.ipam.base import (
    AddressTaken,
    Ipam,
    NotOurs,
    Pool,
    PoolExhausted,
    Reservation,
    ReservedFor,
)
from bot.models.errors import BackendError

INSTALLATION = "contract"
# Reserve the next free address for a job, as deploybot does with this provider
# (built-in: then insert the job, where the store makes it atomic; a loser picks again).
Take = Callable[[ReservedFor], Awaitable[ipaddress.IPv4Address]]


@dataclass
class Subject:
    """A provider under test. `pool` is small (four addresses: the contract fills it);
    `takers` opens two independent callers of the same IPAM (two processes' worth: their
    own connections); `hold_by_hand` records an address the way a person would, not
    through deploybot (None: the provider has no record but the store's); `unreachable`
    and `refusing` open the provider pointed at a closed 127.0.0.1 port and with a
    token the IPAM refuses (None: it has no server)."""

    ipam: Ipam
    pool: Pool
    takers: Callable[[], AbstractAsyncContextManager[tuple[Take, Take]]]
    hold_by_hand: Callable[[ipaddress.IPv4Address, str], Awaitable[None]] | None
    unreachable: Callable[[], AbstractAsyncContextManager[Ipam]] | None
    refusing: Callable[[], AbstractAsyncContextManager[Ipam]] | None


def job(n: int, installation: str = INSTALLATION) -> ReservedFor:
    return ReservedFor(f"jcontract{n}", installation, f"web{n:02d}", f"web{n:02d}.lab.example")


def keeps_records(subject: Subject) -> None:
    if subject.ipam.name == "":
        pytest.skip(
            "the built-in provider writes no record of its own: the job's row in the store "
            "is it (reservations have no ref; the store's jobs are asked for holders)"
        )


async def reserved(
    subject: Subject, reserved_for: ReservedFor, address: ipaddress.IPv4Address | None = None
) -> Reservation:
    made = await subject.ipam.reserve(subject.pool, reserved_for, address=address)
    assert made.ref is not None, "a provider that keeps records names each one"
    return made


async def test_two_callers_never_get_the_same_address(ipam_subject: Subject) -> None:
    """`reserve` is atomic: two callers with their own connections, reserving at once
    until the pool is full, get every address of it once."""
    hosts = ipam_subject.pool.hosts()
    async with ipam_subject.takers() as (first, second):
        got = await asyncio.gather(
            *(
                take(job(10 * i + n))
                for n in range(len(hosts))
                for i, take in enumerate((first, second))
            ),
            return_exceptions=True,
        )
    addresses = [a for a in got if isinstance(a, ipaddress.IPv4Address)]
    assert sorted(addresses) == hosts, got
    # The callers that came too late were told the pool is full, nothing else.
    assert all(isinstance(a, PoolExhausted) for a in got if a not in addresses), got


async def test_the_next_free_address_skips_skip_and_the_excluded(
    ipam_subject: Subject,
) -> None:
    pool = ipam_subject.pool
    hosts = pool.hosts()
    assert not set(hosts) & pool.excluded
    made = await ipam_subject.ipam.reserve(pool, job(1), skip=frozenset(hosts[:2]))
    assert made.address == hosts[2]
    # What was passed over on the way is not left held.
    for ip in hosts[:2]:
        assert await ipam_subject.ipam.holder(pool, ip, "jsomeone") is None
    with pytest.raises(PoolExhausted):
        await ipam_subject.ipam.reserve(pool, job(2), skip=frozenset(hosts))


async def test_an_asked_address_that_is_free_is_taken_exactly(ipam_subject: Subject) -> None:
    ip = ipam_subject.pool.hosts()[-1]
    made = await ipam_subject.ipam.reserve(ipam_subject.pool, job(1), address=ip)
    assert made.address == ip


async def test_an_asked_address_held_by_another_job_is_refused_naming_it(
    ipam_subject: Subject,
) -> None:
    keeps_records(ipam_subject)
    pool, ip = ipam_subject.pool, ipam_subject.pool.hosts()[1]
    await reserved(ipam_subject, job(1), address=ip)
    with pytest.raises(AddressTaken) as caught:
        await ipam_subject.ipam.reserve(pool, job(2), address=ip)
    assert "web01.lab.example" in caught.value.holder
    assert await ipam_subject.ipam.holder(pool, ip, job(2).job_id) == caught.value.holder
    assert await ipam_subject.ipam.holder(pool, ip, job(1).job_id) is None  # its own


async def test_an_asked_address_held_by_hand_is_refused_naming_it(ipam_subject: Subject) -> None:
    if ipam_subject.hold_by_hand is None:
        pytest.skip("the built-in provider has no record a person could write")
    pool, ip = ipam_subject.pool, ipam_subject.pool.hosts()[0]
    await ipam_subject.hold_by_hand(ip, "printer.lab.example")
    with pytest.raises(AddressTaken) as caught:
        await ipam_subject.ipam.reserve(pool, job(1), address=ip)
    assert "printer.lab.example" in caught.value.holder
    assert str(ip) in caught.value.message
    # The next free one passes it by.
    assert (await ipam_subject.ipam.reserve(pool, job(2))).address == pool.hosts()[1]


async def test_every_record_names_its_job_and_installation(ipam_subject: Subject) -> None:
    keeps_records(ipam_subject)
    picked = await reserved(ipam_subject, job(1))
    asked = await reserved(ipam_subject, job(2), address=ipam_subject.pool.hosts()[-1])
    await reserved(ipam_subject, job(3, installation="elsewhere"))
    found = {r.ref: r for r in await ipam_subject.ipam.records(INSTALLATION)}
    assert set(found) == {picked.ref, asked.ref}
    assert (found[str(picked.ref)].job_id, found[str(picked.ref)].address) == (
        "jcontract1",
        picked.address,
    )
    assert (found[str(asked.ref)].job_id, found[str(asked.ref)].address) == (
        "jcontract2",
        asked.address,
    )
    assert [r.job_id for r in await ipam_subject.ipam.records("elsewhere")] == ["jcontract3"]


@pytest.mark.parametrize("other", [job(2), job(1, installation="elsewhere")], ids=["job", "inst"])
async def test_a_record_not_the_jobs_is_never_touched(
    ipam_subject: Subject, other: ReservedFor
) -> None:
    """`release` and `activate` for another job, or the same job id of another
    installation, raise `NotOurs` and leave the record as it was."""
    keeps_records(ipam_subject)
    made = await reserved(ipam_subject, job(1))
    with pytest.raises(NotOurs):
        await ipam_subject.ipam.release(str(made.ref), other)
    with pytest.raises(NotOurs):
        await ipam_subject.ipam.activate(str(made.ref), other)
    [record] = await ipam_subject.ipam.records(INSTALLATION)
    assert (record.ref, record.status) == (made.ref, "reserved")


async def test_release_and_activate_are_idempotent(ipam_subject: Subject) -> None:
    keeps_records(ipam_subject)
    made = await reserved(ipam_subject, job(1))
    ref = str(made.ref)
    await ipam_subject.ipam.activate(ref, job(1))
    await ipam_subject.ipam.activate(ref, job(1))
    [record] = await ipam_subject.ipam.records(INSTALLATION)
    assert record.status == "active"
    await ipam_subject.ipam.release(ref, job(1))
    await ipam_subject.ipam.release(ref, job(1))  # already gone: released
    await ipam_subject.ipam.activate(ref, job(1))  # gone: nothing to mark
    assert await ipam_subject.ipam.records(INSTALLATION) == []
    # Free again for the next one.
    assert (await reserved(ipam_subject, job(2))).address == made.address


async def test_records_finds_reservations_left_behind(ipam_subject: Subject) -> None:
    """A caller that reserved and was never heard of again (a crash): another caller's
    `records` finds what it left, with when it was made (the reconciler's age test)."""
    keeps_records(ipam_subject)
    before = datetime.now().astimezone()
    async with ipam_subject.takers() as (crashed, _):
        left = await crashed(job(7))
    [record] = await ipam_subject.ipam.records(INSTALLATION)
    assert (record.address, record.job_id, record.status) == (left, "jcontract7", "reserved")
    assert record.created.tzinfo is not None  # compared with an aware clock
    assert abs((record.created - before).total_seconds()) < 600
    await ipam_subject.ipam.release(record.ref, job(7))
    assert await ipam_subject.ipam.records(INSTALLATION) == []


async def test_a_pool_the_ipam_gives_no_vlan_has_none(ipam_subject: Subject) -> None:
    """`vlan` is what the IPAM says of the pool's VLAN (NetBox: its prefix's), None when
    nothing: the contract's pool has none (tests/test_ipam_netbox_vlans.py has VLANs)."""
    assert await ipam_subject.ipam.vlan(ipam_subject.pool) is None


async def calls(ipam: Ipam, pool: Pool) -> AsyncIterator[tuple[str, Awaitable[object]]]:
    """Each method of the contract that talks to the IPAM, once."""
    yield "reserve", ipam.reserve(pool, job(1))
    yield "reserve address", ipam.reserve(pool, job(1), address=pool.hosts()[0])
    yield "holder", ipam.holder(pool, pool.hosts()[0], "jcontract1")
    yield "activate", ipam.activate("1", job(1))
    yield "release", ipam.release("1", job(1))
    yield "records", ipam.records(INSTALLATION)
    yield "vlan", ipam.vlan(pool)


async def test_an_ipam_that_does_not_answer_is_unreachable(ipam_subject: Subject) -> None:
    if ipam_subject.unreachable is None:
        pytest.skip("the built-in provider has no server: the store's failures are its own")
    async with ipam_subject.unreachable() as ipam:
        async for what, call in calls(ipam, ipam_subject.pool):
            with pytest.raises(Unreachable) as caught:
                await call
            assert caught.value.retryable, what


async def test_an_ipam_that_refuses_is_a_permanent_error(ipam_subject: Subject) -> None:
    if ipam_subject.refusing is None:
        pytest.skip("the built-in provider has no server that could refuse")
    async with ipam_subject.refusing() as ipam:
        async for what, call in calls(ipam, ipam_subject.pool):
            with pytest.raises(BackendError) as caught:
                await call
            assert isinstance(caught.value, PermanentError), what
            assert not caught.value.retryable, what
