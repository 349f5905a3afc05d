from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
from datetime import timedelta
from pathlib import Path

import pytest

from bot.config.settings import Settings
from bot.models import Approval, ApprovalState, HostKeySource, JobEvent, JobState, utcnow
from bot.models.notices import Notice, NoticeKind
from store.db import AlreadyDelivered, DuplicateActive, Store
from store.migrations import SCHEMA_VERSION
from store.sql import ConstraintViolation
from tests.support.store import make_job, sqlite_store, store, trace

__all__ = ["sqlite_store", "store"]  # fixtures, used by name


async def test_migrates_an_empty_file_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "jobs.db"
    store = await Store.open(path)
    await store.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"jobs", "job_events", "approvals"} <= tables
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"jobs_active_name", "jobs_active_address", "idx_jobs_requester_created_at"} <= indexes
    conn.close()
    again = await Store.open(path)  # reopening runs no migration twice
    await again.close()


async def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this deploybot"):
        await Store.open(path)


async def test_job_round_trips(store: Store, settings: Settings) -> None:
    job = make_job(settings)
    await store.jobs.insert(job)
    loaded = await store.jobs.get(job.id)
    assert loaded == job
    assert await store.jobs.get("jnothere") is None


async def test_transition_is_compare_and_set(store: Store, settings: Settings) -> None:
    job = make_job(settings)
    await store.jobs.insert(job)
    assert await store.jobs.transition(
        job.id, [JobState.QUEUED], JobState.RUNNING, started_at=utcnow()
    )
    assert not await store.jobs.transition(job.id, [JobState.QUEUED], JobState.RUNNING)
    assert not await store.jobs.transition(job.id, [JobState.QUEUED], JobState.CANCELLED)
    loaded = await store.jobs.get(job.id)
    assert loaded is not None and loaded.state is JobState.RUNNING
    assert loaded.started_at is not None


async def test_transition_refuses_edges_that_do_not_exist(store: Store, settings: Settings) -> None:
    job = make_job(settings)
    await store.jobs.insert(job)
    with pytest.raises(ValueError, match="not a job transition"):
        await store.jobs.transition(job.id, [JobState.QUEUED], JobState.SUCCEEDED)
    with pytest.raises(ValueError, match="not job columns"):
        await store.jobs.transition(job.id, [JobState.QUEUED], JobState.RUNNING, state="x")


async def test_concurrent_writers_on_one_file_only_one_wins(
    tmp_path: Path, settings: Settings
) -> None:
    """Separate Store instances have separate connections and threads: real contention."""
    stores = [await Store.open(tmp_path / "shared.db") for _ in range(6)]
    try:
        jobs = [make_job(settings, f"vm{i}", f"10.0.0.{10 + i}") for i in range(20)]
        for job in jobs:
            await stores[0].jobs.insert(job)
        for job in jobs:
            results = await asyncio.gather(
                *(s.jobs.transition(job.id, [JobState.QUEUED], JobState.RUNNING) for s in stores),
                *(s.jobs.transition(job.id, [JobState.QUEUED], JobState.CANCELLED) for s in stores),
            )
            assert sum(results) == 1
        assert await stores[0].integrity_check() == "ok"
    finally:
        for s in stores:
            await s.close()


async def test_one_active_job_per_name_and_per_address(store: Store, settings: Settings) -> None:
    first = make_job(settings, "web01", "10.0.0.50")
    await store.jobs.insert(first)
    with pytest.raises(DuplicateActive) as dup:
        await store.jobs.insert(make_job(settings, "web01", "10.0.0.51"))
    assert dup.value.what == "name"
    with pytest.raises(DuplicateActive) as dup:
        await store.jobs.insert(make_job(settings, "web02", "10.0.0.50"))
    assert dup.value.what == "address"
    # Once the first job has ended, both are free again.
    assert await store.jobs.transition(first.id, [JobState.QUEUED], JobState.CANCELLED)
    await store.jobs.insert(make_job(settings, "web01", "10.0.0.50"))


