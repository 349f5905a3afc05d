"""A migration apply asked from chat (store/applies.py, schema v20), on both stores: it
ends, with the one notice that tells its final table, in the transaction that ends the
last of its builds; recorded after they all ended, at once; never twice."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from bot.models.builds import Build, BuildState
from bot.models.notices import MIGRATION_ENDED, Notice, NoticeKind
from bot.models.plans import MigrationApply
from store import applies, builds
from store.db import Store
from store.postgres.db import PgDb
from store.sql import Db
from tests.support.postgres import PASSWORD_ENV
from tests.support.store import store

__all__ = ["store"]  # the fixture (SQLite and PostgreSQL), used by name below


def build(name: str, **fields: object) -> Build:
    return Build.model_validate(
        {
            "state": BuildState.QUEUED,
            "requester": "UBOB",
            "profile": name,
            "backend": "pve",
            "name": name,
            "version": 1,
            **fields,
        }
    )


def apply_of(*builds: Build, plan_id: str = "mplan00001", **fields: str) -> MigrationApply:
    return MigrationApply.model_validate(
        {
            "plan_id": plan_id,
            "requester": "UBOB",
            "origin": "C0DEPLOYS",
            "rebuilds": "[]",
            "build_ids": tuple(b.id for b in builds),
            **fields,
        }
    )


async def ends(store: Store, build_id: str) -> list[Notice]:
    return [n for n in await store.outbox.undelivered(build_id) if n.step == MIGRATION_ENDED]


async def test_the_last_build_to_end_ends_the_apply_with_one_notice(store: Store) -> None:
    # No origin: a build the apply found in flight, asked from the command line.
    first = await store.builds.insert(build("alma-9"))
    second = await store.builds.insert(build("debian-13", origin="C0DEPLOYS"))
    record = apply_of(first, second)
    assert (await store.migration_applies.record(record)).ended_at is None
    await store.builds.move(first.id, [BuildState.QUEUED], BuildState.RUNNING)
    await store.builds.move(first.id, [BuildState.RUNNING], BuildState.PUBLISHED)
    assert await ends(store, first.id) == []  # debian-13 is still queued
    kept = await store.migration_applies.get(record.id)
    assert kept is not None and kept.ended_at is None
    assert kept.build_ids == tuple(sorted((first.id, second.id)))
    await store.builds.move(second.id, [BuildState.QUEUED], BuildState.CANCELLED)
    (notice,) = await ends(store, second.id)
    assert notice.text == record.id
    ended = await store.migration_applies.get(record.id)
    assert ended is not None and ended.ended_at is not None
    assert await ends(store, first.id) == []


async def test_an_apply_recorded_after_its_builds_ended_ends_at_once(store: Store) -> None:
    done = await store.builds.insert(build("alma-9"))
    await store.builds.move(done.id, [BuildState.QUEUED], BuildState.CANCELLED)
    record = apply_of(done)
    assert (await store.migration_applies.record(record)).ended_at is not None
    (notice,) = await ends(store, done.id)
    assert notice.text == record.id


def _waits_on_a_lock(monitor: psycopg.Connection[Any], pid: int) -> bool:
    row = monitor.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", [pid]
    ).fetchone()
    return row is not None and int(row[0]) > 0


def _second_waits_for_first(
    url: str, first: Callable[[Db], object], second: Callable[[Db], object]
) -> None:
    """`first` in a transaction left open; `second` on another connection, in a thread;
    once PostgreSQL says the second waits on a lock (or it ended without waiting), the
    first commits and the second runs on."""
    password = os.environ[PASSWORD_ENV]
    with (
        psycopg.connect(url, password=password, autocommit=True) as one,
        psycopg.connect(url, password=password, autocommit=True) as two,
        psycopg.connect(url, password=password, autocommit=True) as monitor,
    ):
        one.execute("BEGIN")
        first(PgDb(one))  # its store transaction is a savepoint of this open one
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(second, PgDb(two))
            deadline = time.monotonic() + 30
            while not running.done() and not _waits_on_a_lock(monitor, two.info.backend_pid):
                assert time.monotonic() < deadline, "the second neither waited nor ended"
            one.execute("COMMIT")
            running.result()


@pytest.mark.parametrize("order", ["the build's end first", "the record first"])
async def test_a_record_and_its_last_build_ending_side_by_side_end_it_once(
    pg_url: str, order: str
) -> None:
    """On PostgreSQL, whose transactions run side by side: one of the two holds its
    transaction open while the other starts; the other waits for it (`applies.LOCK`)
    and so sees what it did, whichever order they ran: the apply ends exactly once.
    Without the lock neither would see the other and the end would never be told."""
    store = await Store.open(pg_url, password=os.environ[PASSWORD_ENV])
    try:
        await _side_by_side(store, pg_url, order)
    finally:
        await store.close()


async def _side_by_side(store: Store, url: str, order: str) -> None:
    b = await store.builds.insert(build("alma-9"))
    record = apply_of(b)

    def end(db: Db) -> object:
        return builds.move_build(db, b.id, [BuildState.QUEUED], BuildState.CANCELLED)

    def keep(db: Db) -> object:
        return applies.record_apply(db, record)

    if order == "the record first":
        _second_waits_for_first(url, keep, end)
    else:
        _second_waits_for_first(url, end, keep)
    assert [n.text for n in await ends(store, b.id)] == [record.id]


async def test_the_same_command_or_a_re_run_in_the_channel_keeps_one_apply(
    store: Store,
) -> None:
    """A command recorded again under its id (redelivered, or re-run after its process
    died), or the same plan applied again in the same channel while its apply is live,
    keeps no second apply: the live one answers, and its end is told once. Once it has
    ended, an apply of the plan is kept again; another channel has its own."""
    first = await store.builds.insert(build("alma-9"))
    record = apply_of(first, id="akey000001")
    assert (await store.migration_applies.record(record)).id == record.id
    assert (await store.migration_applies.record(record)).id == record.id
    rerun = apply_of(first, id="akey000002", requester="UALICE")
    assert (await store.migration_applies.record(rerun)).id == record.id
    assert await store.migration_applies.get(rerun.id) is None
    elsewhere = apply_of(first, id="akey000003", origin="C0OTHER")
    assert (await store.migration_applies.record(elsewhere)).id == elsewhere.id
    await store.builds.move(first.id, [BuildState.QUEUED], BuildState.CANCELLED)
    assert sorted(n.text for n in await ends(store, first.id)) == [record.id, elsewhere.id]
    second = await store.builds.insert(build("alma-9"))
    later = apply_of(second, id="akey000004")
    assert (await store.migration_applies.record(later)).id == later.id


async def test_an_apply_build_asked_elsewhere_gets_only_the_apply_end_told(store: Store) -> None:
    """A build the apply found in flight, asked from the command line (no origin, no
    approval): its own notices stay unfollowed; only the apply's end is kept for it."""
    b = await store.builds.insert(build("alma-9"))
    record = apply_of(b)
    await store.migration_applies.record(record)
    running = Notice(job_id=b.id, kind=NoticeKind.BUILD, step="running", text="started")
    await store.builds.move(b.id, [BuildState.QUEUED], BuildState.RUNNING, notices=[running])
    assert await store.outbox.undelivered(b.id) == []
    await store.builds.move(b.id, [BuildState.RUNNING], BuildState.PUBLISHED)
    assert [n.text for n in await store.outbox.undelivered(b.id)] == [record.id]
