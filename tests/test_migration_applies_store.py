"""A migration apply asked from chat (store/applies.py, schema v20), on both stores: it
ends, with the one notice that tells its final table, in the transaction that ends the
last of its builds; recorded after they all ended, at once; never twice."""

from __future__ import annotations

import asyncio

from bot.models.builds import Build, BuildState
from bot.models.notices import MIGRATION_ENDED, Notice
from bot.models.plans import MigrationApply
from store.db import Store
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


async def test_a_record_racing_its_last_build_ends_it_exactly_once(store: Store) -> None:
    """The apply's record and its build's end, side by side, many times: each apply
    ends once, in whichever order they ran."""
    builds = [await store.builds.insert(build(f"p{i}")) for i in range(12)]
    records = [apply_of(b, plan_id=f"mplan{i:05d}") for i, b in enumerate(builds)]

    async def end(b: Build) -> None:
        await store.builds.move(b.id, [BuildState.QUEUED], BuildState.CANCELLED)

    await asyncio.gather(
        *(store.migration_applies.record(r) for r in records), *(end(b) for b in builds)
    )
    for b, r in zip(builds, records, strict=True):
        assert [n.text for n in await ends(store, b.id)] == [r.id]


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
