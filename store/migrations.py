"""Schema versions. Each migration runs once, in order, recorded in `PRAGMA user_version`.

Append new migrations; never edit one that has shipped, because databases in the field
already ran it.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlite_utils import Database

from bot.models.builds import ACTIVE_BUILD_STATES
from bot.models.ids import new_installation_id
from store.sql import SqliteDb

# Jobs in these states held their VM name and address up to v8 (HOLDING_V9 since).
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
    """Many processes, one truth: who runs each job (runners and leases), a cancel asked
    by another process, and the installation this database belongs to."""
    db.table("meta").create({"key": str, "value": str}, pk="key", not_null={"value"})
    # Chosen once, when the database is created (or first migrated): the VMs' tags carry
    # it, so two installations sharing a cluster never take each other's VMs for orphans.
    db.table("meta").insert({"key": "installation_id", "value": new_installation_id()})
    db.table("runners").create(
        {
            "id": str,
            "kind": str,
            "host": str,
            "pid": int,
            "proc_start": str,
            "started_at": str,
            "heartbeat_at": str,
            "lease_until": str,
            "stopped_at": str,
        },
        pk="id",
        not_null={"kind", "host", "pid", "started_at", "heartbeat_at", "lease_until"},
    )
    for column in ("owner", "lease_until", "installation", "cancel_requested"):
        db.table("jobs").add_column(column, str)
    db.table("jobs").create_index(["owner"])
    db.table("jobs").create_index(["state", "lease_until"])


def _v5(db: Database) -> None:
    """The outbox (store/outbox.py): what chat must still be told, and who tells it."""
    db.table("outbox").create(
        {
            "id": int,
            "job_id": str,
            "kind": str,
            "urgent": int,
            "body": str,
            "created_at": str,
            "delivered_at": str,
        },
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
        not_null={"job_id", "kind", "urgent", "body", "created_at"},
    )
    db.table("outbox").create_index(["job_id", "id"])
    db.table("outbox").create_index(["delivered_at", "id"])
    db.table("outbox_claims").create(
        {"job_id": str, "holder": str, "until": str}, pk="job_id", not_null={"holder", "until"}
    )


def _v6(db: Database) -> None:
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


def _v7(db: Database) -> None:
    """Commands received from chat and not yet carried out (store/inbox.py)."""
    db.table("inbox").create(
        {
            "key": str,
            "user_id": str,
            "channel": str,
            "body": str,
            "received_at": str,
            "holder": str,
            "until": str,
            "done_at": str,
        },
        pk="key",
        not_null={"user_id", "channel", "body", "received_at"},
    )
    db.table("inbox").create_index(["done_at", "until"])


def _v8(db: Database) -> None:
    """A job's address as the IPAM records it (bot/addresses/allocation.py)."""
    for column in ("ipam_ref", "ipam_state"):
        db.table("jobs").add_column(column, str)
    db.table("jobs").create_index(["ipam_state", "state"])


# From v9 on a job on its way to being destroyed holds its name and address too.
HOLDING_V9 = (
    "('awaiting_approval', 'queued', 'running', 'rolling_back', 'succeeded', "
    "'destroy_requested', 'destroying')"
)
DESTROY_COLUMNS = (
    "destroy_by",
    "destroy_asked_at",
    "destroy_approver",
    "destroyed_at",
    "destroy_ref",
)


def _v9(db: Database) -> None:
    """Destroys (bot/kinds/deploy/destroy.py): who asked, who approved, when it was gone; and the
    unique indexes widened to the destroy states, whose VMs still exist."""
    for column in DESTROY_COLUMNS:
        db.table("jobs").add_column(column, str)
    db.execute("DROP INDEX jobs_active_name")
    db.execute("DROP INDEX jobs_active_address")
    db.execute(
        f"CREATE UNIQUE INDEX jobs_active_name ON jobs(backend, name) WHERE state IN {HOLDING_V9}"
    )
    db.execute(
        f"CREATE UNIQUE INDEX jobs_active_address ON jobs(address) WHERE state IN {HOLDING_V9}"
    )


# From v10 on a job whose lease ended holds them too: its VM is powered off, not gone.
HOLDING_V10 = HOLDING_V9[:-1] + ", 'expired_off')"
LEASE_COLUMNS = {"lease_s": int, "expires_at": str, "reminders_sent": str, "powered_off_at": str}


