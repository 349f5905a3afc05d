"""Template builds (bot/kinds/build/): insert, read and compare-and-set moves of `builds` rows.

Like jobs, every move names the states it expects and, with `held_by`, the runner that
must still own the build, so a runner whose claim lapsed cannot write over the one that
took the build over. The version number is chosen inside the insert's transaction,
under the unique index that lets one build of a name per backend be in flight.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from bot.models import utcnow
from bot.models.builds import ACTIVE_BUILD_STATES, BUILD_TRANSITIONS, Build, BuildState
from bot.models.notices import Notice
from store import applies, outbox
from store.jobrows import _sql_value
from store.jobs import DuplicateActive, claim
from store.sql import ConstraintViolation, Db, NotMoved, immediate, insert_sql
from store.tx import ts

_FIELDS = frozenset(Build.model_fields) - {"id", "state", "updated_at"}


def build_row(build: Build) -> dict[str, Any]:
    row = {k: _sql_value(v) for k, v in build.model_dump(mode="python").items()}
    row["notes"] = json.dumps(list(build.notes))
    return row


def build_from_row(row: dict[str, Any]) -> Build:
    fields = {k: v for k, v in row.items() if k not in ("rowid", "rowid_")}
    fields["notes"] = tuple(json.loads(fields.get("notes") or "[]"))
    return Build.model_validate(fields)


def _highest_version(db: Db, backend: str, name: str) -> int:
    row = db.execute(
        "SELECT MAX(version) FROM builds WHERE backend = ? AND name = ?", [backend, name]
    ).fetchone()
    return int(row[0] or 0)


def insert_build(
    db: Db, /, build: Build, at_least: int = 1, notices: Sequence[Notice] = ()
) -> Build:
    """Record a new build with the next version of its name: one more than any recorded
    here, and at least `at_least` (what the hypervisor shows, for templates another
    installation or a lost database built). Raises `DuplicateActive("name")` while
    another build of that name on that backend is in flight. The `notices` (for chat,
    store/outbox.py) are kept in the same transaction."""
    with immediate(db):
        version = max(at_least, _highest_version(db, build.backend, build.name) + 1)
        stored = build.model_copy(update={"version": version})
        row = build_row(stored)
        try:
            db.execute(insert_sql("builds", list(row)), row)
        except ConstraintViolation as exc:
            if "builds.id" in exc.what:
                raise
            raise DuplicateActive("name") from None
        outbox.add(db, notices)
    return stored


def get_build(db: Db, build_id: str) -> Build | None:
    rows = db.query("SELECT * FROM builds WHERE id = ?", [build_id])
    return build_from_row(rows[0]) if rows else None


def match_builds(db: Db, prefix: str, limit: int = 10) -> list[str]:
    rows = db.execute(
        "SELECT id FROM builds WHERE id LIKE ? ORDER BY id LIMIT ?", [prefix + "%", limit]
    ).fetchall()
    return [str(r[0]) for r in rows]


def _sets(fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    unknown = set(fields) - _FIELDS
    if unknown:
        raise ValueError(f"not build columns: {sorted(unknown)}")
    values = {k: json.dumps(list(v)) if k == "notes" else _sql_value(v) for k, v in fields.items()}
    return "".join(f", {column} = :{column}" for column in values), values


def move_build(
    db: Db,
    /,
    build_id: str,
    expected: Collection[BuildState],
    new: BuildState,
    held_by: str | None = None,
    notices: Sequence[Notice] = (),
    dedupe_key: str | None = None,
    **fields: Any,
) -> Build | None:
    """Move a build from one of `expected` to `new` (and set `fields`); the build as it
    now is, or None when it was not in those states (or no longer `held_by`'s). The
    `notices` are kept with the move, only if it happened. With a `dedupe_key` (a chat
    click), a second delivery of it raises `AlreadyDelivered` and changes nothing."""
    expected = tuple(expected)
    for state in expected:
        if new not in BUILD_TRANSITIONS.get(state, frozenset()):
            raise ValueError(f"{state.value} -> {new.value} is not a build transition")
    sets, params = _sets(fields)
    marks = ", ".join(f":s{i}" for i in range(len(expected)))
    params.update({f"s{i}": state.value for i, state in enumerate(expected)})
    params.update({"new": new.value, "now": ts(utcnow()), "id": build_id})
    fence = ""
    if held_by is not None:
        fence, params["held_by"] = " AND owner = :held_by", held_by
    try:
        with immediate(db):
            if dedupe_key is not None:
                claim(db, dedupe_key, build_id, new.value)
            rows = db.query(
                f"UPDATE builds SET state = :new, updated_at = :now{sets} "
                f"WHERE id = :id AND state IN ({marks}){fence} RETURNING *",
                params,
            )
            if not rows:
                raise NotMoved  # rolls the delivery's key back too
            ends = new not in ACTIVE_BUILD_STATES
            if ends:  # before the outbox's lock, as `record_apply` takes them
                db.lock(applies.LOCK)
            outbox.add(db, notices)
            if ends:  # a migration apply whose last build this was ends with it
                applies.build_ended(db, build_id)
    except NotMoved:
        return None
    return build_from_row(rows[0])


def update_build(
    db: Db,
    /,
    build_id: str,
    held_by: str | None = None,
    notices: Sequence[Notice] = (),
    **fields: Any,
) -> bool:
    """Set columns without a state change (the template's id, the step, notes), and keep
    the `notices` with them (only if the row was ours to change)."""
    sets, params = _sets(fields)
    params.update({"now": ts(utcnow()), "id": build_id})
    fence = ""
    if held_by is not None:
        fence, params["held_by"] = " AND owner = :held_by", held_by
    with immediate(db):
        done = db.execute(
            f"UPDATE builds SET updated_at = :now{sets} WHERE id = :id{fence}", params
        ).rowcount
        if done == 1:
            outbox.add(db, notices)
    return done == 1


def request_cancel(db: Db, /, build_id: str, by: str) -> bool:
    """Ask the runner of a build under way to cancel it (it sees this at its next
    renewal). False when the build is not running or rolling back."""
    with immediate(db):
        done = db.execute(
            "UPDATE builds SET cancel_requested = :by "
            "WHERE id = :id AND state IN ('running', 'rolling_back')",
            {"id": build_id, "by": by},
        ).rowcount
    return done == 1


def list_builds(
    db: Db, backend: str | None = None, name: str | None = None, limit: int = 50
) -> list[Build]:
    """Newest first."""
    where, params = ["1 = 1"], []
    if backend is not None:
        where.append("backend = ?")
        params.append(backend)
    if name is not None:
        where.append("name = ?")
        params.append(name)
    rows = db.query(
        f"SELECT * FROM builds WHERE {' AND '.join(where)} ORDER BY created_at DESC LIMIT ?",
        [*params, limit],
    )
    return [build_from_row(r) for r in rows]


def abandoned_builds(db: Db, now: datetime) -> list[Build]:
    """Builds running or rolling back whose runner's claim lapsed (it died)."""
    rows = db.query(
        "SELECT * FROM builds WHERE state IN ('running', 'rolling_back') "
        "AND (lease_until IS NULL OR lease_until < ?)",
        [ts(now)],
    )
    return [build_from_row(r) for r in rows]


def awaiting_builds(db: Db, asked_before: datetime) -> list[Build]:
    """Builds awaiting approval that were asked for before `asked_before` (to expire)."""
    rows = db.query(
        "SELECT * FROM builds WHERE state = 'awaiting_approval' AND created_at <= ? "
        "ORDER BY created_at",
        [ts(asked_before)],
    )
    return [build_from_row(r) for r in rows]


def profile_builds(db: Db, backend: str, profiles: Collection[str]) -> list[Build]:
    """The builds on `backend` of these profiles that are in flight or published (not
    retired), newest first: what a migration's apply must not start again."""
    if not profiles:
        return []
    params: dict[str, Any] = {"backend": backend}
    marks = ", ".join(f":p{i}" for i in range(len(profiles)))
    params.update({f"p{i}": p for i, p in enumerate(sorted(profiles))})
    states = sorted(s.value for s in ACTIVE_BUILD_STATES | {BuildState.PUBLISHED})
    params.update({f"s{i}": s for i, s in enumerate(states)})
    which = ", ".join(f":s{i}" for i in range(len(states)))
    rows = db.query(
        f"SELECT * FROM builds WHERE backend = :backend AND profile IN ({marks}) "
        f"AND state IN ({which}) ORDER BY created_at DESC",
        params,
    )
    return [build_from_row(r) for r in rows]
