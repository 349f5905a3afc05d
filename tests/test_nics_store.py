"""Every NIC's address and fixed MAC of a job is held like its first address (issue 29):
unique among jobs in flight or succeeded, decided by the store in the insert's own
transaction (store/migrations.py v19, `job_addresses`, with the job's state copied by a
trigger), on SQLite and on PostgreSQL alike; freed when the job ends."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlite_utils import Database

from bot.models import Job, JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from store.db import DuplicateActive, Store
from store.jobs import job_row
from store.migrations import MIGRATIONS
from tests.support.deployer import make_settings
from tests.support.store import store

__all__ = ["store"]  # the fixture (SQLite and PostgreSQL), used by name below


def _settings(tmp_path: Path) -> Any:
    subnets = [
        {"cidr": f"10.0.{n}.0/24", "gateway": f"10.0.{n}.1", "name": f"lab{n}"} for n in (0, 20, 30)
    ]
    return make_settings(tmp_path / "cfg", subnets=subnets)


def job(settings: Any, text: str, state: JobState = JobState.QUEUED) -> Job:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return Job.for_request(build_request(args, settings, "alice"), state)


async def test_a_later_nics_address_is_held_against_every_nic_of_other_jobs(
    store: Store, tmp_path: Path
) -> None:
    settings = _settings(tmp_path)
    first = await store.jobs.insert(job(settings, "web01 10.0.0.50 +10.0.20.5 +10.0.30.5"))
    # The second NIC's address as another job's first, or as its second: refused.
    for text in ("web02 10.0.20.5", "web02 10.0.0.60 +10.0.20.5", "web02 10.0.0.50 +10.0.20.6"):
        with pytest.raises(DuplicateActive) as caught:
            await store.jobs.insert(job(settings, text))
        assert caught.value.what == "address"
    # Nothing of a refused insert was kept: its own other address is free.
    assert await store.addresses.holder("10.0.0.60") is None
    held = await store.addresses.held()
    assert {a: h[0] for a, h in held.items()} == dict.fromkeys(
        ["10.0.0.50", "10.0.20.5", "10.0.30.5"], first.id
    )
    found = await store.jobs.holder(
        backend="sim", name="x", address="10.0.0.99", more=["10.0.30.5"]
    )
    assert found is not None and found.id == first.id
    # Once the job ends, every address of it is free (the trigger moved their state).
    await store.jobs.transition(first.id, [JobState.QUEUED], JobState.CANCELLED)
    assert await store.addresses.held() == {}
    again = await store.jobs.insert(job(settings, "web02 10.0.20.5 +10.0.30.5"))
    assert await store.addresses.holder("10.0.30.5") == (again.id, "web02", "sim", True)


async def test_a_fixed_mac_is_held_by_one_live_job(store: Store, tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    mac = "52:54:00:12:34:56"
    first = await store.jobs.insert(job(settings, f"web01 10.0.0.50 +10.0.20.5 mac2={mac}"))
    with pytest.raises(DuplicateActive) as caught:
        await store.jobs.insert(job(settings, f"web02 10.0.0.51 mac={mac}"))
    assert caught.value.what == "mac"
    found = await store.jobs.holder(backend="sim", name="x", address="10.0.0.99", macs=[mac])
    assert found is not None and found.id == first.id
    # Jobs without a fixed MAC never collide over it.
    await store.jobs.insert(job(settings, "web03 10.0.0.52"))
    await store.jobs.insert(job(settings, "web04 10.0.0.53"))
    await store.jobs.transition(first.id, [JobState.QUEUED], JobState.CANCELLED)
    await store.jobs.insert(job(settings, f"web02 10.0.0.51 mac={mac}"))


async def test_requests_racing_for_one_later_address_one_wins(store: Store, tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    racers = [job(settings, f"web{n} 10.0.0.{60 + n} +10.0.30.9") for n in range(6)]
    results = await asyncio.gather(*(store.jobs.insert(j) for j in racers), return_exceptions=True)
    won = [r for r in results if isinstance(r, Job)]
    lost = [r for r in results if isinstance(r, DuplicateActive)]
    assert len(won) == 1 and len(lost) == 5, results
    held = await store.addresses.held()
    assert sorted(held) == sorted([str(won[0].address), "10.0.30.9"])


async def test_v19_backfills_the_first_address_of_every_job(tmp_path: Path) -> None:
    """A database from before several NICs: each job's address becomes its NIC 0 row,
    so a later NIC of a new job cannot take a live job's address."""
    settings = _settings(tmp_path)
    path = tmp_path / "old.db"
    db = Database(sqlite3.connect(path))
    for migration in MIGRATIONS[:18]:
        migration(db)
    db.execute("PRAGMA user_version = 18")
    live = job(settings, "web01 10.0.20.5", JobState.SUCCEEDED)
    ended = job(settings, "web02 10.0.20.6", JobState.FAILED)
    for old in (live, ended):
        db.table("jobs").insert(job_row(old))
    db.conn.commit()
    db.conn.close()
    store = await Store.open(path)
    try:
        with pytest.raises(DuplicateActive):
            await store.jobs.insert(job(settings, "web03 10.0.0.50 +10.0.20.5"))
        await store.jobs.insert(job(settings, "web04 10.0.0.51 +10.0.20.6"))
        # The trigger keeps the backfilled row's state with its job's.
        await store.jobs.transition(live.id, [JobState.SUCCEEDED], JobState.RELEASED)
        await store.jobs.insert(job(settings, "web03 10.0.0.50 +10.0.20.5"))
    finally:
        await store.close()