def _v10(db: Database) -> None:
    """Leases (bot/leases/enforce.py): how long, until when, which reminders went out, when the
    VM was powered off; the unique indexes widened to `expired_off`."""
    for column, kind in LEASE_COLUMNS.items():
        db.table("jobs").add_column(column, kind)
    db.execute("DROP INDEX jobs_active_name")
    db.execute("DROP INDEX jobs_active_address")
    db.execute(
        f"CREATE UNIQUE INDEX jobs_active_name ON jobs(backend, name) WHERE state IN {HOLDING_V10}"
    )
    db.execute(
        f"CREATE UNIQUE INDEX jobs_active_address ON jobs(address) WHERE state IN {HOLDING_V10}"
    )
    db.execute("CREATE INDEX idx_jobs_state_expires_at ON jobs (state, expires_at)")


# Template builds (bot/kinds/build/): one row per build, its own table since it has no
# address and no VM of a chat user. `version` is the only integer column.
BUILD_COLUMNS = [
    "id", "state", "requester", "profile", "backend", "name", "version", "placement",
    "storage", "created_at", "updated_at", "started_at", "finished_at", "vm_id",
    "vm_placement", "cpu", "source_digest", "smoke_job", "step", "failed_step", "error",
    "wreckage", "notes", "owner", "lease_until", "installation", "origin", "thread_ref",
    "cancel_requested",
]  # fmt: skip
# The index that lets one build of a name per backend be in flight (and keeps two from
# taking one version number), spelled once for both databases' migrations.
_BUILDS_IN_FLIGHT = ", ".join(f"'{s.value}'" for s in sorted(ACTIVE_BUILD_STATES))
BUILDS_ACTIVE_INDEX = (
    "CREATE UNIQUE INDEX builds_active ON builds (backend, name) "
    f"WHERE state IN ({_BUILDS_IN_FLIGHT})"
)
BUILD_NOT_NULL = ("state", "requester", "profile", "backend", "name", "version", "created_at",
                  "updated_at", "notes")  # fmt: skip


def _v11(db: Database) -> None:
    """Template builds: the table, and the index that lets one build of a name per
    backend be in flight (which also keeps two from taking one version number)."""
    db.table("builds").create(
        {c: int if c == "version" else str for c in BUILD_COLUMNS},
        pk="id",
        not_null=set(BUILD_NOT_NULL),
    )
    db.execute("CREATE UNIQUE INDEX builds_version ON builds (backend, name, version)")
    db.execute(BUILDS_ACTIVE_INDEX)
    db.execute("CREATE INDEX idx_builds_state ON builds (state, lease_until)")


# A build's approval (bot/kinds/build/service.py), kept on its row (schema v12).
BUILD_APPROVAL_COLUMNS = ("approval_reason", "decided_by", "decided_at", "approval_ref")


def _v12(db: Database) -> None:
    """Template builds from chat: their approval on the build's row, and the outbox
    without its foreign key to `jobs`, since a build's notices name the build (its id
    starts with `b`); store/outbox.add checks that the job or build exists instead."""
    for column in BUILD_APPROVAL_COLUMNS:
        db.table("builds").add_column(column, str)
    db.table("outbox").transform(drop_foreign_keys=["job_id"])


def _v13(db: Database) -> None:
    """Each part of a notice recorded as it reaches chat (store/outbox.py): its names,
    space-separated, so a restart repeats only the parts not yet delivered."""
    db.table("outbox").add_column("parts_sent", str)


def _v14(db: Database) -> None:
    """Each job's claim epoch, its fencing token (bot/models.Claim, store/owners.py)."""
    db.execute("ALTER TABLE jobs ADD COLUMN claim_epoch INTEGER NOT NULL DEFAULT 0")


# Each job's kind (bot/kinds/): rows from before kinds were data are deploys (their
# destroys are a phase of the deploy kind). Builds keep their own table: their kind is
# the table's (store/jobs.kind_of).
KIND_COLUMN = "ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'deploy'"


def _v15(db: Database) -> None:
    """Each job's kind as a column: what runs and recovers it is looked up, never read
    from its id."""
    db.execute(KIND_COLUMN)


# How the host key in `jobs.host_key` was confirmed ("agent", "chosen", "ssh":
# bot/models.HostKeySource); that column holds the public key line since, a fingerprint
# ("SHA256:...", no source) in older rows.
HOST_KEY_SOURCE_COLUMN = "ALTER TABLE jobs ADD COLUMN host_key_source TEXT"


def _v16(db: Database) -> None:
    """How each job's host key was confirmed (issue 28)."""
    db.execute(HOST_KEY_SOURCE_COLUMN)


# The host certificate deploybot's host CA signed for the job's VM (bot/sshca/): one
# public line, None without a CA or for a key that could not be confirmed.
HOST_CERTIFICATE_COLUMN = "ALTER TABLE jobs ADD COLUMN host_certificate TEXT"


