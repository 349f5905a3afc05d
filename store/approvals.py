"""Approvals as rows: the decision, expiry, and the cancel that closes one.

A decision (approve, reject, expire) and a cancel change the approval row and the job in
one transaction or not at all, so of two approvers (or an approver and the requester
cancelling) exactly one wins. These functions run on the store's worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from bot.models import Approval, ApprovalState, JobState, utcnow
from bot.models.notices import Notice
from store import outbox, quarantine
from store.jobs import claim
from store.sql import Db, NotMoved, immediate
from store.tx import ts


def get_approval(db: Db, job_id: str) -> Approval | None:
    """None also when the approval row does not validate: then it is quarantined, and so
    is its job while it awaits approval, since nobody can safely decide on a request whose
    record is damaged (for a job past that point the approval is only history)."""
    rows = list(db.query("SELECT * FROM approvals WHERE job_id = ?", [job_id]))

    def set_aside(row: dict[str, Any], reason: str) -> None:
        quarantine.set_aside_job(
            db,
            table="approvals",
            key=job_id,
            job_id=job_id,
            reason=reason,
            row=row,
            only_in=JobState.AWAITING_APPROVAL.value,
        )

    found, _bad = quarantine.sift(rows, Approval.model_validate, set_aside)
    return found[0] if found else None


def decide(
    db: Db,
    job_id: str,
    decision: ApprovalState,
    *,
    by: str | None,
    note: str | None = None,
    at: datetime | None = None,
    dedupe_key: str | None = None,
    notices: Sequence[Notice] = (),
) -> bool:
    """Approve, reject or expire a pending request: both rows change, or neither does
    (and the `notices` are kept with them).

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
        _decide(db, job_id, decision.value, job_state, by, note, when, dedupe_key, notices)
    except NotMoved:
        return False
    return True


def _decide(
    db: Db,
    job_id: str,
    decision: str,
    job_state: JobState,
    by: str | None,
    note: str | None,
    when: str,
    dedupe_key: str | None,
    notices: Sequence[Notice],
) -> None:
    final = "" if job_state is JobState.QUEUED else ", finished_at = :at"
    with immediate(db):
        if dedupe_key is not None:
            claim(db, dedupe_key, job_id, decision)
        decided = db.execute(
            "UPDATE approvals SET state = :d, decided_by = :by, decided_at = :at, note = :note "
            "WHERE job_id = :id AND state = 'pending'",
            {"d": decision, "by": by, "at": when, "note": note, "id": job_id},
        ).rowcount
        if decided != 1:
            raise NotMoved
        moved = db.execute(
            f"UPDATE jobs SET state = :s, updated_at = :at{final} "
            "WHERE id = :id AND state = 'awaiting_approval'",
            {"s": job_state.value, "at": when, "id": job_id},
        ).rowcount
        if moved != 1:
            raise NotMoved  # rolls the approval row back too
        outbox.add(db, notices, job_state)


def expired_approvals(db: Db, now: datetime) -> list[str]:
    """Pending approvals past their time, of jobs still awaiting approval (a job that was
    set aside, or cancelled by an older version that left its approval pending, is not
    listed again and again)."""
    rows = db.query(
        "SELECT a.job_id FROM approvals a JOIN jobs j ON j.id = a.job_id "
        "WHERE a.state = 'pending' AND a.expires_at <= ? AND j.state = 'awaiting_approval' "
        "ORDER BY a.expires_at",
        [ts(now)],
    )
    return [row["job_id"] for row in rows]


def cancel_awaiting(
    db: Db,
    job_id: str,
    *,
    by: str,
    at: datetime | None = None,
    notices: Sequence[Notice] = (),
) -> bool:
    """Cancel a job that awaits approval and close its approval, in one transaction, so
    no approver can approve it afterwards; False when it no longer awaited approval."""
    when = ts(at or utcnow())
    with immediate(db):
        moved = db.execute(
            "UPDATE jobs SET state = 'cancelled', updated_at = :at, finished_at = :at, "
            "error = 'cancelled' WHERE id = :id AND state = 'awaiting_approval'",
            {"at": when, "id": job_id},
        ).rowcount
        if moved != 1:
            return False
        db.execute(
            "UPDATE approvals SET state = 'cancelled', decided_by = :by, decided_at = :at "
            "WHERE job_id = :id AND state = 'pending'",
            {"by": by, "at": when, "id": job_id},
        )
        outbox.add(db, notices, JobState.CANCELLED)
    return True
