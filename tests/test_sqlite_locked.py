"""SQLite's file locked by another process, or read-only, under the store (in process).

The lock is held by a real second process (tests/support/workers/sqlite_holder.py, BEGIN IMMEDIATE).
A bare `SELECT 1` reads no page, so a probe made of it answered at once while nothing
could be recorded: /readyz said ready and commands were taken in. The probe now takes
the write lock (and lets it go); waiting for it is contention, an outage only when it
lasts `slow_probes` probes in a row. A write's wait for the lock is bounded by its
retry window (`[store] write_retry_s`), not by SQLite's busy timeout on top of it. And a
file SQLite cannot write (SQLITE_READONLY) is "not now", retried like a lost server.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from bot.config.settings import Settings
from bot.models import JobState
from bot.ownership.storewatch import StoreWatch
from store.db import Store
from store.retry import RetryPolicy, Unavailable, hint, transient
from tests.support.store import finish, held, running_job


async def test_a_file_locked_by_another_process_is_not_ready_even_when_idle(
    tmp_path: Path,
) -> None:
    store = await Store.open(tmp_path / "jobs.db")
    try:
        watch = StoreWatch(store, every_s=1.0, timeout_s=0.05, slow_probes=3)
        assert await watch.check()
        with held(tmp_path / "jobs.db"):
            assert await watch.check(), "a lock held for one probe is contention"
            assert await watch.check()
            assert not await watch.check(), "nothing can be recorded: not ready"
            assert "write lock" in watch.problem, watch.problem
        assert await watch.check() and watch.problem == ""
    finally:
        await store.close()


async def test_a_write_waits_for_the_lock_no_longer_than_its_window(
    tmp_path: Path, settings: Settings
) -> None:
    path = tmp_path / "jobs.db"
    store = await Store.open(path, retry=RetryPolicy(window_s=0.5))  # busy timeout 10 s
    try:
        job = await running_job(store, settings)
        with held(path):
            began = time.monotonic()
            with pytest.raises(Unavailable, match=str(path)):
                await finish(store, job)
            waited_s = time.monotonic() - began
        # Before, one attempt alone waited SQLite's whole busy timeout (10 s).
        assert waited_s < 5, waited_s
        still = await store.jobs.get(job.id)
        assert still is not None and still.state == JobState.RUNNING  # nothing half-done
        assert await finish(store, job), "once the lock is gone the write lands"
    finally:
        await store.close()


def test_a_read_only_database_is_not_now_and_says_what_to_check(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    conn.close()
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        with pytest.raises(sqlite3.OperationalError) as caught:
            reader.execute("INSERT INTO t VALUES (1)")
    finally:
        reader.close()
    assert caught.value.sqlite_errorname.startswith("SQLITE_READONLY")
    assert transient(caught.value)
    assert "owner and mode" in hint(caught.value)
