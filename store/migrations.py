"""Schema versions. Each migration runs once, in order, recorded in `PRAGMA user_version`.

Append new migrations; never edit one that has shipped, because databases in the field
already ran it.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlite_utils import Database

from store.tx import immediate

# Jobs in these states hold their VM name and address (bot.models.HOLDING_STATES).
_HOLDING = "('awaiting_approval', 'queued', 'running', 'rolling_back', 'succeeded')"


def _v1(db: Database) -> None:
    db.table("jobs").create(
        {
            "id": str,
            "state": str,
            "requester": str,
            "name": str,
            "address": str,
            "backend": str,
            "request": str,
            "created_at": str,
            "updated_at": str,
            "started_at": str,
            "finished_at": str,
            "vm_id": str,
            "vm_placement": str,
            "final_address": str,
            "failed_step": str,
            "error": str,
            "wreckage": str,
            "approval_reason": str,
        },
        pk="id",
        not_null={
            "state",
            "requester",
            "name",
            "address",
            "backend",
            "request",
            "created_at",
            "updated_at",
        },
    )
    for columns in (
        ["requester", "created_at"],
        ["state", "created_at"],
        ["name", "created_at"],
        ["address", "created_at"],
    ):
        db.table("jobs").create_index(columns)
    db.table("jobs").create_index(["created_at"])
    # The store, not a read-then-write check, keeps two live jobs off one name or address.
    db.execute(
        f"CREATE UNIQUE INDEX jobs_active_name ON jobs(backend, name) WHERE state IN {_HOLDING}"
    )
    db.execute(
        f"CREATE UNIQUE INDEX jobs_active_address ON jobs(address) WHERE state IN {_HOLDING}"
    )
    db.table("job_events").create(
        {
            "id": int,
            "job_id": str,
            "at": str,
            "step": str,
            "phase": str,
            "duration_s": float,
            "detail": str,
        },
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
        not_null={"job_id", "at", "step", "phase"},
    )
    db.table("job_events").create_index(["job_id", "id"])
    db.table("approvals").create(
        {
            "job_id": str,
            "state": str,
            "reason_required": str,
            "requested_at": str,
            "expires_at": str,
            "decided_by": str,
            "decided_at": str,
            "note": str,
        },
        pk="job_id",
        foreign_keys=[("job_id", "jobs", "id")],
        not_null={"state", "requested_at", "expires_at"},
    )
    db.table("approvals").create_index(["state", "expires_at"])


def _v2(db: Database) -> None:
    # The host key fingerprint read by the SSH check, shown with the SSH line.
    db.table("jobs").add_column("host_key", str)
    # Dry runs and applies of `deploybot gc`: an apply needs a recent dry run of its scope.
    db.table("gc_runs").create(
        {"id": int, "at": str, "scope": str, "applied": int, "vm_keys": str},
        pk="id",
        not_null={"at", "scope", "applied", "vm_keys"},
    )
    db.table("gc_runs").create_index(["scope", "applied", "at"])


def _v3(db: Database) -> None:
    """Front-end references on jobs, idempotency keys, per-user settings, an audit log."""
    for column in ("origin", "thread_ref", "approval_ref"):
        db.table("jobs").add_column(column, str)
    # One row per handled delivery (a command, a click): its primary key is what makes a
    # redelivered request fail inside the same transaction that would act on it twice.
    db.table("deliveries").create(
        {"key": str, "job_id": str, "action": str, "at": str},
        pk="key",
        not_null={"job_id", "action", "at"},
    )
    db.table("user_prefs").create(
        {"user": str, "ssh_keys": str, "default_template": str, "updated_at": str},
        pk="user",
        not_null={"ssh_keys", "updated_at"},
    )
    db.table("audit").create(
        {"id": int, "at": str, "actor": str, "action": str, "outcome": str, "detail": str},
        pk="id",
        not_null={"at", "actor", "action", "outcome"},
    )
    db.table("audit").create_index(["actor", "at"])


def _v4(db: Database) -> None:
    """Rows that failed validation when read (store/quarantine.py), and approvals closed
    by a cancel."""
    db.table("quarantine").create(
        {
            "id": int,
            "table_name": str,
            "row_key": str,
            "job_id": str,
            "reason": str,
            "at": str,
            "raw": str,
        },
        pk="id",
        not_null={"table_name", "row_key", "reason", "at"},
    )
    # One record per row, however often it is read.
    db.execute("CREATE UNIQUE INDEX quarantine_row ON quarantine(table_name, row_key)")
    db.table("quarantine").create_index(["job_id"])
    # A cancel now closes the approval with the job (state 'cancelled'); close those that
    # earlier versions left pending, so no listing of pending approvals shows them.
    db.execute(
        "UPDATE approvals SET state = 'cancelled' WHERE state = 'pending' "
        "AND job_id IN (SELECT id FROM jobs WHERE state = 'cancelled')"
    )


MIGRATIONS: list[Callable[[Database], None]] = [_v1, _v2, _v3, _v4]
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(db: Database) -> int:
    """Bring the schema to the newest version; returns how many migrations ran."""
    current = int(db.execute("PRAGMA user_version").fetchone()[0])
    if current > SCHEMA_VERSION:
        raise RuntimeError(
            f"the database is at schema version {current}, newer than this deploybot "
            f"({SCHEMA_VERSION}): upgrade deploybot or point it at another database"
        )
    for version in range(current, SCHEMA_VERSION):
        with immediate(db.conn):
            MIGRATIONS[version](db)
            db.execute(f"PRAGMA user_version = {version + 1}")
    return SCHEMA_VERSION - current
