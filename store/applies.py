"""Migration applies asked from chat (bot/migration/), kept until their last build ends.

`record_apply` keeps an apply with its builds; `build_ended` runs inside the move that
ends a build (store/builds.py `move_build`) and ends every apply whose builds have now
all ended, keeping in that same transaction the notice that tells the apply's end
(store/outbox.py), so the end is told exactly once whatever process ends the build and
whoever dies meanwhile. Both take the `LOCK` first: PostgreSQL runs them side by side,
and without it an apply recorded while its last build ended could see the build in
flight while the build's move did not see the apply yet (neither would tell the end).
The notice is filed under the build that ended (a `builds` row, so deliverers claim it
like that build's other notices); its text is the apply's id.

One apply, one table: `record_apply` keeps nothing new when the apply's id is kept
already (a command redelivered, or run again after its process died: the id is derived
from the command's key, bot/migration/service.py) or when an apply of the same plan
asked in the same channel has not ended (a person running it again): it answers the
apply already kept, whose end is told once.
"""

from __future__ import annotations

from typing import Any

from bot.models import utcnow
from bot.models.builds import ACTIVE_BUILD_STATES
from bot.models.notices import MIGRATION_ENDED, Notice, NoticeKind
from bot.models.plans import MigrationApply
from store import outbox
from store.sql import Db, immediate, insert_sql
from store.tx import ts

LOCK = "migration_applies"
_ACTIVE = tuple(sorted(s.value for s in ACTIVE_BUILD_STATES))


def record_apply(db: Db, /, apply: MigrationApply) -> MigrationApply:
    """Keep `apply` and its builds; when they have all ended already (the last one
    ended while the apply was asking for the others), its end is kept at once. The
    apply kept: this one (`ended_at` set when it ended here), or the one already kept
    under its id or live for its plan and channel, which stands for it."""
    row: dict[str, Any] = {
        **apply.model_dump(exclude={"build_ids", "ended_at"}),
        "created_at": ts(apply.created_at),
    }
    with immediate(db):
        db.lock(LOCK)  # the look below and the insert are one step for every process
        kept = db.execute(
            "SELECT id FROM migration_applies WHERE id = ? "
            "OR (plan_id = ? AND origin = ? AND ended_at IS NULL) ORDER BY id <> ?, id LIMIT 1",
            [apply.id, apply.plan_id, apply.origin, apply.id],
        ).fetchone()
        if kept is not None:  # read under the lock every writer of applies takes
            return get_apply(db, str(kept[0])) or apply
        db.execute(insert_sql("migration_applies", list(row)), row)
        for build_id in dict.fromkeys(apply.build_ids):
            db.execute(
                "INSERT INTO migration_apply_builds (apply_id, build_id) VALUES (?, ?)",
                [apply.id, build_id],
            )
        if _end_if_done(db, apply.id, None):
            return get_apply(db, apply.id) or apply
        return apply


def build_ended(db: Db, build_id: str) -> None:
    """Inside the transaction that ended `build_id` (after `LOCK`): end the applies it
    was the last build of, each with its notice."""
    rows = db.execute(
        "SELECT a.id FROM migration_apply_builds b JOIN migration_applies a "
        "ON a.id = b.apply_id WHERE b.build_id = ? AND a.ended_at IS NULL ORDER BY a.id",
        [build_id],
    ).fetchall()
    for row in rows:
        _end_if_done(db, str(row[0]), build_id)


def _end_if_done(db: Db, apply_id: str, last: str | None) -> bool:
    rows = db.execute(
        "SELECT s.id, s.state FROM migration_apply_builds b JOIN builds s ON s.id = b.build_id "
        "WHERE b.apply_id = ? ORDER BY s.id",
        [apply_id],
    ).fetchall()
    if not rows or any(str(state) in _ACTIVE for _id, state in rows):
        return False
    ended = db.execute(
        "UPDATE migration_applies SET ended_at = ? WHERE id = ? AND ended_at IS NULL",
        [ts(utcnow()), apply_id],
    ).rowcount
    if ended != 1:
        return False
    notice = Notice(
        job_id=last or str(rows[0][0]),
        kind=NoticeKind.BUILD,
        step=MIGRATION_ENDED,
        text=apply_id,
    )
    outbox.add(db, [notice])
    return True


def get_apply(db: Db, apply_id: str) -> MigrationApply | None:
    rows = db.query("SELECT * FROM migration_applies WHERE id = ?", [apply_id])
    if not rows:
        return None
    builds = db.execute(
        "SELECT build_id FROM migration_apply_builds WHERE apply_id = ? ORDER BY build_id",
        [apply_id],
    ).fetchall()
    fields = {k: v for k, v in rows[0].items() if k not in ("rowid", "rowid_")}
    return MigrationApply.model_validate({**fields, "build_ids": [str(b[0]) for b in builds]})
