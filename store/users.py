"""Per-person settings and the audit log, as rows. Runs on the store's worker thread."""

from __future__ import annotations

import json
from typing import Any

from bot.models import AuditEvent, UserPrefs, utcnow
from bot.models.keys import check_ssh_key
from store import quarantine
from store.quarantine import RowUnreadable
from store.sql import Db, immediate
from store.tx import ts


def get_prefs(db: Db, user: str) -> UserPrefs:
    """The saved settings (empty when there are none). A saved row that does not
    validate, keys included, is quarantined and raises `RowUnreadable`: deploying with
    other keys than the person saved would lock them out of the VM without a word."""
    rows = list(db.query('SELECT * FROM user_prefs WHERE "user" = ?', [user]))
    if not rows:
        return UserPrefs(user=user)
    reasons: list[str] = []

    def set_aside(row: dict[str, Any], reason: str) -> None:
        reasons.append(reason)
        quarantine.record(db, "user_prefs", user, None, reason, row)

    found, _bad = quarantine.sift(rows, _prefs_from_row, set_aside)
    if not found:
        raise RowUnreadable("user_prefs", user, reasons[0] if reasons else "unreadable")
    return found[0]


def _prefs_from_row(row: dict[str, Any]) -> UserPrefs:
    keys = json.loads(row["ssh_keys"])
    if not isinstance(keys, list):
        raise ValueError(f"ssh_keys: a list of keys was expected, not {type(keys).__name__}")
    for key in keys:
        if not isinstance(key, str) or check_ssh_key(key) != key:
            raise ValueError(f"ssh_keys: {str(key)[:60]!r} is not a saved public key")
    return UserPrefs.model_validate(
        {"user": row["user"], "ssh_keys": keys, "default_template": row["default_template"]}
    )


def put_prefs(db: Db, prefs: UserPrefs) -> None:
    with immediate(db):
        _write(db, prefs)


def add_key(db: Db, user: str, key: str, max_keys: int) -> UserPrefs | None:
    """Append a key (once) in one transaction; None when the user already has `max_keys`."""
    with immediate(db):
        db.lock(f"user_prefs:{user}")  # read, then write what was read
        try:
            prefs = get_prefs(db, user)
        except RowUnreadable:  # quarantined with its raw text: the new key replaces it
            prefs = UserPrefs(user=user)
        if any(_body(k) == _body(key) for k in prefs.ssh_keys):
            return prefs
        if len(prefs.ssh_keys) >= max_keys:
            return None
        prefs = prefs.model_copy(update={"ssh_keys": (*prefs.ssh_keys, key)})
        _write(db, prefs)
        return prefs


def _body(key: str) -> str:
    return " ".join(key.split()[:2])


def _write(db: Db, prefs: UserPrefs) -> None:
    db.execute(
        'INSERT INTO user_prefs ("user", ssh_keys, default_template, updated_at) '
        "VALUES (:user, :keys, :template, :at) "
        'ON CONFLICT ("user") DO UPDATE SET ssh_keys = :keys, '
        "default_template = :template, updated_at = :at",
        {
            "user": prefs.user,
            "keys": json.dumps(list(prefs.ssh_keys)),
            "template": prefs.default_template,
            "at": ts(utcnow()),
        },
    )


def add_audit(db: Db, event: AuditEvent) -> None:
    with immediate(db):
        db.execute(
            "INSERT INTO audit (at, actor, action, outcome, detail) VALUES (?, ?, ?, ?, ?)",
            [ts(event.at), event.actor, event.action, event.outcome, event.detail],
        )


def audit_events(db: Db, limit: int = 50) -> list[AuditEvent]:
    rows = db.query(
        "SELECT at, actor, action, outcome, detail FROM audit ORDER BY id DESC LIMIT ?", [limit]
    )
    return [AuditEvent.model_validate(row) for row in rows]
