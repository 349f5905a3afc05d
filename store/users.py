"""Per-person settings and the audit log, as rows. Runs on the store's worker thread."""

from __future__ import annotations

import json

from sqlite_utils import Database

from bot.models import AuditEvent, UserPrefs, utcnow
from store.jobs import ts
from store.tx import immediate


def get_prefs(db: Database, user: str) -> UserPrefs:
    rows = list(db.query("SELECT * FROM user_prefs WHERE user = ?", [user]))
    if not rows:
        return UserPrefs(user=user)
    row = rows[0]
    return UserPrefs(
        user=user,
        ssh_keys=tuple(json.loads(row["ssh_keys"])),
        default_template=row["default_template"],
    )


def put_prefs(db: Database, prefs: UserPrefs) -> None:
    with immediate(db.conn):
        _write(db, prefs)


def add_key(db: Database, user: str, key: str, max_keys: int) -> UserPrefs | None:
    """Append a key (once) in one transaction; None when the user already has `max_keys`."""
    with immediate(db.conn):
        prefs = get_prefs(db, user)
        if any(_body(k) == _body(key) for k in prefs.ssh_keys):
            return prefs
        if len(prefs.ssh_keys) >= max_keys:
            return None
        prefs = prefs.model_copy(update={"ssh_keys": (*prefs.ssh_keys, key)})
        _write(db, prefs)
        return prefs


def _body(key: str) -> str:
    return " ".join(key.split()[:2])


def _write(db: Database, prefs: UserPrefs) -> None:
    db.execute(
        "INSERT INTO user_prefs (user, ssh_keys, default_template, updated_at) "
        "VALUES (:user, :keys, :template, :at) "
        "ON CONFLICT(user) DO UPDATE SET ssh_keys = :keys, "
        "default_template = :template, updated_at = :at",
        {
            "user": prefs.user,
            "keys": json.dumps(list(prefs.ssh_keys)),
            "template": prefs.default_template,
            "at": ts(utcnow()),
        },
    )


def add_audit(db: Database, event: AuditEvent) -> None:
    with immediate(db.conn):
        db.execute(
            "INSERT INTO audit (at, actor, action, outcome, detail) VALUES (?, ?, ?, ?, ?)",
            [ts(event.at), event.actor, event.action, event.outcome, event.detail],
        )


def audit_events(db: Database, limit: int) -> list[AuditEvent]:
    rows = db.query(
        "SELECT at, actor, action, outcome, detail FROM audit ORDER BY id DESC LIMIT ?", [limit]
    )
    return [AuditEvent.model_validate(row) for row in rows]
