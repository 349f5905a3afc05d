"""Records of `deploybot gc` runs: what a dry run listed, so an apply can check it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from bot.models import utcnow
from store.sql import Db, immediate
from store.tx import ts


def record_gc_run(db: Db, scope: Sequence[str], vm_keys: Sequence[str], *, applied: bool) -> None:
    row = {
        "at": ts(utcnow()),
        "scope": ",".join(sorted(scope)),
        "applied": int(applied),
        "vm_keys": json.dumps(sorted(vm_keys)),
    }
    with immediate(db):
        db.insert("gc_runs", [row])


def last_gc_dry_run(db: Db, scope: Sequence[str], *, since: datetime) -> set[str] | None:
    """The VM keys the newest dry run of exactly this scope listed, if it is recent."""
    rows = list(
        db.query(
            "SELECT vm_keys FROM gc_runs WHERE scope = ? AND applied = 0 AND at >= ? "
            "ORDER BY at DESC LIMIT 1",
            [",".join(sorted(scope)), ts(since)],
        )
    )
    return set(json.loads(rows[0]["vm_keys"])) if rows else None
