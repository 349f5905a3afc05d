"""Transactions on an autocommit connection."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime


def ts(moment: datetime) -> str:
    """One fixed-width UTC format, so text order is time order in every query."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE takes the write lock up front, so a read-then-write inside the
    transaction cannot be overtaken by another writer (and SQLite's busy timeout applies
    at BEGIN instead of failing later with 'database is locked')."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
