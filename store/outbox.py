"""The outbox: what chat front ends must still say, kept until it has been said.

The core adds a notice inside the transaction of the change that causes it (`add`), so
after any crash the change and the duty to tell of it exist together or not at all. A
front end process delivers the notices of the jobs it has claimed (`outbox_claims`, a
delivery claim per job, so with several processes each job's thread is written by one at a time
and in order) and marks them delivered once Slack accepted the call that carried them.
A notice told in several messages (a thread line, its headline, a direct message) has
each part recorded as it gets there (`parts_sent`, schema v13), so a deliverer that
dies between them leaves only the rest to say.

Only jobs someone follows in chat get notices: one with an origin (asked in a channel)
or an approval (its card goes to the approvers). Template builds (ids starting with `b`)
get them on the same terms, in the same table: since schema v12 `job_id` names a job
or a build, and this check, not a foreign key, is what keeps notices of neither out. The
end of a migration apply asked from chat (store/applies.py, schema v20) is kept too,
filed under the build of it that ended last, whatever that build's origin: that
notice only, not the build's own (an apply's build asked from the command line stays
unfollowed).
These functions run on the store's worker thread (store/db.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from bot.models import JobState
from bot.models.notices import MIGRATION_ENDED, Notice
from store.sql import Db, immediate
from store.tx import ts

DELIVERED_KEPT_DAYS = 7
# How many notices `add` kept on this thread: a repository compares it before and after
# a store function to know whether to wake the delivery (store/repository.py).
_kept = threading.local()


def kept_here() -> int:
    return int(getattr(_kept, "count", 0))


def add(db: Db, notices: Iterable[Notice], state: JobState | None = None) -> None:
    """Inside the caller's transaction: keep the notices of jobs (and builds) followed in
    chat, each with the job's state as the change left it (`state`, unless it has one)."""
    notices = list(notices)
    if notices:
        # Deliverers read on from the last id they saw (`new_since`), so ids must become
        # visible in increasing order. SQLite commits one writer at a time; PostgreSQL
        # hands out ids as transactions run and commits them in any order, so the
        # transactions that add notices take turns, until their commit, from here.
        db.lock("outbox")
    for notice in notices:
        if notice.state is None and state is not None:
            notice = notice.model_copy(update={"state": state})
        body = notice.model_dump_json(exclude={"id", "sent"})
        cursor = db.execute(
            "INSERT INTO outbox (job_id, kind, urgent, body, created_at) "
            "SELECT :job, :kind, :urgent, :body, :at WHERE EXISTS ("
            "  SELECT 1 FROM jobs WHERE id = :job AND (origin IS NOT NULL"
            "  OR EXISTS (SELECT 1 FROM approvals WHERE job_id = :job)))"
            " OR EXISTS (SELECT 1 FROM builds WHERE id = :job"
            "  AND (origin IS NOT NULL OR approval_reason IS NOT NULL))"
            # the end of a migration apply asked from chat (store/applies.py)
            " OR (:apply_end = 1"
            "  AND EXISTS (SELECT 1 FROM migration_apply_builds WHERE build_id = :job))",
            {
                "job": notice.job_id,
                "kind": notice.kind.value,
                "urgent": int(notice.urgent),
                "body": body,
                "at": ts(notice.at),
                "apply_end": int(notice.step == MIGRATION_ENDED),
            },
        )
        if cursor.rowcount > 0:
            _kept.count = kept_here() + 1


def _notice(row: Sequence[Any]) -> Notice:
    sent = frozenset(str(row[2] or "").split())
    return Notice.model_validate({**json.loads(row[1]), "id": row[0], "sent": sent})


def new_since(db: Db, after: int, limit: int) -> list[Notice]:
    """Undelivered notices with ids above `after` (what arrived since the last look)."""
    rows = db.execute(
        "SELECT id, body, parts_sent FROM outbox WHERE id > ? AND delivered_at IS NULL "
        "ORDER BY id LIMIT ?",
        [after, limit],
    ).fetchall()
    return [_notice(row) for row in rows]


