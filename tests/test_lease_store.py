"""The lease steps' compare-and-sets (store/leases.py) on both stores: racing writers
decide once, each with its notices and audit row or neither; a powered-off VM keeps its
name and address."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from bot.config.settings import Settings
from bot.leases.enforce import notice
from bot.models import AuditEvent, Job, JobState, utcnow
from bot.models.notices import NoticeKind
from store.db import AlreadyDelivered, DuplicateActive, Store
from tests.support.store import make_job, store  # noqa: F401 (the fixture on both stores)


async def ready(store: Store, settings: Settings, name: str = "web01") -> Job:  # noqa: F811
    job = make_job(settings, name, "10.0.0.50", state=JobState.SUCCEEDED)
    job = job.model_copy(
        update={"origin": "CDEPLOYS01", "lease_s": 86400, "finished_at": utcnow(), "vm_id": "101"}
    )
    return await store.jobs.insert(job)


def audit(outcome: str) -> AuditEvent:
    return AuditEvent(actor="deploybot", action="lease test", outcome=outcome)


async def lease_notices(store: Store, job_id: str) -> list[str]:  # noqa: F811
    return [
        n.step or "" for n in await store.outbox.undelivered(job_id) if n.kind is NoticeKind.LEASE
    ]


async def test_a_reminder_raced_by_two_writers_is_recorded_once(
    store: Store,  # noqa: F811
    settings: Settings,
) -> None:
    job = await ready(store, settings)
    now = utcnow()
    told = [notice(job, "remind", job.lease_end, now)]
    results = await asyncio.gather(
        *(
            store.leases.write_step("remind", job, "86400", told, audit("reminded"))
            for _ in range(4)
        )
    )
    assert sum(r is not None for r in results) == 1
    assert await lease_notices(store, job.id) == ["remind"]
    assert [e.outcome for e in await store.audit.events()] == ["reminded"]
    # Read again, the next reminder goes on from what was recorded.
    again = await store.jobs.get(job.id)
    assert again is not None and again.reminders_sent == "86400"
    assert await store.leases.write_step("remind", job, "86400", told, audit("x")) is None


async def test_an_extension_claims_its_click_and_moves_the_end_once(
    store: Store,  # noqa: F811
    settings: Settings,
) -> None:
    job = await ready(store, settings)
    end = utcnow() + timedelta(days=8)
    told = [notice(job, "extended", end, utcnow(), "alice")]
    done = await store.leases.write_step("extend", job, end, told, audit("extended"), "click:1")
    assert done is not None and done.expires_at == end and done.reminders_sent is None
    with pytest.raises(AlreadyDelivered):
        await store.leases.write_step("extend", done, end, told, audit("extended"), "click:1")
    # A stale read (the end as it was) moves nothing, and keeps no claim of its click.
    assert await store.leases.write_step("extend", job, end, told, audit("x"), "click:2") is None
    assert await store.jobs.delivered("click:2") is None
    assert await lease_notices(store, job.id) == ["extended"]


async def test_expired_off_holds_the_name_and_an_extension_brings_it_back(
    store: Store,  # noqa: F811
    settings: Settings,
) -> None:
    job = await ready(store, settings)
    off_at = utcnow()
    off = await store.leases.write_step("expire", job, off_at, [], audit("expired"))
    assert off is not None and off.state is JobState.EXPIRED_OFF and off.powered_off_at == off_at
    assert await store.leases.write_step("expire", job, off_at, [], audit("expired")) is None
    with pytest.raises(DuplicateActive):
        await store.jobs.insert(make_job(settings, "web01", "10.0.0.50"))
    end = utcnow() + timedelta(days=7)
    back = await store.leases.write_step("extend", off, end, [], audit("extended"))
    assert back is not None and back.state is JobState.SUCCEEDED and back.powered_off_at is None
    watched = await store.leases.watched()
    assert [j.id for j in watched] == [job.id]
