"""Jobs, their events and approvals as rows. Plain functions on a sqlite-utils Database.

State changes are compare-and-set: an UPDATE that names the state it expects, so of two
actors racing (two approvers, a cancel and a finishing worker) exactly one wins and the
other is told so. These functions run on the store's worker thread (store/db.py).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel
from sqlite_utils import Database

from bot.models import (
    HOLDING_STATES,
    TRANSITIONS,
    Approval,
    ApprovalState,
    Job,
    JobEvent,
    JobState,
    utcnow,
)
from store.tx import immediate

# Columns a transition may set besides state and updated_at.
_JOB_FIELDS = frozenset(Job.model_fields) - {"id", "state", "request", "created_at", "updated_at"}


class DuplicateActive(Exception):
    """Another job in flight already holds this name (on this backend) or this address."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def ts(moment: datetime) -> str:
    """One fixed-width UTC format, so text order is time order in every query."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _sql_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return ts(value)
    if isinstance(value, Enum):
        return value.value
    return value


def _row(model: BaseModel) -> dict[str, Any]:
    return {k: _sql_value(v) for k, v in model.model_dump(mode="python").items()}


def job_row(job: Job) -> dict[str, Any]:
    row = _row(job)
    row["request"] = json.dumps(job.request.model_dump(mode="json"), sort_keys=True)
    return row


def job_from_row(row: dict[str, Any]) -> Job:
    return Job.model_validate({**row, "request": json.loads(row["request"])})


class AlreadyDelivered(Exception):
    """This dedupe key was handled before (for `job_id`); the transaction did nothing."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


def _claim(db: Database, key: str, job_id: str, action: str) -> None:
    """Record a delivery inside the caller's transaction; raise if it was seen before.

    The primary key decides, not a lookup first: two deliveries racing cannot both pass.
    """
    try:
        db.execute(
            "INSERT INTO deliveries (key, job_id, action, at) VALUES (?, ?, ?, ?)",
            [key, job_id, action, ts(utcnow())],
        )
    except sqlite3.IntegrityError:
        rows = list(db.query("SELECT job_id FROM deliveries WHERE key = ?", [key]))
        raise AlreadyDelivered(rows[0]["job_id"] if rows else job_id) from None


def delivered(db: Database, key: str) -> str | None:
    rows = list(db.query("SELECT job_id FROM deliveries WHERE key = ?", [key]))
    return str(rows[0]["job_id"]) if rows else None


def insert_job(
    db: Database, job: Job, approval: Approval | None = None, dedupe_key: str | None = None
) -> None:
    with immediate(db.conn):
        if dedupe_key is not None:
            _claim(db, dedupe_key, job.id, "request")
        try:
            db.table("jobs").insert(job_row(job))
        except sqlite3.IntegrityError as exc:
            text = str(exc)
            if "jobs.address" in text:
                raise DuplicateActive("address") from None
            if "jobs.backend" in text or "jobs.name" in text:
                raise DuplicateActive("name") from None
            raise
        if approval is not None:
            db.table("approvals").insert(_row(approval))


def holder(db: Database, *, backend: str, name: str, address: str) -> Job | None:
    """The job that holds this name on this backend, or this address (see HOLDING_STATES)."""
    marks = ", ".join(f"'{s.value}'" for s in HOLDING_STATES)
    rows = list(
        db.query(
            f"SELECT * FROM jobs WHERE state IN ({marks}) "
            "AND ((backend = ? AND name = ?) OR address = ?) LIMIT 1",
            [backend, name, address],
        )
    )
    return job_from_row(rows[0]) if rows else None


def get_job(db: Database, job_id: str) -> Job | None:
    rows = list(db.query("SELECT * FROM jobs WHERE id = ?", [job_id]))
    return job_from_row(rows[0]) if rows else None


def transition(
    db: Database,
    job_id: str,
    expected: Iterable[JobState],
    new: JobState,
    held_by: str | None = None,
    **fields: Any,
) -> bool:
    """Move a job from one of `expected` to `new`; False when it was not in those states
    (or, with `held_by`, when that runner no longer owns it: a runner whose lease lapsed
    and whose job was taken over must not write over the new owner's work)."""
    expected = tuple(expected)
    for state in expected:
        if new not in TRANSITIONS.get(state, frozenset()):
            raise ValueError(f"{state.value} -> {new.value} is not a job transition")
    unknown = set(fields) - _JOB_FIELDS
    if unknown:
        raise ValueError(f"not job columns: {sorted(unknown)}")
    values = {k: _sql_value(v) for k, v in fields.items()}
    sets = "".join(f", {column} = :{column}" for column in values)
    marks = ", ".join(f":s{i}" for i in range(len(expected)))
    params = {**values, "new": new.value, "now": ts(utcnow()), "id": job_id}
    params.update({f"s{i}": state.value for i, state in enumerate(expected)})
    fence = ""
    if held_by is not None:
        fence = " AND owner = :held_by"
        params["held_by"] = held_by
    sql = (
        f"UPDATE jobs SET state = :new, updated_at = :now{sets} "
        f"WHERE id = :id AND state IN ({marks}){fence}"
    )
    with immediate(db.conn):
        cursor = db.execute(sql, params)
    return cursor.rowcount == 1


