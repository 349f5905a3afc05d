"""The job history database: one SQLite file in WAL mode, owned by one worker thread.

SQLite calls block, and the bot is one event loop serving many deploys; so every call
runs on a single dedicated thread that owns the connection. One thread also means this
process never contends with itself for the write lock; other processes on the same file
(a CLI next to the server) are handled by SQLite's busy timeout and BEGIN IMMEDIATE.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlite_utils import Database

from bot.models import (
    Approval,
    ApprovalState,
    AuditEvent,
    Job,
    JobEvent,
    JobState,
    Notice,
    UserPrefs,
    utcnow,
)
from store import approvals, durations, gc, jobs, outbox, owners, quarantine, users
from store.jobs import AlreadyDelivered, DuplicateActive
from store.migrations import migrate
from store.quarantine import Quarantined, RowUnreadable
from store.writer import Writer

__all__ = ["AlreadyDelivered", "DuplicateActive", "Quarantined", "RowUnreadable", "Store"]

P = ParamSpec("P")
T = TypeVar("T")
BUSY_TIMEOUT_MS = 10_000


def _connect(path: Path) -> Database:
    if str(path) != ":memory:":
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created 0600 before SQLite opens it: the history names people and machines.
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
    conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    # Text that is not UTF-8 (written by another tool) would fail the whole query that
    # meets it; decoded with replacement characters, its row fails validation instead and
    # is quarantined alone (store/quarantine.py).
    conn.text_factory = _decode
    db = Database(conn)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA foreign_keys = ON")
    db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    db.execute("PRAGMA synchronous = NORMAL")
    migrate(db)
    return db


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class Store:
    """Async access to the history. Open with `await Store.open(path)`, close when done."""

    def __init__(
        self, path: Path, executor: ThreadPoolExecutor, db: Database, installation_id: str
    ) -> None:
        self.path = path
        # Made with the database and never changed: VM tags carry it (store/migrations).
        self.installation_id = installation_id
        self._executor = executor
        self._db = db
        self._writer = Writer(executor, db.conn)
        # Set by a front end that delivers the outbox: told when this process kept a
        # notice, so it need not wait for its next look to deliver it.
        self.on_notice: Callable[[], None] | None = None

    @classmethod
    async def open(cls, path: str | Path) -> Store:
        path = Path(path)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deploybot-store")
        loop = asyncio.get_running_loop()
        try:
            db = await loop.run_in_executor(executor, _connect, path)
            installation = await loop.run_in_executor(executor, owners.installation_id, db)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(path, executor, db, installation)

    async def close(self) -> None:
        await self._writer.close()
        await self._call(self._db.conn.close)
        self._executor.shutdown(wait=True)

    async def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Reads, and writes that are rare: on the store's thread, alone."""
        return await self._writer.call(fn, *args, **kwargs)

    async def _write(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """The writes every deploy makes: batched with those made at the same moment
        (store/writer.py)."""
        return await self._writer.write(fn, *args, **kwargs)

    # --- jobs ---------------------------------------------------------------------

    async def insert_job(
        self,
        job: Job,
        approval: Approval | None = None,
        *,
        dedupe_key: str | None = None,
        announce: bool = False,
    ) -> Job:
        """Raises `DuplicateActive` when a job in flight holds the name or the address,
        `AlreadyDelivered` when `dedupe_key` was used before (then nothing is written).
        Returns the job as stored: with a fresh id if its random one was taken. With
        `announce`, chat is told of the new job (a notice in the same transaction)."""
        stored = await self._write(jobs.insert_job, self._db, job, approval, dedupe_key, announce)
        self._noticed(announce)
        return stored

    async def delivered(self, dedupe_key: str) -> str | None:
        """The job a dedupe key was used for, or None when it is new."""
        return await self._call(jobs.delivered, self._db, dedupe_key)

    async def holder(self, *, backend: str, name: str, address: str) -> Job | None:
        return await self._call(jobs.holder, self._db, backend=backend, name=name, address=address)

    async def get_job(self, job_id: str) -> Job | None:
        """None when there is no such job or it is quarantined (see `quarantined`)."""
        return await self._call(jobs.get_job, self._db, job_id)

    async def match_ids(self, prefix: str, limit: int = 10) -> list[tuple[str, str, str]]:
        """(id, name, state) of jobs whose id starts with `prefix`; an exact match first."""
        return await self._call(jobs.match_ids, self._db, prefix, limit)

    async def quarantined(self, job_id: str) -> Quarantined | None:
        """Why this job was set aside, or None when it was not."""
        return await self._call(quarantine.find, self._db, job_id)

    async def quarantine_records(self, limit: int = 100) -> list[Quarantined]:
        """Every row set aside, newest first."""
        return await self._call(quarantine.records, self._db, limit)

    async def transition(
        self,
        job_id: str,
        expected: Iterable[JobState],
        new: JobState,
        *,
        held_by: str | None = None,
        notices: Sequence[Notice] = (),
        **fields: Any,
    ) -> bool:
        """Compare-and-set; with `held_by`, only while that runner owns the job. The
        `notices` are kept in the same transaction, and only if the job moved."""
        moved = await self._write(
            jobs.transition, self._db, job_id, tuple(expected), new, held_by, notices, **fields
        )
        self._noticed(moved and bool(notices))
        return moved

    async def move(
        self,
        job_id: str,
        expected: Iterable[JobState],
        new: JobState,
        *,
        held_by: str | None = None,
        notices: Sequence[Notice] = (),
        **fields: Any,
    ) -> tuple[bool, Job | None]:
        """`transition` answering (moved, the job as it now is) in one round trip."""
        moved, job = await self._write(
            jobs.move, self._db, job_id, tuple(expected), new, held_by, notices, **fields
        )
        self._noticed(moved and bool(notices))
        return moved, job

    async def update_job(self, job_id: str, *, held_by: str | None = None, **fields: Any) -> bool:
        return await self._write(jobs.update_job, self._db, job_id, held_by, **fields)

    # --- runners and leases (store/owners.py) ----------------------------------------

    async def register_runner(self, runner: owners.RunnerRow) -> None:
        await self._call(owners.register, self._db, runner)

    async def renew(self, runner_id: str, now: datetime, until: datetime) -> list[owners.Owned]:
        return await self._call(owners.renew, self._db, runner_id, now, until)

    async def claim(
        self,
        job_id: str,
        runner_id: str,
        now: datetime,
        until: datetime,
        states: Iterable[JobState] = (JobState.QUEUED,),
    ) -> bool:
        return await self._call(
            owners.claim, self._db, job_id, runner_id, now, until, tuple(states)
        )

    async def claimable(self, now: datetime, limit: int) -> list[tuple[str, str]]:
        return await self._write(owners.claimable, self._db, now, limit)

    async def abandoned(self, now: datetime) -> list[Job]:
        return await self._call(owners.abandoned, self._db, now)

    async def release_runner(self, runner_id: str, now: datetime) -> int:
        return await self._call(owners.release, self._db, runner_id, now)

    async def live_runners_on(self, host: str, now: datetime) -> list[tuple[str, int, str]]:
        return await self._call(owners.live_on_host, self._db, host, now)

    async def declare_dead(self, runner_id: str, now: datetime) -> None:
        await self._call(owners.declare_dead, self._db, runner_id, now)

    async def request_cancel(self, job_id: str, by: str) -> bool:
        return await self._call(owners.request_cancel, self._db, job_id, by)

    async def add_event(self, event: JobEvent, notice: Notice | None = None) -> None:
        """Returns once the event is committed; events of deploys that end a step in the
        same moment share a transaction (store/writer.py)."""
        await self._write(jobs.add_event, self._db, event, notice)
        self._noticed(notice is not None)

    async def events(self, job_id: str) -> list[JobEvent]:
        return await self._call(jobs.events, self._db, job_id)

    async def step_durations(
        self, backend: str, steps: Sequence[str], limit: int
    ) -> list[durations.StepRow]:
        return await self._call(durations.step_durations, self._db, backend, steps, limit)

    async def history(
        self,
        *,
        requester: str | None = None,
        state: JobState | None = None,
        name: str | None = None,
        address: str | None = None,
        since: datetime | None = None,
        limit: int = 10,
    ) -> list[Job]:
        return await self._call(
            jobs.history,
            self._db,
            requester=requester,
            state=state,
            name=name,
            address=address,
            since=since,
            limit=limit,
        )

    async def jobs_with_wreckage(self) -> list[Job]:
        return await self._call(jobs.jobs_with_wreckage, self._db)

    async def jobs_in(self, states: Iterable[JobState]) -> list[Job]:
        return await self._call(jobs.jobs_in, self._db, tuple(states))

    # --- approvals ----------------------------------------------------------------

    async def get_approval(self, job_id: str) -> Approval | None:
        return await self._call(approvals.get_approval, self._db, job_id)

    async def decide(
        self,
        job_id: str,
        decision: ApprovalState,
        *,
        by: str | None,
        note: str | None = None,
        at: datetime | None = None,
        dedupe_key: str | None = None,
        notices: Sequence[Notice] = (),
    ) -> bool:
        decided = await self._write(
            approvals.decide,
            self._db,
            job_id,
            decision,
            by=by,
            note=note,
            at=at,
            dedupe_key=dedupe_key,
            notices=notices,
        )
        self._noticed(decided and bool(notices))
        return decided

    async def expired_approvals(self, now: datetime) -> list[str]:
        return await self._call(approvals.expired_approvals, self._db, now)

    async def cancel_awaiting(
        self, job_id: str, *, by: str, notices: Sequence[Notice] = ()
    ) -> bool:
        """Cancel a job awaiting approval and close its approval in one transaction."""
        cancelled = await self._write(
            approvals.cancel_awaiting, self._db, job_id, by=by, at=utcnow(), notices=notices
        )
        self._noticed(cancelled and bool(notices))
        return cancelled

    # --- the outbox (store/outbox.py) -------------------------------------------------

    def _noticed(self, written: bool) -> None:
        if written and self.on_notice is not None:
            self.on_notice()

    async def outbox_new_since(self, after: int, limit: int) -> list[Notice]:
        return await self._call(outbox.new_since, self._db, after, limit)

    async def outbox_undelivered(self, job_id: str) -> list[Notice]:
        return await self._call(outbox.undelivered, self._db, job_id)

    async def outbox_claim(
        self, job_ids: Sequence[str], me: str, now: datetime, until: datetime
    ) -> set[str]:
        if not job_ids:
            return set()
        return await self._write(outbox.claim, self._db, list(job_ids), me, now, until)

    async def outbox_renew(self, me: str, until: datetime) -> None:
        await self._call(outbox.renew, self._db, me, until)

    async def outbox_orphaned(self, now: datetime, limit: int) -> list[str]:
        return await self._call(outbox.orphaned, self._db, now, limit)

    async def outbox_mark_delivered(self, ids: Sequence[int], now: datetime) -> None:
        await self._write(outbox.mark_delivered, self._db, list(ids), now)

    async def outbox_release(self, job_id: str, me: str, now: datetime) -> None:
        await self._write(outbox.release, self._db, job_id, me, now)

    async def outbox_pending(self) -> int:
        return await self._call(outbox.pending_count, self._db)

    # --- gc runs ------------------------------------------------------------------

    async def record_gc_run(
        self, scope: Sequence[str], vm_keys: Sequence[str], *, applied: bool
    ) -> None:
        await self._call(gc.record_gc_run, self._db, scope, vm_keys, applied)

    async def last_gc_dry_run(self, scope: Sequence[str], *, since: datetime) -> set[str] | None:
        return await self._call(gc.last_gc_dry_run, self._db, scope, since)

    # --- people -------------------------------------------------------------------

    async def get_prefs(self, user: str) -> UserPrefs:
        return await self._call(users.get_prefs, self._db, user)

    async def put_prefs(self, prefs: UserPrefs) -> None:
        await self._call(users.put_prefs, self._db, prefs)

    async def add_ssh_key(self, user: str, key: str, max_keys: int) -> UserPrefs | None:
        return await self._call(users.add_key, self._db, user, key, max_keys)

    async def add_audit(self, event: AuditEvent) -> None:
        await self._write(users.add_audit, self._db, event)

    async def audit_events(self, limit: int = 50) -> list[AuditEvent]:
        """Newest first."""
        return await self._call(users.audit_events, self._db, limit)

    async def integrity_check(self) -> str:
        return await self._call(
            lambda: str(self._db.execute("PRAGMA integrity_check").fetchone()[0])
        )
