"""The `builds` table on both stores: versions, one build of a name in flight, moves
fenced by state and owner."""

from __future__ import annotations

from datetime import timedelta

import pytest

from bot.models import utcnow
from bot.models.builds import Build, BuildState
from bot.models.plans import KeptPlan
from store.db import DuplicateActive, Store
from tests.support.store import store

__all__ = ["store"]  # the fixture (SQLite and PostgreSQL), used by name below


def build(name: str = "debian-12", backend: str = "pve", **fields: object) -> Build:
    return Build.model_validate(
        {
            "state": BuildState.QUEUED,
            "requester": "alice",
            "profile": "debian-12",
            "backend": backend,
            "name": name,
            "version": 1,
            **fields,
        }
    )


async def test_versions_count_up_per_name_and_backend(store: Store) -> None:
    first = await store.builds.insert(build())
    assert first.version == 1
    moved = await store.builds.move(first.id, [BuildState.QUEUED], BuildState.CANCELLED)
    assert moved is not None and moved.state is BuildState.CANCELLED
    second = await store.builds.insert(build())
    assert second.version == 2
    other = await store.builds.insert(build(backend="vcenter"))
    assert other.version == 1
    # What the hypervisor shows wins when it is ahead (a lost database, another installation).
    await store.builds.move(second.id, [BuildState.QUEUED], BuildState.CANCELLED)
    third = await store.builds.insert(build(), at_least=7)
    assert third.version == 7
    assert [b.version for b in await store.builds.recent("pve", "debian-12")] == [7, 2, 1]


async def test_one_build_of_a_name_in_flight(store: Store) -> None:
    await store.builds.insert(build())
    with pytest.raises(DuplicateActive):
        await store.builds.insert(build())
    assert len(await store.builds.recent()) == 1
    await store.builds.insert(build(name="debian-13"))


async def test_moves_are_fenced_by_state_and_owner(store: Store) -> None:
    b = await store.builds.insert(build(owner="r1"))
    assert await store.builds.move(b.id, [BuildState.RUNNING], BuildState.PUBLISHED) is None
    assert await store.builds.move(b.id, [BuildState.QUEUED], BuildState.RUNNING, "r2") is None
    running = await store.builds.move(
        b.id, [BuildState.QUEUED], BuildState.RUNNING, "r1", started_at=utcnow()
    )
    assert running is not None and running.started_at is not None
    assert not await store.builds.update(b.id, "r2", vm_id="900")
    assert await store.builds.update(b.id, "r1", vm_id="900", notes=("SELinux: none",))
    got = await store.builds.get(b.id)
    assert got is not None and got.vm_id == "900" and got.notes == ("SELinux: none",)
    with pytest.raises(ValueError, match="not a build transition"):
        await store.builds.move(b.id, [BuildState.RUNNING], BuildState.QUEUED)


async def test_abandoned_builds_are_those_whose_lease_lapsed(store: Store) -> None:
    now = utcnow()
    live = await store.builds.insert(build(owner="r1", lease_until=now + timedelta(seconds=60)))
    dead = await store.builds.insert(
        build(name="debian-13", owner="r2", lease_until=now - timedelta(seconds=1))
    )
    for b in (live, dead):
        await store.builds.move(b.id, [BuildState.QUEUED], BuildState.RUNNING)
    assert [b.id for b in await store.builds.abandoned(now)] == [dead.id]


async def test_the_builds_a_migration_must_not_start_again(store: Store) -> None:
    """`of_profiles`: in flight or published builds of these profiles on one backend,
    newest first (a failed or retired one is no reason not to build again)."""
    failed = await store.builds.insert(build("debian-12"))
    await store.builds.move(failed.id, [BuildState.QUEUED], BuildState.CANCELLED)
    published = await store.builds.insert(build("debian-12"))
    await store.builds.move(published.id, [BuildState.QUEUED], BuildState.RUNNING)
    await store.builds.move(published.id, [BuildState.RUNNING], BuildState.PUBLISHED)
    other = await store.builds.insert(build("alma", profile="alma-9"))
    await store.builds.insert(build("debian-12", backend="elsewhere"))
    found = await store.builds.of_profiles("pve", ["debian-12", "alma-9"])
    assert [b.id for b in found] == [other.id, published.id]
    assert await store.builds.of_profiles("pve", []) == []


async def test_a_migration_plan_is_kept_and_read_back_by_id(store: Store) -> None:
    kept = await store.migration_plans.keep(
        KeptPlan(digest="sha256:" + "ab" * 32, document='{"a": "é"}', created_by="bob")
    )
    again = await store.migration_plans.get(kept.id)
    assert again == kept
    assert await store.migration_plans.get("mnotaplan2") is None
