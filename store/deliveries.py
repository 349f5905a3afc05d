"""Chat deliveries seen once (split from store/jobs.py): a redelivered command or button
press carries the same dedupe key, and `claim` records it inside the transaction that acts
on it, so the second delivery changes nothing and hears which job the first one made."""

from __future__ import annotations

from bot.models import utcnow
from bot.models.errors import StoreError
from store.sql import Db
from store.tx import ts


class AlreadyDelivered(StoreError):
    """This dedupe key was handled before (for `job_id`); the transaction did nothing."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


def claim(db: Db, key: str, job_id: str, action: str) -> None:
    """Record a delivery inside the caller's transaction; raise if it was seen before.

    The primary key decides, not a lookup first: two deliveries racing cannot both pass.
    """
    # ON CONFLICT rather than catching the error: on PostgreSQL an error ends the
    # transaction, and the caller's must go on to read who had the key.
    inserted = db.execute(
        "INSERT INTO deliveries (key, job_id, action, at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (key) DO NOTHING",
        [key, job_id, action, ts(utcnow())],
    ).rowcount
    if inserted != 1:
        rows = db.query("SELECT job_id FROM deliveries WHERE key = ?", [key])
        raise AlreadyDelivered(rows[0]["job_id"] if rows else job_id)


def delivered(db: Db, key: str) -> str | None:
    rows = list(db.query("SELECT job_id FROM deliveries WHERE key = ?", [key]))
    return str(rows[0]["job_id"]) if rows else None
