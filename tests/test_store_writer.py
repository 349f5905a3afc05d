"""Writes made at the same moment share one transaction (store/writer.py), and each
still succeeds or fails on its own; what a caller is told is written is committed."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from bot.config.settings import Settings
from bot.models import JobEvent, JobState
from store.db import DuplicateActive, Store
from store.sql import ConstraintViolation
from tests.support.store import make_job, sqlite_store, trace

__all__ = ["sqlite_store"]  # the fixture, used by name below


def committed(path: str | Path, sql: str) -> list[tuple[object, ...]]:
    """What another connection (another process) sees: only committed rows."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def test_writes_of_one_moment_share_a_transaction_and_fail_alone(
    sqlite_store: Store, settings: Settings
) -> None:
    store = sqlite_store
    running = [make_job(settings, f"run{i}", f"10.0.0.{10 + i}") for i in range(5)]
    for job in running:
        await store.jobs.insert(job)
    fresh = [make_job(settings, f"new{i}", f"10.0.0.{30 + i}") for i in range(5)]
    clash = make_job(settings, "clash", "10.0.0.30")  # fresh[0]'s address
    statements: list[str] = []
    await store.engine.call(trace, statements.append)  # SQLite's own account, on its thread
    results = await asyncio.gather(
        *(store.jobs.insert(job) for job in fresh),
        store.jobs.insert(clash),
        *(store.jobs.move(j.id, [JobState.QUEUED], JobState.RUNNING) for j in running),
        store.jobs.move(running[0].id, [JobState.QUEUED], JobState.RUNNING),  # lost the race
        store.jobs.add_event(JobEvent(job_id="nosuchjob", step="clone", phase="started")),
        return_exceptions=True,
    )
    await store.engine.call(trace, None)
    assert statements.count("BEGIN IMMEDIATE") == 1  # one transaction for thirteen writes
    inserted, clashed = results[:5], results[5]
    moves, lost, orphan = results[6:11], results[11], results[12]
    assert [getattr(j, "id", None) for j in inserted] == [j.id for j in fresh]
    assert isinstance(clashed, DuplicateActive) and clashed.what == "address"
    for moved in moves:
        assert isinstance(moved, tuple) and moved[0] and moved[1] is not None
        assert moved[1].state is JobState.RUNNING
    assert lost == (False, None)
    assert isinstance(orphan, ConstraintViolation)
    seen = committed(store.label, "SELECT name, state FROM jobs ORDER BY name")
    assert ("clash", "queued") not in seen and len(seen) == 10
    assert {s for n, s in seen if str(n).startswith("run")} == {"running"}
