"""Transactions on an autocommit connection."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any


def ts(moment: datetime) -> str:
    """One fixed-width UTC format, so text order is time order in every query."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[None]:
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


def insert(conn: sqlite3.Connection, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """INSERT rows that share their keys, as one prepared statement.

    The hot paths (a job, its step events) use this instead of sqlite-utils'
    Table.insert, which reads the schema on every call (two sqlite_master queries and a
    savepoint): with 200 concurrent deploys that was a third of the store's time, and
    the store's one thread is what every deploy waits on. `table` and the keys come
    from our own models, never from users."""
    if not rows:
        return
    columns = list(rows[0])
    names, marks = ", ".join(columns), ", ".join(f":{c}" for c in columns)
    conn.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)


def returning(
    conn: sqlite3.Connection, sql: str, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Rows of a statement with RETURNING, as dicts (without sqlite-utils' savepoint)."""
    cursor = conn.execute(sql, params)
    rows = cursor.fetchall()
    columns = [d[0] for d in cursor.description]
    return [dict(zip(columns, row, strict=True)) for row in rows]