def _v17(db: Database) -> None:
    """Each job's host certificate (issue 28, item 3)."""
    db.execute(HOST_CERTIFICATE_COLUMN)


# Migration plans made from chat, kept until applied by id (bot/migration/, schema v18),
# spelled once for both databases.
MIGRATION_PLANS_TABLE = (
    "CREATE TABLE migration_plans (id TEXT PRIMARY KEY, digest TEXT NOT NULL, "
    "document TEXT NOT NULL, created_at TEXT NOT NULL, created_by TEXT NOT NULL)"
)


def _v18(db: Database) -> None:
    """Migration plans kept in the store (issue 30): chat has no plan file."""
    db.execute(MIGRATION_PLANS_TABLE)


# Every NIC's address and fixed MAC of every job (issue 29, schema v19): one row per NIC
# (`nic` 0 is the first, whose address is also `jobs.address`), with the job's state
# copied by a trigger in the same statement that moves the job, so that the unique
# indexes over the live ones decide between racing requests in the insert's transaction,
# as `jobs_active_address` does for the first address (an index cannot look into another
# table).
JOB_ADDRESSES = [
    "CREATE TABLE job_addresses (job_id TEXT NOT NULL, nic INTEGER NOT NULL, ip TEXT NOT NULL, "
    "mac TEXT, state TEXT NOT NULL, PRIMARY KEY (job_id, nic))",
    f"CREATE UNIQUE INDEX job_addresses_ip ON job_addresses (ip) WHERE state IN {HOLDING_V10}",
    f"CREATE UNIQUE INDEX job_addresses_mac ON job_addresses (mac) WHERE state IN {HOLDING_V10}",
    "CREATE INDEX idx_job_addresses_ip ON job_addresses (ip)",
    "INSERT INTO job_addresses (job_id, nic, ip, mac, state) "
    "SELECT id, 0, address, NULL, state FROM jobs",
]


def _v19(db: Database) -> None:
    """Every NIC's address and fixed MAC, unique among live jobs (issue 29)."""
    for statement in JOB_ADDRESSES:
        db.execute(statement)
    db.execute(
        "CREATE TRIGGER job_addresses_state AFTER UPDATE OF state ON jobs "
        "WHEN OLD.state IS NOT NEW.state BEGIN "
        "UPDATE job_addresses SET state = NEW.state WHERE job_id = NEW.id; END"
    )


# Migration applies asked from chat (issue 30, schema v20), kept until their last build
# ends (store/applies.py): the rebuilds as the apply found them (JSON), and its builds
# by id, looked up by build when one ends.
MIGRATION_APPLIES = [
    "CREATE TABLE migration_applies (id TEXT PRIMARY KEY, plan_id TEXT NOT NULL, "
    "requester TEXT NOT NULL, origin TEXT NOT NULL, rebuilds TEXT NOT NULL, "
    "created_at TEXT NOT NULL, ended_at TEXT)",
    "CREATE TABLE migration_apply_builds (apply_id TEXT NOT NULL, build_id TEXT NOT NULL, "
    "PRIMARY KEY (apply_id, build_id))",
    "CREATE INDEX idx_migration_apply_builds_build ON migration_apply_builds (build_id)",
]


def _v20(db: Database) -> None:
    """Migration applies asked from chat, whose end is told once their builds end."""
    for statement in MIGRATION_APPLIES:
        db.execute(statement)


MIGRATIONS: list[Callable[[Database], None]] = [
    _v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11, _v12, _v13, _v14, _v15, _v16,
    _v17, _v18, _v19, _v20,
]  # fmt: skip
SCHEMA_VERSION = len(MIGRATIONS)


def newer_schema(version: int) -> RuntimeError:
    """A database migrated by a newer deploybot: this one must not write to it."""
    return RuntimeError(
        f"the database is at schema version {version}, newer than this deploybot "
        f"({SCHEMA_VERSION}): upgrade deploybot or point it at another database"
    )


def _version(db: Database) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def migrate(db: Database) -> int:
    """Bring the schema to the newest version; returns how many migrations ran.

    Each step re-reads the version inside its own write transaction: two processes
    starting together on a new file both see version 0 before either writes, and the
    second must then find the step done instead of creating the same table again."""
    start = _version(db)
    if start > SCHEMA_VERSION:
        raise newer_schema(start)
    ran = 0
    for version in range(start, SCHEMA_VERSION):
        with SqliteDb(db.conn).transaction():
            if _version(db) > version:
                continue  # another process ran it meanwhile
            MIGRATIONS[version](db)
            db.execute(f"PRAGMA user_version = {version + 1}")
            ran += 1
    return ran
