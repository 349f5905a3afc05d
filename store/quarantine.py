"""Rows that fail validation when read: reported once, set aside, never fatal.

A row changed behind the bot's back (by hand, by an older or buggy version, by a disk
fault) must not stop start-up or a listing. Readers turn rows into models through
`sift`; a row that does not validate is logged with its key, recorded once in the
`quarantine` table (table, key, job id, reason, when, the raw row) and skipped.

The job a bad `jobs` or `approvals` row belongs to is also set aside: its state becomes
`quarantined`, which is no job state. So no query that picks jobs to run, recover, list
or decide matches it, no compare-and-set transition starts from it, and the unique
indexes on name and address (which cover only the live states) no longer count it. Its
original state stays in the recorded row, for an operator who repairs it by hand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import ValidationError

from bot.models import utcnow
from bot.models.errors import StoreError
from store.sql import Db, immediate

log = logging.getLogger(__name__)
QUARANTINED = "quarantined"  # the jobs.state of a job set aside
_TS = "%Y-%m-%dT%H:%M:%S.%fZ"  # store.jobs.ts's format (that module imports this one)
M = TypeVar("M")


@dataclass(frozen=True)
class Quarantined:
    """One row set aside: which table, its key there, its job, why, and when."""

    table: str
    key: str
    job_id: str | None
    reason: str
    at: datetime


class RowUnreadable(StoreError):
    """A row the caller asked for by its key does not validate (it is now recorded)."""

    def __init__(self, table: str, key: str, reason: str) -> None:
        super().__init__(f"{table} row {key}: {reason}")
        self.table = table
        self.key = key
        self.reason = reason


def describe(exc: Exception) -> str:
    """Why a row did not validate, in one line a person can act on."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False)
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"]) or "row"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        text = f"{where}: {first['msg']}{more}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:500]


def sift(
    rows: list[dict[str, Any]],
    parse: Callable[[dict[str, Any]], M],
    set_aside: Callable[[dict[str, Any], str], None],
) -> tuple[list[M], int]:
    """The rows that validate, as models, and how many did not (each handed to
    `set_aside` with the reason). Never raises for a bad row."""
    good: list[M] = []
    bad = 0
    for row in rows:
        try:
            good.append(parse(row))
        except Exception as exc:  # turning one row into a model is pure: any error is the row's
            bad += 1
            try:
                set_aside(row, describe(exc))
            except Exception:  # cannot write (read-only file...): still skip the row
                log.exception("could not quarantine a row; skipping it anyway")
    return good, bad


@contextmanager
def _writing(db: Db) -> Iterator[None]:
    """A write transaction, or the caller's when a reader runs inside one."""
    if db.in_transaction:
        yield
        return
    with immediate(db):
        yield


def record(
    db: Db, table: str, key: str, job_id: str | None, reason: str, row: dict[str, Any]
) -> bool:
    """Record one unreadable row, once (later reads of the same row add nothing); True,
    and a warning in the log, the first time."""
    raw = json.dumps(row, default=repr, sort_keys=True)
    with _writing(db):
        cursor = db.execute(
            "INSERT INTO quarantine (table_name, row_key, job_id, reason, at, raw) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (table_name, row_key) DO NOTHING",
            [table, key, job_id, reason, utcnow().astimezone(UTC).strftime(_TS), raw],
        )
    first = cursor.rowcount == 1
    if first:
        log.warning("quarantined %s row %s (job %s): %s", table, key, job_id, reason)
    return first


def set_aside_job(
    db: Db,
    *,
    table: str,
    key: str,
    job_id: str | None,
    reason: str,
    row: dict[str, Any],
    rowid: int | None = None,
    only_in: str | None = None,
) -> None:
    """Record a bad row of a job (its own, or its approval) and take the job out of every
    query that runs, recovers, lists or counts it, in one transaction; with `only_in`,
    only while the job is in that state."""
    with _writing(db):
        record(db, table, key, job_id, reason, row)
        if rowid is not None:
            db.execute(f"UPDATE jobs SET state = '{QUARANTINED}' WHERE rowid = ?", [rowid])
        elif job_id is not None:
            db.execute(
                f"UPDATE jobs SET state = '{QUARANTINED}' "
                "WHERE id = ? AND state = coalesce(?, state)",
                [job_id, only_in],
            )


def row_key(value: Any, rowid: int | None) -> str:
    """A row's key as text; a key that is not text (NULL, a blob) is named by rowid."""
    if isinstance(value, str) and value:
        return value
    return f"rowid {rowid}"


def find(db: Db, job_id: str) -> Quarantined | None:
    """Why this job was set aside (its first recorded row), or None."""
    rows = list(
        db.query(
            "SELECT table_name, row_key, job_id, reason, at FROM quarantine "
            "WHERE job_id = ? ORDER BY id LIMIT 1",
            [job_id],
        )
    )
    return _record(rows[0]) if rows else None


def records(db: Db, limit: int = 100) -> list[Quarantined]:
    """Newest first."""
    rows = db.query(
        "SELECT table_name, row_key, job_id, reason, at FROM quarantine ORDER BY id DESC LIMIT ?",
        [limit],
    )
    return [_record(row) for row in rows]


def _record(row: dict[str, Any]) -> Quarantined:
    return Quarantined(
        table=row["table_name"],
        key=row["row_key"],
        job_id=row["job_id"],
        reason=row["reason"],
        at=datetime.strptime(row["at"], _TS).replace(tzinfo=UTC),
    )
