"""Writes that fail because the database is not answering are run again, not lost
(store/retry.py): a job's state change, its event and its notice land together, once,
or not at all.

On a real PostgreSQL (this module's own cluster, stopped with `pg_ctl stop -m fast` as a
restart or failover does) and a real SQLite file locked by another connection past the
busy timeout. The outage ends on a signal from the write itself (its first retries), not
after a sleep; the window's end is met with an injected clock.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import errors

from bot.config.settings import Settings
from bot.models import JobState
from store.db import DuplicateActive, Store
from store.retry import RetryPolicy, Unavailable, transient
from tests.support.postgres import PASSWORD, start_again, stop_fast
from tests.support.store import finish, make_job, running_job


class Retries:
    """Counts the retries a policy reports, and lets a test wait for the n-th."""

    def __init__(self) -> None:
        self.seen: list[BaseException] = []
        self._changed = asyncio.Event()

    def __call__(self, exc: BaseException) -> None:
        self.seen.append(exc)
        self._changed.set()

    async def reach(self, n: int) -> None:
        while len(self.seen) < n:
            self._changed.clear()
            await self._changed.wait()


class SkippedClock:
    """Real time plus the backoff it skipped: waits cost nothing, the window still ends."""

    def __init__(self) -> None:
        self.skipped_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped_s

    async def sleep(self, seconds: float) -> None:
        self.skipped_s += seconds


def counts_pg(url: str, job_id: str) -> tuple[str, int, int]:
    with psycopg.connect(url, password=PASSWORD) as conn:
        state = conn.execute("SELECT state FROM jobs WHERE id = %s", [job_id]).fetchone()
        n_events = conn.execute(
            "SELECT count(*) FROM job_events WHERE job_id = %s AND step = 'ssh'", [job_id]
        ).fetchone()
        n_notices = conn.execute(
            "SELECT count(*) FROM outbox WHERE job_id = %s AND kind = 'finished'", [job_id]
        ).fetchone()
    assert state and n_events and n_notices
    return str(state[0]), int(n_events[0]), int(n_notices[0])


def counts_sqlite(path: Path, job_id: str) -> tuple[str, int, int]:
    with sqlite3.connect(path) as conn:
        state = conn.execute("SELECT state FROM jobs WHERE id = ?", [job_id]).fetchone()
        n_events = conn.execute(
            "SELECT count(*) FROM job_events WHERE job_id = ? AND step = 'ssh'", [job_id]
        ).fetchone()
        n_notices = conn.execute(
            "SELECT count(*) FROM outbox WHERE job_id = ? AND kind = 'finished'", [job_id]
        ).fetchone()
    return str(state[0]), int(n_events[0]), int(n_notices[0])


async def test_a_write_during_a_postgres_outage_lands_once_when_it_is_back(
    stoppable_pg: tuple[str, Path], settings: Settings
) -> None:
    url, workdir = stoppable_pg
    retries = Retries()
    store = await Store.open(url, password=PASSWORD, retry=RetryPolicy(on_retry=retries))
    try:
        job = await running_job(store, settings)
        await asyncio.to_thread(stop_fast, workdir)
        write = asyncio.create_task(finish(store, job))
        # Down until the write has failed twice: the session the server ended, then a
        # whole wait for a connection while nothing listens (POOL_WAIT_S, ~3-5 s).
        await asyncio.wait_for(retries.reach(2), timeout=30)
        assert not write.done()
        await asyncio.to_thread(start_again, workdir)
        assert await asyncio.wait_for(write, timeout=60) is True
    finally:
        await store.close()
    assert counts_pg(url, job.id) == ("succeeded", 1, 1)
    assert all(transient(exc) for exc in retries.seen)


async def test_a_postgres_outage_longer_than_the_window_fails_naming_the_database(
    stoppable_pg: tuple[str, Path], settings: Settings
) -> None:
    url, workdir = stoppable_pg
    clock, retries = SkippedClock(), Retries()
    policy = RetryPolicy(window_s=2.0, clock=clock, sleep=clock.sleep, on_retry=retries)
    store = await Store.open(url, password=PASSWORD, retry=policy)
    try:
        job = await running_job(store, settings)
        await asyncio.to_thread(stop_fast, workdir)
        with pytest.raises(Unavailable) as failed:
            await asyncio.wait_for(finish(store, job), timeout=30)
        await asyncio.to_thread(start_again, workdir)
    finally:
        await store.close()
    text = str(failed.value)
    assert store.label in text and "127.0.0.1" in text and "write_retry_s" in text
    assert "not recorded" in text and PASSWORD not in text
    assert retries.seen  # it was run again before it gave up
    assert counts_pg(url, job.id) == ("running", 0, 0)  # nothing of it landed


async def test_a_unique_constraint_is_an_answer_not_retried(
    stoppable_pg: tuple[str, Path], settings: Settings
) -> None:
    url, _workdir = stoppable_pg
    retries = Retries()
    store = await Store.open(url, password=PASSWORD, retry=RetryPolicy(on_retry=retries))
    try:
        await store.jobs.insert(make_job(settings))
        started = time.monotonic()
        with pytest.raises(DuplicateActive):  # the same name and address, in flight
            await store.jobs.insert(make_job(settings))
        assert time.monotonic() - started < 5  # at once, not after a window
    finally:
        await store.close()
    assert retries.seen == []


def test_only_connection_failures_are_transient() -> None:
    assert transient(errors.AdminShutdown("terminating connection"))
    assert transient(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert not transient(errors.UniqueViolation("duplicate key"))
    assert not transient(errors.QueryCanceled("statement timeout"))  # an answer
    assert not transient(errors.SerializationFailure("retried by the engine itself"))
    assert not transient(Unavailable("commit outcome unknown"))


async def test_a_sqlite_write_locked_out_past_the_busy_timeout_lands_once(
    tmp_path: Path, settings: Settings
) -> None:
    path = tmp_path / "jobs.db"
    retries = Retries()
    store = await Store.open(path, retry=RetryPolicy(on_retry=retries), busy_timeout_ms=50)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        job = await running_job(store, settings)
        other.execute("BEGIN EXCLUSIVE")  # another process's long write
        write = asyncio.create_task(finish(store, job))
        await asyncio.wait_for(retries.reach(3), timeout=30)  # well past 50 ms, 3 times
        assert not write.done()
        other.execute("ROLLBACK")
        assert await asyncio.wait_for(write, timeout=30) is True
    finally:
        other.close()
        await store.close()
    assert counts_sqlite(path, job.id) == ("succeeded", 1, 1)
    assert all(transient(exc) for exc in retries.seen)
    assert all("locked" in str(exc) for exc in retries.seen)


async def test_a_refused_move_keeps_neither_its_event_nor_its_notice(
    tmp_path: Path, settings: Settings
) -> None:
    path = tmp_path / "jobs.db"
    store = await Store.open(path)
    try:
        job = await running_job(store, settings)
        assert await store.jobs.transition(job.id, [JobState.RUNNING], JobState.ROLLING_BACK)
        assert await finish(store, job) is False  # not running any more: refused
    finally:
        await store.close()
    assert counts_sqlite(path, job.id) == ("rolling_back", 0, 0)