def undelivered(db: Db, job_id: str) -> list[Notice]:
    rows = db.execute(
        "SELECT id, body, parts_sent FROM outbox WHERE job_id = ? AND delivered_at IS NULL "
        "ORDER BY id",
        [job_id],
    ).fetchall()
    return [_notice(row) for row in rows]


def claim(db: Db, job_ids: Sequence[str], me: str, now: datetime, until: datetime) -> set[str]:
    """Take (or keep) the delivery claim of these jobs where nobody else holds it; the
    jobs now ours. One statement per job, each a compare-and-set on the claim row. No
    jobs (a poll with nothing new): no transaction, so no write lock taken for nothing."""
    won: set[str] = set()
    if not job_ids:
        return won
    params = {"me": me, "now": ts(now), "until": ts(until)}
    with immediate(db):
        for job_id in job_ids:
            cursor = db.execute(
                "INSERT INTO outbox_claims (job_id, holder, until) VALUES (:job, :me, :until) "
                "ON CONFLICT(job_id) DO UPDATE SET holder = :me, until = :until "
                "WHERE outbox_claims.holder = :me OR outbox_claims.until < :now",
                {**params, "job": job_id},
            )
            if cursor.rowcount == 1:
                won.add(job_id)
    return won


def renew_delivery_claims(db: Db, me: str, until: datetime) -> set[str]:
    """Extend `me`'s delivery claims; the jobs `me` still holds. One that lapsed while the
    database was away may have been taken by another deliverer: it is not among them,
    and `me` must stop telling of it (the new holder says what was not recorded)."""
    with immediate(db):
        rows = db.execute(
            "UPDATE outbox_claims SET until = ? WHERE holder = ? RETURNING job_id",
            [ts(until), me],
        ).fetchall()
    return {str(row[0]) for row in rows}


def orphaned(db: Db, now: datetime, limit: int) -> list[str]:
    """Jobs with undelivered notices whose deliverer's delivery claim has lapsed, or that nobody
    ever claimed: what a process that died left unsaid."""
    rows = db.execute(
        "SELECT DISTINCT o.job_id FROM outbox o LEFT JOIN outbox_claims c ON c.job_id = o.job_id "
        "WHERE o.delivered_at IS NULL AND (c.job_id IS NULL OR c.until < ?) LIMIT ?",
        [ts(now), limit],
    ).fetchall()
    return [str(row[0]) for row in rows]


def mark_delivered(
    db: Db, ids: Sequence[int], now: datetime, parts: Sequence[tuple[int, str]] = ()
) -> None:
    """Record the `parts` (notice id, part name) now in chat, and the notices `ids`
    whose every part is; one transaction."""
    if not ids and not parts:
        return
    with immediate(db):
        for notice, part in parts:  # appended, not read and rewritten: no lost update
            db.execute(
                "UPDATE outbox SET parts_sent = COALESCE(parts_sent, '') || ? WHERE id = ?",
                [f"{part} ", notice],
            )
        if ids:
            marks = ", ".join("?" for _ in ids)
            db.execute(f"UPDATE outbox SET delivered_at = ? WHERE id IN ({marks})", [ts(now), *ids])


def release(db: Db, job_id: str, me: str, now: datetime) -> None:
    """Give up the delivery claim of a job with nothing left to say; forget old rows."""
    forgotten = ts(now - timedelta(days=DELIVERED_KEPT_DAYS))
    with immediate(db):
        db.execute("DELETE FROM outbox_claims WHERE job_id = ? AND holder = ?", [job_id, me])
        # Never the newest row: ids must keep growing, deliverers read on from the last.
        db.execute(
            "DELETE FROM outbox WHERE delivered_at < ? AND id < (SELECT max(id) FROM outbox)",
            [forgotten],
        )


def pending_count(db: Db) -> int:
    return int(db.execute("SELECT count(*) FROM outbox WHERE delivered_at IS NULL").fetchone()[0])