async def test_twenty_simultaneous_inserts_of_one_name_make_one_job(
    tmp_path: Path, settings: Settings
) -> None:
    stores = [await Store.open(tmp_path / "shared.db") for _ in range(4)]
    try:

        async def attempt(i: int) -> bool:
            try:
                await stores[i % 4].jobs.insert(make_job(settings, "web01", f"10.0.0.{20 + i}"))
            except DuplicateActive:
                return False
            return True

        results = await asyncio.gather(*(attempt(i) for i in range(20)))
        assert sum(results) == 1
    finally:
        for s in stores:
            await s.close()


async def test_history_pages_hold_a_page_each_and_lose_no_tie(
    store: Store, settings: Settings
) -> None:
    """`deploybot history 100000` reads a page per query (keyset on created_at, rowid),
    so it holds one page, not the whole listing; jobs made in the same instant (ten at
    each) are neither lost nor repeated across page boundaries."""
    at = utcnow()
    for i in range(25):
        job = make_job(settings, f"page{i}", f"10.0.0.{100 + i}")
        await store.jobs.insert(
            job.model_copy(update={"created_at": at + timedelta(seconds=i // 10)})
        )
    whole = await store.jobs.history(limit=30)
    pages = [page async for page in store.jobs.history_pages(limit=23, page_size=10)]
    assert [len(page) for page in pages] == [10, 10, 3]
    assert [j.id for page in pages for j in page] == [j.id for j in whole[:23]]
    everything = [page async for page in store.jobs.history_pages(limit=1000, page_size=10)]
    assert [len(page) for page in everything] == [10, 10, 5]
    assert [j.id for page in everything for j in page] == [j.id for j in whole]
    alone = [page async for page in store.jobs.history_pages(name="page3", limit=5)]
    assert [[j.name for j in page] for page in alone] == [["page3"]]


async def test_history_filters_and_orders_newest_first(store: Store, settings: Settings) -> None:
    jobs = []
    for i, who in enumerate(["alice", "bob", "alice", "carol"]):
        job = make_job(settings, f"vm{i}", f"10.0.0.{30 + i}", requester=who)
        job = job.model_copy(update={"created_at": utcnow() + timedelta(seconds=i)})
        await store.jobs.insert(job)
        jobs.append(job)
    await store.jobs.transition(jobs[2].id, [JobState.QUEUED], JobState.CANCELLED)
    newest = await store.jobs.history(limit=10)
    assert [j.id for j in newest] == [j.id for j in reversed(jobs)]
    assert [j.id for j in await store.jobs.history(requester="alice")] == [jobs[2].id, jobs[0].id]
    assert [j.id for j in await store.jobs.history(state=JobState.CANCELLED)] == [jobs[2].id]
    assert [j.id for j in await store.jobs.history(name="vm1")] == [jobs[1].id]
    assert len(await store.jobs.history(limit=2)) == 2
    since = await store.jobs.history(since=jobs[2].created_at)
    assert {j.id for j in since} == {jobs[2].id, jobs[3].id}


async def test_events_keep_their_order(store: Store, settings: Settings) -> None:
    job = make_job(settings)
    await store.jobs.insert(job)
    for step in ("clone", "identity", "power_on"):
        await store.jobs.add_event(JobEvent(job_id=job.id, step=step, phase="started"))
        await store.jobs.add_event(
            JobEvent(job_id=job.id, step=step, phase="finished", duration_s=0.5)
        )
    events = await store.jobs.events(job.id)
    assert [(e.step, e.phase) for e in events][:3] == [
        ("clone", "started"),
        ("clone", "finished"),
        ("identity", "started"),
    ]
    assert events[1].duration_s == 0.5


async def test_approval_is_decided_once(tmp_path: Path, settings: Settings) -> None:
    stores = [await Store.open(tmp_path / "shared.db") for _ in range(4)]
    try:
        job = make_job(settings, state=JobState.AWAITING_APPROVAL)
        approval = Approval(
            job_id=job.id, reason_required="always", expires_at=utcnow() + timedelta(hours=1)
        )
        await stores[0].jobs.insert(job, approval)
        results = await asyncio.gather(
            *(s.approvals.decide(job.id, ApprovalState.APPROVED, by="bob") for s in stores),
            *(
                s.approvals.decide(job.id, ApprovalState.REJECTED, by="carol", note="no")
                for s in stores
            ),
        )
        assert sum(results) == 1
        decided = await stores[0].approvals.get(job.id)
        loaded = await stores[0].jobs.get(job.id)
        assert decided is not None and loaded is not None
        assert decided.decided_by in ("bob", "carol") and decided.decided_at is not None
        expected = JobState.QUEUED if decided.state is ApprovalState.APPROVED else JobState.REJECTED
        assert loaded.state is expected
    finally:
        for s in stores:
            await s.close()


async def test_a_decision_on_a_cancelled_job_changes_nothing(
    store: Store, settings: Settings
) -> None:
    job = make_job(settings, state=JobState.AWAITING_APPROVAL)
    approval = Approval(
        job_id=job.id, reason_required="always", expires_at=utcnow() + timedelta(hours=1)
    )
    await store.jobs.insert(job, approval)
    assert await store.jobs.transition(job.id, [JobState.AWAITING_APPROVAL], JobState.CANCELLED)
    assert not await store.approvals.decide(job.id, ApprovalState.APPROVED, by="bob")
    still = await store.approvals.get(job.id)
    assert still is not None and still.state is ApprovalState.PENDING and still.decided_by is None


async def test_expired_approvals_are_found_by_time(store: Store, settings: Settings) -> None:
    now = utcnow()
    soon = make_job(settings, "a", "10.0.0.40", state=JobState.AWAITING_APPROVAL)
    later = make_job(settings, "b", "10.0.0.41", state=JobState.AWAITING_APPROVAL)
    await store.jobs.insert(
        soon, Approval(job_id=soon.id, reason_required="x", expires_at=now + timedelta(minutes=1))
    )
    await store.jobs.insert(
        later, Approval(job_id=later.id, reason_required="x", expires_at=now + timedelta(hours=1))
    )
    assert await store.approvals.expired(now) == []
    assert await store.approvals.expired(now + timedelta(minutes=2)) == [soon.id]


async def test_events_added_together_are_written_together(
    sqlite_store: Store, settings: Settings
) -> None:
    store = sqlite_store
    jobs = [make_job(settings, f"web{i:02d}", f"10.0.0.{50 + i}") for i in range(20)]
    for job in jobs:
        await store.jobs.insert(job)
    statements: list[str] = []
    await store.engine.call(trace, statements.append)  # SQLite's own account, on its thread
    await asyncio.gather(
        *(store.jobs.add_event(JobEvent(job_id=j.id, step="clone", phase="started")) for j in jobs)
    )
    await store.engine.call(trace, None)
    assert statements.count("BEGIN IMMEDIATE") == 1  # one transaction, not 20
    written = [[e.phase for e in await store.jobs.events(j.id)] for j in jobs]
    assert written == [["started"]] * len(jobs)


async def test_an_event_that_cannot_be_written_fails_alone(
    store: Store, settings: Settings
) -> None:
    job = make_job(settings)
    await store.jobs.insert(job)
    good = [JobEvent(job_id=job.id, step="clone", phase=p) for p in ("started", "finished")]
    orphan = JobEvent(job_id="nosuchjob", step="clone", phase="started")
    results = await asyncio.gather(
        store.jobs.add_event(good[0]),
        store.jobs.add_event(orphan),
        store.jobs.add_event(good[1]),
        return_exceptions=True,
    )
    assert results[0] is True and results[2] is True
    assert isinstance(results[1], ConstraintViolation)
    assert [e.phase for e in await store.jobs.events(job.id)] == ["started", "finished"]
    assert await store.jobs.events("nosuchjob") == []


async def test_processes_opening_a_new_database_together_migrate_it_once(
    tmp_path: Path,
) -> None:
    """Four connections (each on its own thread, as four processes would be) race to
    create the same new file: each finds the schema complete, and one installation id."""
    for attempt in range(5):
        path = tmp_path / f"new{attempt}.db"
        stores = await asyncio.gather(*(Store.open(path) for _ in range(4)))
        try:
            assert len({s.installation_id for s in stores}) == 1
            version = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0]
            assert version == SCHEMA_VERSION
        finally:
            for store in stores:
                await store.close()


async def test_v6_closes_approvals_that_cancels_left_pending(
    tmp_path: Path, settings: Settings
) -> None:
    """Before v6 a cancel left the job's approval pending; the migration closes those."""
    from sqlite_utils import Database

    from store.jobs import job_row
    from store.migrations import DESTROY_COLUMNS, LEASE_COLUMNS, MIGRATIONS

    path = tmp_path / "old.db"
    db = Database(sqlite3.connect(path))
    for migration in MIGRATIONS[:5]:
        migration(db)
    db.execute("PRAGMA user_version = 5")
    cancelled = make_job(settings, "web01", "10.0.0.50", state=JobState.CANCELLED)
    waiting = make_job(settings, "web02", "10.0.0.51", state=JobState.AWAITING_APPROVAL)
    for job in (cancelled, waiting):
        later = ("ipam_ref", "ipam_state", *DESTROY_COLUMNS, *LEASE_COLUMNS)  # v8, v9, v10
        later += ("claim_epoch", "kind", "host_key_source", "host_certificate")  # v14-v17
        db.table("jobs").insert({k: v for k, v in job_row(job).items() if k not in later})
        approval = Approval(job_id=job.id, reason_required="x", expires_at=utcnow())
        db.table("approvals").insert(
            {k: str(v) if v is not None else None for k, v in approval.model_dump().items()}
        )
    db.conn.commit()
    db.conn.close()
    store = await Store.open(path)
    try:
        first = await store.approvals.get(cancelled.id)
        second = await store.approvals.get(waiting.id)
        assert first is not None and first.state is ApprovalState.CANCELLED
        assert second is not None and second.state is ApprovalState.PENDING
        assert await store.jobs.quarantine_records() == []
    finally:
        await store.close()


async def test_destroy_states_hold_the_name_and_destroyed_frees_it(
    store: Store, settings: Settings
) -> None:
    """Migration v9 widened the unique indexes: a VM on its way out still holds its
    name and address; once destroyed, both are free."""
    job = await store.jobs.insert(make_job(settings, state=JobState.SUCCEEDED))
    for state in (JobState.DESTROY_REQUESTED, JobState.DESTROYING):
        moved = await store.jobs.transition(
            job.id, [JobState.SUCCEEDED, *TRANSITIONS_TO[state]], state
        )
        assert moved
        with pytest.raises(DuplicateActive):
            await store.jobs.insert(make_job(settings))
    assert await store.jobs.transition(job.id, [JobState.DESTROYING], JobState.DESTROYED)
    again = await store.jobs.insert(make_job(settings))
    assert again.id != job.id


TRANSITIONS_TO = {
    JobState.DESTROY_REQUESTED: [],
    JobState.DESTROYING: [JobState.DESTROY_REQUESTED],
}


async def test_a_destroy_decision_claims_its_delivery_once(
    store: Store, settings: Settings
) -> None:
    job = await store.jobs.insert(make_job(settings, state=JobState.SUCCEEDED))
    ask = [JobState.SUCCEEDED]
    assert await store.jobs.transition_once("click:1", job.id, ask, JobState.DESTROY_REQUESTED)
    with pytest.raises(AlreadyDelivered):  # the same click again: nothing moves
        await store.jobs.transition_once(
            "click:1", job.id, [JobState.DESTROY_REQUESTED], JobState.DESTROYING
        )
    got = await store.jobs.get(job.id)
    assert got is not None and got.state is JobState.DESTROY_REQUESTED
    # A losing compare-and-set keeps no delivery: the key may be used for what it asked.
    assert not await store.jobs.transition_once("click:2", job.id, ask, JobState.DESTROYING)
    assert await store.jobs.delivered("click:2") is None


async def test_live_jobs_are_listed_a_page_at_a_time(store: Store, settings: Settings) -> None:
    for number in range(5):
        await store.jobs.insert(
            make_job(settings, f"web{number}", f"10.0.0.{50 + number}", state=JobState.SUCCEEDED)
        )
    await store.jobs.insert(make_job(settings, "db01", "10.0.0.60", requester="bob"))
    ended = await store.jobs.insert(make_job(settings, "old01", "10.0.0.61", state=JobState.FAILED))
    assert await store.jobs.count_live("alice") == 5 and await store.jobs.count_live(None) == 6
    first = await store.jobs.live("alice", 2, 0)
    assert [j.name for j in first] == ["web4", "web3"]
    assert [j.name for j in await store.jobs.live("alice", 2, 4)] == ["web0"]
    assert ended.id not in {j.id for j in await store.jobs.live(None, 10, 0)}


async def test_the_holder_of_one_address_is_what_the_list_of_held_ones_says(
    store: Store, settings: Settings
) -> None:
    """An admission asks for one address (an indexed lookup); the next free address
    reads them all. Both answer alike: a job in flight holds its address, a failed one
    whose VM a rollback left behind still has it, and a holder wins over such wreckage."""
    left = make_job(settings, "old01", "10.0.0.61", state=JobState.FAILED)
    live = make_job(settings, "web01", "10.0.0.61")
    wreck = make_job(settings, "old02", "10.0.0.62", state=JobState.FAILED)
    gone = make_job(settings, "old03", "10.0.0.63", state=JobState.FAILED)
    for job in (left, live, wreck, gone):
        await store.jobs.insert(job)
    for job in (left, wreck):
        assert await store.jobs.update(job.id, wreckage="VM 101 still exists")
    held = await store.addresses.held()
    assert held["10.0.0.61"] == (live.id, "web01", live.backend, True)
    assert held["10.0.0.62"] == (wreck.id, "old02", wreck.backend, False)
    assert "10.0.0.63" not in held
    for address in ("10.0.0.61", "10.0.0.62", "10.0.0.63", "10.0.0.64"):
        assert await store.addresses.holder(address) == held.get(address)


async def test_a_write_that_kept_a_notice_wakes_the_delivery(
    store: Store, settings: Settings
) -> None:
    """`store.wake.on_notice` is told when a write kept a notice for chat, and only then:
    a job nobody follows in chat (no origin, no approval) gets none kept."""
    woken: list[str] = []
    store.wake.on_notice = lambda: woken.append("woken")
    followed = make_job(settings).model_copy(update={"origin": "C1/1.0"})
    followed = await store.jobs.insert(followed, announce=True)
    assert woken == ["woken"]
    note = Notice(job_id=followed.id, kind=NoticeKind.NOTE, text="hello")
    assert not await store.jobs.transition(
        followed.id, [JobState.SUCCEEDED], JobState.DESTROYING, notices=[note]
    )
    assert await store.jobs.transition(followed.id, [JobState.QUEUED], JobState.RUNNING)
    assert woken == ["woken"]  # nothing moved with a notice, nothing kept without one
    assert await store.jobs.add_event(
        JobEvent(job_id=followed.id, step="clone", phase="started"), note
    )
    assert woken == ["woken", "woken"]
    unfollowed = await store.jobs.insert(make_job(settings, "web02", "10.0.0.51"), announce=True)
    assert woken == ["woken", "woken"]
    other = note.model_copy(update={"job_id": unfollowed.id})
    assert await store.jobs.update(unfollowed.id, notices=[other], error="kept for nobody")
    assert woken == ["woken", "woken"]


async def test_claiming_no_deliveries_writes_nothing(sqlite_store: Store) -> None:
    """A Slack poll with nothing new claims no jobs: it must not take the file's write
    lock (BEGIN IMMEDIATE) every poll, as store/access's outbox_claim never did."""
    statements: list[str] = []
    now = utcnow()
    await sqlite_store.engine.call(trace, statements.append)
    won = await sqlite_store.outbox.claim([], "me", now, now + timedelta(seconds=30))
    await sqlite_store.engine.call(trace, None)
    assert won == set()
    assert not [s for s in statements if s.startswith(("BEGIN", "INSERT"))]


async def test_v16_keeps_old_fingerprints_and_adds_how_a_key_was_confirmed(
    tmp_path: Path, settings: Settings
) -> None:
    """A v15 database's job with a fingerprint in host_key reads back without a source
    (shown as before); a new job keeps the public key line and how it was confirmed."""
    from sqlite_utils import Database

    from store.jobs import job_row
    from store.migrations import MIGRATIONS

    path = tmp_path / "old.db"
    db = Database(sqlite3.connect(path))
    for migration in MIGRATIONS[:15]:
        migration(db)
    db.execute("PRAGMA user_version = 15")
    old = make_job(settings, "web01", "10.0.0.50", state=JobState.SUCCEEDED)
    old = old.model_copy(update={"host_key": "SHA256:abc"})
    row = {
        k: v for k, v in job_row(old).items() if k not in ("host_key_source", "host_certificate")
    }
    db.table("jobs").insert(row)
    db.conn.commit()
    db.conn.close()
    store = await Store.open(path)
    try:
        got = await store.jobs.get(old.id)
        new = make_job(settings, "web02", "10.0.0.51", state=JobState.SUCCEEDED)
        new = new.model_copy(
            update={"host_key": "ssh-ed25519 AAAAC3", "host_key_source": HostKeySource.CHOSEN}
        )
        await store.jobs.insert(new)
        got_new = await store.jobs.get(new.id)
    finally:
        await store.close()
    assert got is not None and got.host_key == "SHA256:abc" and got.host_key_source is None
    assert got.known_hosts_line is None
    assert got_new is not None and got_new.host_key_source is HostKeySource.CHOSEN
    assert got_new.known_hosts_line == "web02,10.0.0.51 ssh-ed25519 AAAAC3"


async def test_v17_adds_the_host_certificate(tmp_path: Path, settings: Settings) -> None:
    """A v16 database's jobs read back without a certificate; a new job keeps its line."""
    from sqlite_utils import Database

    from store.jobs import job_row
    from store.migrations import MIGRATIONS

    path = tmp_path / "old.db"
    db = Database(sqlite3.connect(path))
    for migration in MIGRATIONS[:16]:
        migration(db)
    db.execute("PRAGMA user_version = 16")
    old = make_job(settings, "web01", "10.0.0.50", state=JobState.SUCCEEDED)
    db.table("jobs").insert({k: v for k, v in job_row(old).items() if k != "host_certificate"})
    db.conn.commit()
    db.conn.close()
    cert = "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQ"
    store = await Store.open(path)
    try:
        got = await store.jobs.get(old.id)
        new = make_job(settings, "web02", "10.0.0.51", state=JobState.SUCCEEDED)
        await store.jobs.insert(new.model_copy(update={"host_certificate": cert}))
        got_new = await store.jobs.get(new.id)
        assert await store.jobs.quarantine_records() == []
    finally:
        await store.close()
    assert got is not None and got.host_certificate is None
    assert got_new is not None and got_new.host_certificate == cert
