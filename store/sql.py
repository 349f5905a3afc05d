"""One way to speak SQL to either database, so every query is written once.

The store's functions (store/jobs.py, owners.py, outbox.py ...) are plain synchronous
functions of a `Db`: SQLite runs them on its one thread (store/db.py), PostgreSQL on
pooled connections in worker threads (store/postgres/). Both therefore run the very same
statements and compare-and-sets, and the store contract tests run on both.

The SQL is written as SQLite takes it (`?` and `:name` placeholders); the PostgreSQL
`Db` rewrites the placeholders for psycopg. Written so, it must also be valid
PostgreSQL: no SQLite-only functions, `"user"` quoted, `ON CONFLICT` rather than
`INSERT OR ...`. A constraint that refuses a write raises `ConstraintViolation` on both, naming
what it protects as `table.column`, so callers never parse a driver's message.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from bot.models.errors import InternalSignal, StoreError

Params = Sequence[Any] | Mapping[str, Any]


class ConstraintViolation(StoreError):
    """A UNIQUE, PRIMARY KEY or FOREIGN KEY constraint refused a write. `what` names it:
    'jobs.address', 'jobs.backend, jobs.name', 'deliveries.key' ... or 'foreign key'."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class NotMoved(InternalSignal):
    """A compare-and-set found the row in another state: raised inside the transaction
    to roll back what it wrote before (a delivery's claim, an approval row), and caught
    by the store function that began it, which answers that nothing moved."""


class Result(Protocol):
    """What `Db.execute` answers (a DB-API cursor of either driver)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Db(Protocol):
    """A connection as the store's functions use it. Not thread-safe: one caller at a time."""

    @property
    def dialect(self) -> str:
        """ "sqlite" | "postgres": for the rare statement the two spell differently."""
        ...

    @property
    def Error(self) -> type[Exception]:
        """The driver's base error."""
        ...

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, params: Params = ()) -> Result: ...

    def query(self, sql: str, params: Params = ()) -> list[dict[str, Any]]:
        """The rows as dicts keyed by column name."""
        ...

    def insert(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """INSERT rows that share their keys (`table` and keys are ours, never users')."""
        ...

    def transaction(self) -> AbstractContextManager[None]:
        """All or nothing; inside a transaction already, a savepoint. Every state change
        is one compare-and-set statement (an UPDATE naming what it expects), which is
        safe on both databases; a function that reads and then writes what it read
        takes `lock` first."""
        ...

    def lock(self, name: str) -> None:
        """Inside a transaction: wait until no other transaction holds `name`, and hold
        it until this one ends. (SQLite's BEGIN IMMEDIATE holds the whole database.)"""
        ...


def immediate(db: Db) -> AbstractContextManager[None]:
    """The store functions' transaction (named for SQLite's BEGIN IMMEDIATE)."""
    return db.transaction()


def insert_sql(table: str, columns: Sequence[str]) -> str:
    names, marks = ", ".join(columns), ", ".join(f":{c}" for c in columns)
    return f"INSERT INTO {table} ({names}) VALUES ({marks})"


class SqliteDb:
    """A `Db` on an autocommit sqlite3 connection."""

    dialect = "sqlite"
    Error = sqlite3.Error

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def execute(self, sql: str, params: Params = ()) -> Result:
        try:
            return self.conn.execute(sql, params)
        except sqlite3.IntegrityError as exc:
            raise ConstraintViolation(_sqlite_what(exc)) from exc

    def query(self, sql: str, params: Params = ()) -> list[dict[str, Any]]:
        cursor = self.execute(sql, params)
        rows = cursor.fetchall()
        columns = [d[0] for d in cursor.description]  # type: ignore[attr-defined]
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def insert(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """One prepared statement for all rows. The hot paths (a job, its step events)
        use this rather than sqlite-utils' Table.insert, which reads the schema on every
        call: with 200 concurrent deploys that was a third of the store's time."""
        if not rows:
            return
        try:
            self.conn.executemany(insert_sql(table, list(rows[0])), rows)
        except sqlite3.IntegrityError as exc:
            raise ConstraintViolation(_sqlite_what(exc)) from exc

    def transaction(self) -> AbstractContextManager[None]:
        return _sqlite_transaction(self.conn)

    def lock(self, name: str) -> None:
        pass  # one writer at a time already


def _sqlite_what(exc: sqlite3.IntegrityError) -> str:
    # "UNIQUE constraint failed: jobs.backend, jobs.name" / "FOREIGN KEY constraint failed"
    text = str(exc)
    if "FOREIGN KEY" in text:
        return "foreign key"
    return text.partition(": ")[2] or text


@contextmanager
def _sqlite_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE takes the write lock up front, so a read-then-write inside the
    transaction cannot be overtaken by another writer (and SQLite's busy timeout applies
    at BEGIN instead of failing later with 'database is locked').

    Inside a transaction already (writes batched by store/writer.py) it is a savepoint:
    the same all-or-nothing, within the batch's transaction."""
    if conn.in_transaction:
        conn.execute("SAVEPOINT tx")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK TO tx")
            conn.execute("RELEASE tx")
            raise
        conn.execute("RELEASE tx")
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