def update_job(db: Database, job_id: str, held_by: str | None = None, **fields: Any) -> bool:
    """Set columns without a state change (the VM's durable id, the wreckage list);
    with `held_by`, only while that runner owns the job. False when nothing changed."""
    unknown = set(fields) - _JOB_FIELDS
    if unknown:
        raise ValueError(f"not job columns: {sorted(unknown)}")
    values = {k: _sql_value(v) for k, v in fields.items()}
    values["updated_at"] = ts(utcnow())
    sets = ", ".join(f"{column} = :{column}" for column in values)
    fence = " AND owner = :held_by" if held_by is not None else ""
    with immediate(db.conn):
        cursor = db.execute(
            f"UPDATE jobs SET {sets} WHERE id = :id{fence}",
            {**values, "id": job_id, "held_by": held_by},
        )
    return cursor.rowcount == 1


def add_event(db: Database, event: JobEvent) -> None:
    with immediate(db.conn):
        db.table("job_events").insert(_row(event))


def add_events(db: Database, events: list[JobEvent]) -> list[Exception | None]:
    """Write several events in one transaction; what went wrong with each (None: it was
    written). One that cannot be written (its job is gone) must not lose the others, so
    a failed batch is written again one by one."""
    try:
        with immediate(db.conn):
            db.table("job_events").insert_all(_row(e) for e in events)
    except Exception:  # whichever one it was, it fails alone below
        pass
    else:
        return [None] * len(events)
    failures: list[Exception | None] = []
    for event in events:
        try:
            add_event(db, event)
        except Exception as exc:  # handed to that event's caller
            failures.append(exc)
        else:
            failures.append(None)
    return failures


def events(db: Database, job_id: str) -> list[JobEvent]:
    rows = db.query(
        "SELECT job_id, at, step, phase, duration_s, detail FROM job_events "
        "WHERE job_id = ? ORDER BY id",
        [job_id],
    )
    return [JobEvent.model_validate(row) for row in rows]


def history(
    db: Database,
    *,
    requester: str | None = None,
    state: JobState | None = None,
    name: str | None = None,
    address: str | None = None,
    since: datetime | None = None,
    limit: int = 10,
) -> list[Job]:
    """Newest first. Each filter is served by an index on (column, created_at)."""
    where: list[str] = []
    params: dict[str, Any] = {"limit": limit}
    for column, value in (("requester", requester), ("name", name), ("address", address)):
        if value is not None:
            where.append(f"{column} = :{column}")
            params[column] = value
    if state is not None:
        where.append("state = :state")
        params["state"] = state.value
    if since is not None:
        where.append("created_at >= :since")
        params["since"] = ts(since)
    clause = f"WHERE {' AND '.join(where)} " if where else ""
    sql = f"SELECT * FROM jobs {clause}ORDER BY created_at DESC, rowid DESC LIMIT :limit"
    return [job_from_row(row) for row in db.query(sql, params)]


def jobs_with_wreckage(db: Database) -> list[Job]:
    """Finished jobs whose rollback left a VM behind (oldest first)."""
    sql = "SELECT * FROM jobs WHERE wreckage IS NOT NULL ORDER BY created_at, rowid"
    return [job_from_row(row) for row in db.query(sql)]


def jobs_in(db: Database, states: Iterable[JobState]) -> list[Job]:
    """Oldest first, so a restart re-queues in the order people asked."""
    values = [s.value for s in states]
    marks = ", ".join("?" for _ in values)
    sql = f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY created_at, rowid"
    return [job_from_row(row) for row in db.query(sql, values)]


def get_approval(db: Database, job_id: str) -> Approval | None:
    rows = list(db.query("SELECT * FROM approvals WHERE job_id = ?", [job_id]))
    return Approval.model_validate(rows[0]) if rows else None


def decide(
    db: Database,
    job_id: str,
    decision: ApprovalState,
    *,
    by: str | None,
    note: str | None = None,
    at: datetime | None = None,
    dedupe_key: str | None = None,
) -> bool:
    """Approve, reject or expire a pending request: both rows change, or neither does.

    With a `dedupe_key`, a second delivery of the same decision raises `AlreadyDelivered`.
    """
    if decision is ApprovalState.PENDING:
        raise ValueError("a decision cannot be 'pending'")
    job_state = {
        ApprovalState.APPROVED: JobState.QUEUED,
        ApprovalState.REJECTED: JobState.REJECTED,
        ApprovalState.EXPIRED: JobState.EXPIRED,
    }[decision]
    when = ts(at or utcnow())
    try:
        _decide(db, job_id, decision.value, job_state, by, note, when, dedupe_key)
    except _Undecided:
        return False
    return True


class _Undecided(Exception):
    pass


def _decide(
    db: Database,
    job_id: str,
    decision: str,
    job_state: JobState,
    by: str | None,
    note: str | None,
    when: str,
    dedupe_key: str | None,
) -> None:
    final = "" if job_state is JobState.QUEUED else ", finished_at = :at"
    with immediate(db.conn):
        if dedupe_key is not None:
            _claim(db, dedupe_key, job_id, decision)
        decided = db.execute(
            "UPDATE approvals SET state = :d, decided_by = :by, decided_at = :at, note = :note "
            "WHERE job_id = :id AND state = 'pending'",
            {"d": decision, "by": by, "at": when, "note": note, "id": job_id},
        ).rowcount
        if decided != 1:
            raise _Undecided
        moved = db.execute(
            f"UPDATE jobs SET state = :s, updated_at = :at{final} "
            "WHERE id = :id AND state = 'awaiting_approval'",
            {"s": job_state.value, "at": when, "id": job_id},
        ).rowcount
        if moved != 1:
            raise _Undecided  # rolls the approval row back too


def expired_approvals(db: Database, now: datetime) -> list[str]:
    rows = db.query(
        "SELECT job_id FROM approvals WHERE state = 'pending' AND expires_at <= ? "
        "ORDER BY expires_at",
        [ts(now)],
    )
    return [row["job_id"] for row in rows]
