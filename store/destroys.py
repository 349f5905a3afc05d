"""The VMs jobs hold, as people list them (`/deploy list`), and a destroy's decisions.

A job holds its VM from the request to the end of its destroy (HOLDING_STATES), so the
listing is the jobs in those states: in flight, ready, or on their way out; newest
first, a page at a time. A decision on a destroy (bot/kinds/deploy/destroy.py) is one
compare-and-set of the job's state, made with the chat delivery that asked for it in
one transaction, so a redelivered click decides nothing twice.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from bot.models import HOLDING_STATES, Job, JobState
from bot.models.notices import Notice
from store.jobs import SELECT_JOBS, claim, listing, transition
from store.sql import Db, NotMoved, immediate

_MARKS = ", ".join(f"'{s.value}'" for s in sorted(HOLDING_STATES))


def _where(requester: str | None) -> tuple[str, dict[str, Any]]:
    if requester is None:
        return f"state IN ({_MARKS})", {}
    return f"state IN ({_MARKS}) AND requester = :requester", {"requester": requester}


def live(db: Db, requester: str | None, limit: int, offset: int = 0) -> list[Job]:
    """One page of live jobs (all, or one requester's), newest first."""
    where, params = _where(requester)
    sql = (
        f"{SELECT_JOBS} WHERE {where} ORDER BY created_at DESC, rowid DESC "
        "LIMIT :limit OFFSET :offset"
    )
    return listing(db, sql, {**params, "limit": limit, "offset": offset})


def count_live(db: Db, requester: str | None) -> int:
    where, params = _where(requester)
    rows = db.query(f"SELECT count(*) AS n FROM jobs WHERE {where}", params)
    return int(rows[0]["n"])


def transition_once(
    db: Db,
    /,
    dedupe_key: str | None,
    job_id: str,
    expected: Collection[JobState],
    new: JobState,
    *,
    notices: Sequence[Notice] = (),
    **fields: Any,
) -> bool:
    """`jobs.transition` that also claims `dedupe_key` (store/jobs.claim) in the same
    transaction: `AlreadyDelivered` when it was seen before, and then nothing moved. A
    move that does not happen keeps no claim either (the transaction is undone)."""
    try:
        with immediate(db):
            if dedupe_key is not None:
                claim(db, dedupe_key, job_id, "destroy")
            if not transition(db, job_id, expected, new, notices=notices, **fields):
                raise NotMoved
    except NotMoved:
        return False
    return True
