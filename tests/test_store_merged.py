"""The step events of deploys ending a step together are written by one call of a
set-based store function (store/jobs.add_events), on SQLite and on PostgreSQL alike,
and still each only under its own claim, each failing alone. The fence reads of deploys
beginning a step together, and the address checks of requests asked together, are
read by one call too (store/repository.gathered), each answered its own row."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from pathlib import Path

import psycopg

from bot.config.settings import Settings
from bot.models import Claim, JobEvent, utcnow
from store.db import Store
from store.jobrows import _row, event_row
from store.postgres import PostgresEngine
from store.sql import ConstraintViolation
from tests.support.postgres import PASSWORD_ENV
from tests.support.store import make_job, store, trace

__all__ = ["store"]  # the fixture (SQLite and PostgreSQL), used by name below


async def _claimed(store: Store, settings: Settings, count: int) -> list[tuple[str, int]]:
    """`count` jobs, each claimed by runner r-one: (id, epoch)."""
    now = utcnow()
    claimed = []
    for i in range(count):
        job = make_job(settings, f"web{i:02d}", f"10.0.0.{50 + i}")
        await store.jobs.insert(job)
        epoch = await store.runners.claim(job.id, "r-one", now, now + timedelta(seconds=30))
        assert epoch is not None
        claimed.append((job.id, epoch))
    return claimed


async def test_events_of_one_moment_are_written_under_each_claim_and_fail_alone(
    store: Store, settings: Settings
) -> None:
    held, stale, other, orphan_job = await _claimed(store, settings, 4)
    results = await asyncio.gather(
        store.jobs.add_event(JobEvent(job_id=held[0], step="clone", phase="started"), None,
                        Claim(runner="r-one", epoch=held[1])),
        store.jobs.add_event(JobEvent(job_id=stale[0], step="clone", phase="started"), None,
                        Claim(runner="r-one", epoch=stale[1] - 1)),  # an older claim
        store.jobs.add_event(JobEvent(job_id=other[0], step="clone", phase="started"), None,
                        Claim(runner="r-two", epoch=other[1])),  # another runner's
        store.jobs.add_event(JobEvent(job_id=orphan_job[0], step="clone", phase="started"), None,
                        Claim(runner="r-one")),  # any claim of this runner's
        store.jobs.add_event(JobEvent(job_id="nosuchjob", step="clone", phase="started")),
        return_exceptions=True,
    )  # fmt: skip
    assert list(results[:4]) == [True, False, False, True]
    assert isinstance(
        results[4], ConstraintViolation
    )  # alone: the others were written all the same
    assert [e.phase for e in await store.jobs.events(held[0])] == ["started"]
    assert await store.jobs.events(stale[0]) == [] and await store.jobs.events(other[0]) == []
    assert [e.phase for e in await store.jobs.events(orphan_job[0])] == ["started"]


async def test_sqlite_reads_the_claims_of_events_added_together_once(
    tmp_path: Path, settings: Settings
) -> None:
    store = await Store.open(tmp_path / "jobs.db")
    try:
        claimed = await _claimed(store, settings, 20)
        statements: list[str] = []
        await store.engine.call(trace, statements.append)  # SQLite's own account, on its thread
        added = await asyncio.gather(
            *(
                store.jobs.add_event(JobEvent(job_id=j, step="clone", phase="started"), None,
                                Claim(runner="r-one", epoch=e))
                for j, e in claimed
            )
        )  # fmt: skip
        await store.engine.call(trace, None)
    finally:
        await store.close()
    assert added == [True] * 20
    reads = [s for s in statements if s.startswith("SELECT") and " FROM jobs " in s]
    assert len(reads) == 1  # one fence read for twenty events, not twenty
    assert len([s for s in statements if s.startswith("SAVEPOINT")]) <= 2


async def test_reads_of_one_moment_answer_each_its_own_row(
    store: Store, settings: Settings
) -> None:
    (first, epoch), (second, later) = await _claimed(store, settings, 2)
    claims = await asyncio.gather(
        store.runners.claim_of(first),
        store.runners.claim_of("nosuchjob"),
        store.runners.claim_of(second),
        store.runners.claim_of(first),
    )
    assert list(claims) == [("r-one", epoch), None, ("r-one", later), ("r-one", epoch)]
    holders = await asyncio.gather(
        store.addresses.holder("10.0.0.51"), store.addresses.holder("10.0.0.99")
    )
    assert holders[1] is None and holders[0] is not None and holders[0][0] == second


async def test_sqlite_reads_the_claims_and_addresses_asked_together_once(
    tmp_path: Path, settings: Settings
) -> None:
    """Twenty fences asking at once were twenty round trips to the store's thread."""
    store = await Store.open(tmp_path / "jobs.db")
    try:
        claimed = await _claimed(store, settings, 20)
        statements: list[str] = []
        await store.engine.call(trace, statements.append)
        claims = await asyncio.gather(*(store.runners.claim_of(j) for j, _e in claimed))
        holders = await asyncio.gather(
            *(store.addresses.holder(f"10.0.0.{50 + i}") for i in range(20))
        )
        await store.engine.call(trace, None)
    finally:
        await store.close()
    assert claims == [("r-one", e) for _j, e in claimed]
    assert [h[0] if h else None for h in holders] == [j for j, _e in claimed]
    reads = [s for s in statements if s.startswith("SELECT") and " FROM jobs " in s]
    assert len(reads) == 2  # one for the twenty claims, one for the twenty addresses


async def test_postgres_writes_events_added_together_in_one_transaction(
    pg_url: str, settings: Settings
) -> None:
    store = await Store.open(pg_url, password=os.environ[PASSWORD_ENV])
    try:
        assert isinstance(store.engine, PostgresEngine)
        claimed = await _claimed(store, settings, 20)
        before = _xid(pg_url)
        added = await asyncio.gather(
            *(
                store.jobs.add_event(JobEvent(job_id=j, step="clone", phase="started"), None,
                                Claim(runner="r-one", epoch=e))
                for j, e in claimed
            )
        )  # fmt: skip
        after = _xid(pg_url)
    finally:
        await store.close()
    assert added == [True] * 20
    # Every transaction that writes takes a transaction id (the two reads here one each):
    # twenty events written alone took twenty.
    assert after - before - 1 <= 2


def _xid(url: str) -> int:
    with psycopg.connect(url, password=os.environ[PASSWORD_ENV], autocommit=True) as conn:
        row = conn.execute(b"SELECT txid_current()").fetchone()
    assert row is not None
    return int(row[0])


def test_an_events_row_is_read_off_every_field_of_the_model() -> None:
    """`event_row` spells the fields out (a model_dump per event cost the store's thread
    more than the insert): a field added to JobEvent must be added there too."""
    events = [
        JobEvent(job_id="j1", step="clone", phase="started", detail="from ubuntu"),
        JobEvent(job_id="j1", step="clone", phase="finished", duration_s=1.5),
    ]
    for event in events:
        row = event_row(event)
        assert row == _row(event) and set(row) == set(JobEvent.model_fields)
