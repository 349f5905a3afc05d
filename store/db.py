"""The job history: one `Store` on either database.

SQLite is the default: one file, nothing to run (store/engine.py). For several replicas
deploybot uses PostgreSQL (store/postgres/). Both run the same store functions
(store/jobs.py, owners.py ...), so the same compare-and-sets decide the same races.
"""

from __future__ import annotations

from pathlib import Path

from store.engine import BUSY_TIMEOUT_MS, Engine, SqliteEngine
from store.jobs import AlreadyDelivered, DuplicateActive
from store.quarantine import Quarantined, RowUnreadable
from store.repositories import (
    Addresses,
    Approvals,
    Audit,
    Builds,
    GcRuns,
    Inbox,
    Jobs,
    Leases,
    MigrationApplies,
    MigrationPlans,
    Outbox,
    People,
    Runners,
)
from store.repository import Wake
from store.retry import RetryPolicy
from store.sql import Db

__all__ = ["AlreadyDelivered", "DuplicateActive", "Quarantined", "RowUnreadable", "Store"]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(database: str | Path) -> bool:
    return isinstance(database, str) and database.startswith(POSTGRES_SCHEMES)


class Store:
    """Async access to the history. Open with `await Store.open(database)`, close when done.

    It holds one repository per table or tight group of tables (store/repositories.py):
    `store.jobs.get(job_id)`, `store.approvals.decide(...)`, `store.outbox.claim(...)`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.label = engine.label
        # Made with the database and never changed: VM tags carry it (store/migrations).
        self.installation_id = engine.installation_id
        # A front end that delivers the outbox sets `wake.on_notice`: told when this
        # process kept a notice, so it need not wait for its next look to deliver it.
        self.wake = Wake()
        self.jobs = Jobs(engine, self.wake)
        self.runners = Runners(engine, self.wake)
        self.leases = Leases(engine, self.wake)
        self.addresses = Addresses(engine, self.wake)
        self.approvals = Approvals(engine, self.wake)
        self.outbox = Outbox(engine, self.wake)
        self.inbox = Inbox(engine, self.wake)
        self.people = People(engine, self.wake)
        self.audit = Audit(engine, self.wake)
        self.gc_runs = GcRuns(engine, self.wake)
        self.builds = Builds(engine, self.wake)
        self.migration_plans = MigrationPlans(engine, self.wake)
        self.migration_applies = MigrationApplies(engine, self.wake)

    @classmethod
    async def open(
        cls,
        database: str | Path,
        *,
        password: str | None = None,
        retry: RetryPolicy | None = None,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    ) -> Store:
        """A path (or ":memory:") opens SQLite; a postgresql:// URL opens PostgreSQL, with
        `password` (from the environment: never in the URL, the config or a log).
        `retry`: how long a write that could not reach the database is run again
        (store/retry.py); `busy_timeout_ms`: SQLite's wait for another process's lock."""
        if is_postgres(database):
            from store.postgres import PostgresEngine  # psycopg only when it is used

            return cls(await PostgresEngine.open(str(database), password=password, retry=retry))
        engine = await SqliteEngine.open(
            Path(database), retry=retry, busy_timeout_ms=busy_timeout_ms
        )
        return cls(engine)

    async def close(self) -> None:
        await self.engine.close()

    async def integrity_check(self) -> str:
        return await self.engine.integrity_check()

    async def ping(self, wait_s: float = 1.0) -> None:
        """Whether the database could record something now; raises what its driver
        raises. Asked inside a write transaction: on SQLite that takes the file's write
        lock (BEGIN IMMEDIATE, then rolled back, nothing written), so a file another
        process holds locked answers "database is locked" after `wait_s`, where a bare
        SELECT 1 (which reads no page) would answer at once."""
        await self.engine.call(_can_write, wait_s)


def _can_write(db: Db, wait_s: float) -> None:
    if db.dialect != "sqlite":
        with db.transaction():
            db.query("SELECT 1 AS one")
        return
    # Waiting no longer than `wait_s`: the store's one thread is not held by a probe.
    (usual_ms,) = db.execute("PRAGMA busy_timeout").fetchone()
    db.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
    try:
        with db.transaction():
            db.query("SELECT 1 AS one")
    finally:
        db.execute(f"PRAGMA busy_timeout = {int(usual_ms)}")
