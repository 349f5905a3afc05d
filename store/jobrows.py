"""A job as a row and back, and the careful reading of job rows (split from
store/jobs.py): every query that lists jobs goes through `_jobs`/`listing`, which set aside
(store/quarantine.py) a row that does not validate instead of failing on it, and read
again to fill its place."""

from __future__ import annotations

import json
from datetime import datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel

from bot.models import Job, JobEvent
from store import quarantine
from store.sql import Db
from store.tx import ts


def _sql_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return ts(value)
    if isinstance(value, Enum):
        return value.value
    return value


def _row(model: BaseModel) -> dict[str, Any]:
    return {k: _sql_value(v) for k, v in model.model_dump(mode="python").items()}


def event_row(event: JobEvent) -> dict[str, Any]:
    """`_row` of a step event, read off its fields: some thirteen per deploy, and a
    model_dump each was most of what writing them cost the store's thread."""
    return {
        "job_id": event.job_id,
        "at": ts(event.at),
        "step": event.step,
        "phase": event.phase,
        "duration_s": event.duration_s,
        "detail": event.detail,
    }


def job_row(job: Job) -> dict[str, Any]:
    row = _row(job)
    row["request"] = json.dumps(job.request.model_dump(mode="json"), sort_keys=True)
    return row


def job_from_row(row: dict[str, Any]) -> Job:
    try:
        request = json.loads(row["request"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"request: not valid JSON ({exc})") from None
    # `rowid` is a real column on PostgreSQL (SQLite has it implicitly): not the job's.
    fields = {k: v for k, v in row.items() if k not in ("rowid", "rowid_")}
    return Job.model_validate({**fields, "request": request})


# Job rows are read with their rowid, so a row whose id is unusable can still be set aside.
SELECT_JOBS = "SELECT rowid AS rowid_, * FROM jobs"


def _jobs(db: Db, sql: str, params: Any = ()) -> tuple[list[Job], int]:
    """The jobs a query finds, and how many rows it found that do not validate: those
    are quarantined (see store/quarantine.py), so no listing or start-up ever fails on
    them and the next query no longer finds them."""
    return sift_rows(db, list(db.query(sql, params)))


def sift_rows(db: Db, rows: list[dict[str, Any]]) -> tuple[list[Job], int]:
    """`_jobs` for rows already read (a page that needs its last row's position)."""
    return quarantine.sift(rows, job_from_row, lambda row, why: _set_aside(db, row, why))


def _set_aside(db: Db, row: dict[str, Any], reason: str) -> None:
    rowid = row.get("rowid_")
    job_id = row.get("id")
    quarantine.set_aside_job(
        db,
        table="jobs",
        key=quarantine.row_key(job_id, rowid),
        job_id=job_id if isinstance(job_id, str) and job_id else None,
        reason=reason,
        row={k: v for k, v in row.items() if k not in ("rowid", "rowid_")},
        rowid=rowid,
    )


# How often a listing is read again after it met rows that do not validate (each round
# quarantines them, so the next one fills their places from further down).
_REREADS = 10


def listing(db: Db, sql: str, params: Any = ()) -> list[Job]:
    found: list[Job] = []
    for _round in range(_REREADS):
        found, bad = _jobs(db, sql, params)
        if not bad:
            break
    return found
