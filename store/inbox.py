"""The inbox: commands from chat between their acknowledgement and their answer.

Slack gets its acknowledgement within 3 s and never sends the command again; what the
command asks (a deploy's checks against the hypervisor) often takes longer. So the
command is written here before it is acknowledged, held by the runner that took it
(claimed like its jobs: renewed every tick, store/owners.py), and marked done once it
was carried out and answered. A runner that dies in between leaves it undone with a
lapsing claim, and another process takes it (`claim_orphaned`) and carries it out.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from bot.models.errors import StoreError
from bot.models.notices import Received
from store.sql import Db, immediate
from store.tx import ts

DONE_KEPT_DAYS = 7


class Abandoned(StoreError):
    """The caller gave up on this write before it could commit (rolled back)."""


def add(
    db: Db, item: Received, me: str, until: datetime, wanted: Callable[[], bool] | None = None
) -> bool:
    """Keep a command for this runner; False when its key was received before. With
    `wanted`, asked just before the commit: when it says no (the caller stopped waiting
    and told the person the command was refused), nothing is kept (`Abandoned`)."""
    with immediate(db):
        kept = _insert(db, item, me, until)
        if wanted is not None and not wanted():
            raise Abandoned(item.key)
    return kept


def refuse(db: Db, item: Received, now: datetime) -> None:
    """Mark a command that was refused as done, whether or not its `add` got through
    after all: one that did is then never carried out, here or by another process."""
    db.execute(
        "INSERT INTO inbox (key, user_id, channel, body, received_at, done_at) "
        "VALUES (:key, :user, :channel, :body, :at, :now) "
        "ON CONFLICT (key) DO UPDATE SET done_at = :now, holder = NULL",
        {
            "key": item.key,
            "user": item.user,
            "channel": item.channel,
            "body": item.text,
            "at": ts(item.received_at),
            "now": ts(now),
        },
    )


def _insert(db: Db, item: Received, me: str, until: datetime) -> bool:
    return (
        db.execute(
            "INSERT INTO inbox (key, user_id, channel, body, received_at, holder, until) "
            "VALUES (:key, :user, :channel, :body, :at, :me, :until) "
            "ON CONFLICT (key) DO NOTHING",
            {
                "key": item.key,
                "user": item.user,
                "channel": item.channel,
                "body": item.text,
                "at": ts(item.received_at),
                "me": me,
                "until": ts(until),
            },
        ).rowcount
        == 1
    )


def done(db: Db, key: str, now: datetime) -> None:
    """The command was carried out and answered; forget those done long ago."""
    db.execute("UPDATE inbox SET done_at = ?, holder = NULL WHERE key = ?", [ts(now), key])
    forgotten = ts(now - timedelta(days=DONE_KEPT_DAYS))
    db.execute("DELETE FROM inbox WHERE done_at < ?", [forgotten])


def claim_orphaned(db: Db, me: str, now: datetime, until: datetime, limit: int) -> list[Received]:
    """Take up to `limit` undone commands whose holder's claim has lapsed, oldest first,
    in one statement (on PostgreSQL skipping those another replica is taking now)."""
    skip = " FOR UPDATE SKIP LOCKED" if db.dialect == "postgres" else ""
    rows = db.query(
        "UPDATE inbox SET holder = :me, until = :until WHERE key IN ("
        "SELECT key FROM inbox WHERE done_at IS NULL AND (until IS NULL OR until < :now) "
        f"ORDER BY received_at LIMIT :limit{skip}) "
        "RETURNING key, user_id, channel, body, received_at",
        {"me": me, "now": ts(now), "until": ts(until), "limit": limit},
    )
    items = [_item(row) for row in rows]
    return sorted(items, key=lambda item: item.received_at)


def _item(row: dict[str, Any]) -> Received:
    return Received.model_validate(
        {
            "key": row["key"],
            "user": row["user_id"],
            "channel": row["channel"],
            "text": row["body"],
            "received_at": datetime.strptime(row["received_at"], "%Y-%m-%dT%H:%M:%S.%fZ"),
        }
    )
