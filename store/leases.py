"""A lease's steps as compare-and-sets, each with its notices and audit row.

Every write names what the caller read: the state and the lease end as stored (NULL
while the end is still "lease_s from ready"), so a reminder, an extension and an expiry
racing each other (two processes, a click during the timer's step) decide once. The
notices (store/outbox.py) and the audit row go in the same transaction, so a reminder
recorded as sent was also queued for chat, and one not recorded was not.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from bot.models import AuditEvent, Job, JobState
from bot.models.notices import Notice
from store import outbox
from store.jobs import SELECT_JOBS, claim, job_from_row, listing
from store.sql import Db, NotMoved, immediate
from store.tx import ts
from store.users import add_audit


def watched(db: Db) -> list[Job]:
    """Jobs whose lease the timer looks after: ready ones with a lease, powered-off ones."""
    sql = (
        f"{SELECT_JOBS} WHERE (state = 'succeeded' AND (lease_s IS NOT NULL "
        "OR expires_at IS NOT NULL)) OR state = 'expired_off' ORDER BY created_at"
    )
    return listing(db, sql)


def _stored_end(job: Job) -> str:
    return ts(job.expires_at) if job.expires_at is not None else ""


def _update(
    db: Db,
    job: Job,
    state: JobState,
    sets: dict[str, Any],
    notices: Sequence[Notice],
    audit: AuditEvent,
    sent_was: str | None = None,
) -> Job | None:
    """UPDATE the job if it is still in `state` with the end it had (and, given
    `sent_was`, the reminders recorded then); the job as it now is."""
    values = {k: ts(v) if isinstance(v, datetime) else v for k, v in sets.items()}
    assigns = ", ".join(f"{column} = :{column}" for column in values)
    new_state = values.get("state", state.value)
    params = {**values, "now": ts(audit.at), "id": job.id, "was": state.value}
    params["end"] = _stored_end(job)
    sent = ""
    if sent_was is not None:
        sent, params["sent_was"] = " AND COALESCE(reminders_sent, '') = :sent_was", sent_was
    with immediate(db):
        rows = db.query(
            f"UPDATE jobs SET {assigns}, updated_at = :now WHERE id = :id AND state = :was "
            f"AND COALESCE(expires_at, '') = :end{sent} RETURNING *",
            params,
        )
        if not rows:
            return None
        outbox.add(db, notices, JobState(new_state))
        add_audit(db, audit)
    return job_from_row(rows[0])


def remind(
    db: Db,
    job: Job,
    sent: str,
    notices: Sequence[Notice],
    audit: AuditEvent,
) -> Job | None:
    """Record the reminders now sent (`sent`), if nobody recorded any since `job` was read."""
    was = job.reminders_sent or ""
    sets = {"reminders_sent": sent}
    return _update(db, job, JobState.SUCCEEDED, sets, notices, audit, sent_was=was)


def extend(
    db: Db,
    job: Job,
    end: datetime,
    notices: Sequence[Notice],
    audit: AuditEvent,
    dedupe_key: str | None = None,
) -> Job | None:
    """A new end (reminders start over); a powered-off VM's job is ready again. With
    `dedupe_key` (a click) the delivery is claimed in the same transaction
    (`AlreadyDelivered` when seen before); a move that does not happen keeps no claim."""
    sets: dict[str, Any] = {"expires_at": end, "reminders_sent": None}
    if job.state is JobState.EXPIRED_OFF:
        sets.update(state=JobState.SUCCEEDED.value, powered_off_at=None)
    try:
        with immediate(db):
            if dedupe_key is not None:
                claim(db, dedupe_key, job.id, "extend")
            done = _update(db, job, job.state, sets, notices, audit)
            if done is None:
                raise NotMoved
            return done
    except NotMoved:
        return None


def expire(
    db: Db,
    job: Job,
    at: datetime,
    notices: Sequence[Notice],
    audit: AuditEvent,
) -> Job | None:
    """The VM was powered off at its end: ready -> expired_off, once."""
    sets = {"state": JobState.EXPIRED_OFF.value, "powered_off_at": at}
    return _update(db, job, JobState.SUCCEEDED, sets, notices, audit)


def write(
    db: Db,
    step: str,
    job: Job,
    value: str | datetime,
    notices: Sequence[Notice],
    audit: AuditEvent,
    dedupe_key: str | None = None,
) -> Job | None:
    """One lease step ("remind": the reminders now sent; "extend": the new end;
    "expire": when the VM was powered off); the job as it now is, or None when it had
    changed since it was read. Only an extension (a click) takes a `dedupe_key`."""
    if step == "remind" and isinstance(value, str):
        return remind(db, job, value, notices, audit)
    if step == "extend" and isinstance(value, datetime):
        return extend(db, job, value, notices, audit, dedupe_key)
    if step == "expire" and isinstance(value, datetime):
        return expire(db, job, value, notices, audit)
    raise ValueError(f"not a lease step: {step} with {value!r}")
