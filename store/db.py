"""The job history: one `Store` on either database.

SQLite is the default: one file, nothing to run (store/engine.py). For several replicas
deploybot uses PostgreSQL (store/postgres/). Both run the same store functions
(store/jobs.py, owners.py ...), so the same compare-and-sets decide the same races.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from bot.models import (
    Approval,
    ApprovalState,
    AuditEvent,
    IpamState,
    Job,
    JobEvent,
    JobState,
    Notice,
    Received,
    UserPrefs,
    utcnow,
)
from store import (
    addresses,
    approvals,
    builds,
    destroys,
    durations,
    gc,
    inbox,
    jobs,
    leases,
    outbox,
    owners,
    quarantine,
    quotas,
    users,
)
from store.engine import Engine, SqliteEngine
from store.jobs import AlreadyDelivered, DuplicateActive
from store.quarantine import Quarantined, RowUnreadable
from store.sql import Db

__all__ = ["AlreadyDelivered", "DuplicateActive", "Quarantined", "RowUnreadable", "Store"]

P = ParamSpec("P")
T = TypeVar("T")
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(database: str | Path) -> bool:
    return isinstance(database, str) and database.startswith(POSTGRES_SCHEMES)


class Store:
    """Async access to the history. Open with `await Store.open(database)`, close when done."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.label = engine.label
        # Made with the database and never changed: VM tags carry it (store/migrations).
        self.installation_id = engine.installation_id
        # Set by a front end that delivers the outbox: told when this process kept a
        # notice, so it need not wait for its next look to deliver it.
        self.on_notice: Callable[[], None] | None = None
        # Template builds (store/builds.py); their notices wake the delivery too.
        self.builds = builds.BuildRecords(engine, self._noticed)

    @classmethod
    async def open(cls, database: str | Path, *, password: str | None = None) -> Store:
        """A path (or ":memory:") opens SQLite; a postgresql:// URL opens PostgreSQL, with
        `password` (from the environment: never in the URL, the config or a log)."""
        if is_postgres(database):
            from store.postgres import PostgresEngine  # psycopg only when it is used

            return cls(await PostgresEngine.open(str(database), password=password))
        return cls(await SqliteEngine.open(Path(database)))

    async def close(self) -> None:
        await self.engine.close()

    async def _call(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Reads, and writes that are rare."""
        return await self.engine.call(fn, *args, **kwargs)

    async def _write(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """The writes every deploy makes: batched with those made at the same moment
        where the engine can (store/writer.py)."""
        return await self.engine.write(fn, *args, **kwargs)

    # --- jobs ---------------------------------------------------------------------

    async def insert_job(
        self,
        job: Job,
        approval: Approval | None = None,
        *,
        dedupe_key: str | None = None,
        announce: bool = False,
        caps: Sequence[quotas.Cap] = (),
    ) -> Job:
        """Raises `DuplicateActive` when a job in flight holds the name or the address,
        `AlreadyDelivered` when `dedupe_key` was used before (then nothing is written),
        `quotas.OverQuota` when it does not fit one of `caps` (checked in the insert's
        transaction). Returns the job as stored: with a fresh id if its random one was
        taken. With `announce`, chat is told of the new job (a notice in the same
        transaction)."""
        stored = await self._write(jobs.insert_job, job, approval, dedupe_key, announce, caps)
        self._noticed(announce)
        return stored

    async def delivered(self, dedupe_key: str) -> str | None:
        """The job a dedupe key was used for, or None when it is new."""
        return await self._call(jobs.delivered, dedupe_key)

    async def holder(self, *, backend: str, name: str, address: str) -> Job | None:
        return await self._call(jobs.holder, backend=backend, name=name, address=address)

    async def get_job(self, job_id: str) -> Job | None:
        """None when there is no such job or it is quarantined (see `quarantined`)."""
        return await self._call(jobs.get_job, job_id)

    async def match_ids(self, prefix: str, limit: int = 10) -> list[tuple[str, str, str]]:
        """(id, name, state) of jobs whose id starts with `prefix`; an exact match first."""
        return await self._call(jobs.match_ids, prefix, limit)

    async def quarantined(self, job_id: str) -> Quarantined | None:
        """Why this job was set aside, or None when it was not."""
        return await self._call(quarantine.find, job_id)

    async def quarantine_records(self, limit: int = 100) -> list[Quarantined]:
        """Every row set aside, newest first."""
        return await self._call(quarantine.records, limit)

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
            jobs.transition, job_id, tuple(expected), new, held_by, notices, **fields
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
            jobs.move, job_id, tuple(expected), new, held_by, notices, **fields
        )
        self._noticed(moved and bool(notices))
        return moved, job

    async def update_job(self, job_id: str, *, held_by: str | None = None, **fields: Any) -> bool:
        return await self._write(jobs.update_job, job_id, held_by, **fields)

    # --- runners and leases (store/owners.py) ----------------------------------------

    async def register_runner(self, runner: owners.RunnerRow) -> None:
        await self._call(owners.register, runner)

    async def renew(self, runner_id: str, now: datetime, until: datetime) -> list[owners.Owned]:
        return await self._call(owners.renew, runner_id, now, until)

    async def claim(
        self,
        job_id: str,
        runner_id: str,
        now: datetime,
        until: datetime,
        states: Iterable[JobState] = (JobState.QUEUED,),
    ) -> bool:
        return await self._call(owners.claim, job_id, runner_id, now, until, tuple(states))

    async def claim_queued(
        self, runner_id: str, now: datetime, until: datetime, limit: int
    ) -> list[tuple[str, str]]:
        """Claim up to `limit` unheld queued jobs for this runner: (id, backend) of each."""
        return await self._write(owners.claim_queued, runner_id, now, until, limit)

    async def abandoned(self, now: datetime) -> list[Job]:
        return await self._call(owners.abandoned, now)

    async def release_runner(self, runner_id: str, now: datetime) -> int:
        return await self._call(owners.release, runner_id, now)

    async def live_runners_on(self, host: str, now: datetime) -> list[tuple[str, int, str]]:
        return await self._call(owners.live_on_host, host, now)

    async def declare_dead(self, runner_id: str, now: datetime) -> None:
        await self._call(owners.declare_dead, runner_id, now)

    async def request_cancel(self, job_id: str, by: str) -> bool:
        return await self._call(owners.request_cancel, job_id, by)

    async def add_event(self, event: JobEvent, notice: Notice | None = None) -> None:
        """Returns once the event is committed; events of deploys that end a step in the
        same moment share a transaction (store/writer.py)."""
        await self._write(jobs.add_event, event, notice)
        self._noticed(notice is not None)

    async def events(self, job_id: str) -> list[JobEvent]:
        return await self._call(jobs.events, job_id)

    async def step_durations(
        self, backend: str, steps: Sequence[str], limit: int
    ) -> list[durations.StepRow]:
        return await self._call(durations.step_durations, backend, steps, limit)

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
            requester=requester,
            state=state,
            name=name,
            address=address,
            since=since,
            limit=limit,
        )

    async def count_by_state(self) -> dict[str, int]:
        return await self._call(jobs.count_by_state)

    async def jobs_with_wreckage(self) -> list[Job]:
        return await self._call(jobs.jobs_with_wreckage)

    async def jobs_in(self, states: Iterable[JobState]) -> list[Job]:
        return await self._call(jobs.jobs_in, tuple(states))

    async def live_jobs(self, requester: str | None, limit: int, offset: int = 0) -> list[Job]:
        """Jobs that hold their VM (store/destroys.py), newest first: one page."""
        return await self._call(destroys.live, requester, limit, offset)

    async def count_live(self, requester: str | None) -> int:
        return await self._call(destroys.count_live, requester)

    async def quota_usage(self, members: Iterable[str]) -> quotas.Usage:
        """What the jobs of these requesters hold now (store/quotas.py)."""
        return await self._call(quotas.usage, frozenset(members))

    # --- leases (store/leases.py) ------------------------------------------------------

    async def lease_watched(self) -> list[Job]:
        """Ready jobs with a lease, and powered-off ones: what the lease timer looks at."""
        return await self._call(leases.watched)

    async def lease_write(
        self,
        step: str,
        job: Job,
        value: str | datetime,
        notices: Sequence[Notice],
        audit: AuditEvent,
        dedupe_key: str | None = None,
    ) -> Job | None:
        """One lease step as a compare-and-set against `job` as read (store/leases.write)."""
        done = await self._call(leases.write, step, job, value, notices, audit, dedupe_key)
        self._noticed(done is not None and bool(notices))
        return done

    async def transition_once(
        self,
        dedupe_key: str | None,
        job_id: str,
        expected: Iterable[JobState],
        new: JobState,
        *,
        notices: Sequence[Notice] = (),
        **fields: Any,
    ) -> bool:
        """A compare-and-set that claims a chat delivery with it (a destroy's decision):
        raises `AlreadyDelivered` for a key seen before."""
        moved = await self._write(
            destroys.transition_once, dedupe_key, job_id, tuple(expected), new, notices, **fields
        )
        self._noticed(moved and bool(notices))
        return moved

    # --- addresses (bot/addressing.py) ---------------------------------------------

    async def held_addresses(self) -> dict[str, tuple[str, str, str, bool]]:
        """address -> (job id, VM name, backend, holding) of each job holding its
        address, or whose VM a rollback left behind (holding False)."""
        return await self._call(addresses.held)

    async def unreleased_addresses(self) -> list[Job]:
        return await self._call(addresses.unreleased)

    async def set_ipam_state(self, job_id: str, expected: list[IpamState], new: IpamState) -> bool:
        return await self._call(addresses.set_ipam_state, job_id, expected, new)

    async def job_states(self, job_ids: list[str]) -> dict[str, JobState]:
        return await self._call(addresses.known_ids, job_ids)

    # --- approvals ----------------------------------------------------------------

    async def get_approval(self, job_id: str) -> Approval | None:
        return await self._call(approvals.get_approval, job_id)

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
        return await self._call(approvals.expired_approvals, now)

    async def cancel_awaiting(
        self, job_id: str, *, by: str, notices: Sequence[Notice] = ()
    ) -> bool:
        """Cancel a job awaiting approval and close its approval in one transaction."""
        cancelled = await self._write(
            approvals.cancel_awaiting, job_id, by=by, at=utcnow(), notices=notices
        )
        self._noticed(cancelled and bool(notices))
        return cancelled

    # --- the outbox (store/outbox.py) -------------------------------------------------

    def _noticed(self, written: bool) -> None:
        if written and self.on_notice is not None:
            self.on_notice()

    async def outbox_new_since(self, after: int, limit: int) -> list[Notice]:
        return await self._call(outbox.new_since, after, limit)

    async def outbox_undelivered(self, job_id: str) -> list[Notice]:
        return await self._call(outbox.undelivered, job_id)

    async def outbox_claim(
        self, job_ids: Sequence[str], me: str, now: datetime, until: datetime
    ) -> set[str]:
        if not job_ids:
            return set()
        return await self._write(outbox.claim, list(job_ids), me, now, until)

    async def outbox_renew(self, me: str, until: datetime) -> None:
        await self._call(outbox.renew, me, until)

    async def outbox_orphaned(self, now: datetime, limit: int) -> list[str]:
        return await self._call(outbox.orphaned, now, limit)

    async def outbox_mark_delivered(self, ids: Sequence[int], now: datetime) -> None:
        await self._write(outbox.mark_delivered, list(ids), now)

    async def outbox_release(self, job_id: str, me: str, now: datetime) -> None:
        await self._write(outbox.release, job_id, me, now)

    async def outbox_pending(self) -> int:
        return await self._call(outbox.pending_count)

    # --- the inbox (store/inbox.py) ---------------------------------------------------

    async def inbox_add(self, item: Received, me: str, until: datetime) -> bool:
        return await self._write(inbox.add, item, me, until)

    async def inbox_done(self, key: str, now: datetime) -> None:
        await self._write(inbox.done, key, now)

    async def inbox_claim_orphaned(
        self, me: str, now: datetime, until: datetime, limit: int
    ) -> list[Received]:
        return await self._write(inbox.claim_orphaned, me, now, until, limit)

    # --- gc runs ------------------------------------------------------------------

    async def record_gc_run(
        self, scope: Sequence[str], vm_keys: Sequence[str], *, applied: bool
    ) -> None:
        await self._call(gc.record_gc_run, scope, vm_keys, applied)

    async def last_gc_dry_run(self, scope: Sequence[str], *, since: datetime) -> set[str] | None:
        return await self._call(gc.last_gc_dry_run, scope, since)

    # --- people -------------------------------------------------------------------

    async def get_prefs(self, user: str) -> UserPrefs:
        return await self._call(users.get_prefs, user)

    async def put_prefs(self, prefs: UserPrefs) -> None:
        await self._call(users.put_prefs, prefs)

    async def add_ssh_key(self, user: str, key: str, max_keys: int) -> UserPrefs | None:
        return await self._call(users.add_key, user, key, max_keys)

    async def add_audit(self, event: AuditEvent) -> None:
        await self._write(users.add_audit, event)

    async def audit_events(self, limit: int = 50) -> list[AuditEvent]:
        """Newest first."""
        return await self._call(users.audit_events, limit)

    async def integrity_check(self) -> str:
        return await self.engine.integrity_check()
