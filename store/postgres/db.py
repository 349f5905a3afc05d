"""A `Db` (store/sql.py) on a psycopg connection.

The store's SQL is written with SQLite's placeholders; `pg_sql` rewrites them for psycopg
once per statement text. Transactions are READ COMMITTED, PostgreSQL's default: every
state change is one compare-and-set UPDATE, which PostgreSQL re-checks against the row
as a concurrent writer left it, so of two racing writers one wins and the other finds
its WHERE no longer true. The few functions that read and then write what they read
take an advisory lock (`lock`) first. (SERIALIZABLE was tried: on small tables
PostgreSQL locks whole relations for it, and a third of the deploys' transactions
failed with serialization errors at 30 concurrent deploys.)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from store.postgres.schema import CONSTRAINTS
from store.retry import Unavailable
from store.sql import ConstraintViolation, Params, Result, insert_sql

# Quoted text and identifiers pass through; `?`, `:name` and `%` are rewritten.
_TOKENS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|::|\?|:(\w+)|%")


@functools.lru_cache(maxsize=1024)
def pg_sql(sql: str) -> bytes:
    """SQLite's `?` and `:name` as psycopg's `%s` and `%(name)s` (and `%` as `%%`)."""

    def rewrite(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "?":
            return "%s"
        if token == "%":
            return "%%"
        if match.group(1):
            return f"%({match.group(1)})s"
        return token

    return _TOKENS.sub(rewrite, sql).encode()


def _value(value: Any) -> Any:
    # SQLite keeps booleans as integers, and so do the shared columns here.
    return int(value) if isinstance(value, bool) else value


def _params(params: Params) -> Params:
    if isinstance(params, Mapping):
        return {k: _value(v) for k, v in params.items()}
    return [_value(v) for v in params]


class PgDb:
    dialect = "postgres"
    Error = psycopg.Error

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    @property
    def in_transaction(self) -> bool:
        return self.conn.info.transaction_status != TransactionStatus.IDLE

    def execute(self, sql: str, params: Params = ()) -> Result:
        try:
            return self.conn.execute(pg_sql(sql), _params(params))
        except (errors.UniqueViolation, errors.ForeignKeyViolation) as exc:
            raise _conflict(exc) from exc

    def query(self, sql: str, params: Params = ()) -> list[dict[str, Any]]:
        with self.conn.cursor(row_factory=dict_row) as cursor:
            try:
                cursor.execute(pg_sql(sql), _params(params))
            except (errors.UniqueViolation, errors.ForeignKeyViolation) as exc:
                raise _conflict(exc) from exc
            return cursor.fetchall()

    def insert(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        with self.conn.cursor() as cursor:
            try:
                cursor.executemany(
                    pg_sql(insert_sql(table, list(rows[0]))), [_params(r) for r in rows]
                )
            except (errors.UniqueViolation, errors.ForeignKeyViolation) as exc:
                raise _conflict(exc) from exc

    def transaction(self) -> AbstractContextManager[None]:
        return self._transaction()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        if self.in_transaction:
            self.conn.execute(b"SAVEPOINT tx")
            try:
                yield
            except BaseException:
                self.conn.execute(b"ROLLBACK TO SAVEPOINT tx")
                self.conn.execute(b"RELEASE SAVEPOINT tx")
                raise
            self.conn.execute(b"RELEASE SAVEPOINT tx")
            return
        self.conn.execute(b"BEGIN")
        try:
            yield
        except BaseException:
            if not self.conn.closed:
                self.conn.execute(b"ROLLBACK")
            raise
        self._commit()

    def _commit(self) -> None:
        """A connection lost with no word from the server while COMMIT was on its way
        leaves the outcome unknown: it may have landed, so it must not be run again
        (store/retry.py); the server saying it shut the session down means it did not."""
        try:
            self.conn.execute(b"COMMIT")
        except psycopg.OperationalError as exc:
            if exc.sqlstate is not None:
                raise
            raise Unavailable(
                "the connection to PostgreSQL was lost while a write was being committed: "
                "it may or may not have been recorded"
            ) from exc

    def lock(self, name: str) -> None:
        self.conn.execute(b"SELECT pg_advisory_xact_lock(hashtext(%s))", [name])


def _conflict(exc: psycopg.Error) -> ConstraintViolation:
    if isinstance(exc, errors.ForeignKeyViolation):
        return ConstraintViolation("foreign key")
    name = exc.diag.constraint_name or ""
    return ConstraintViolation(CONSTRAINTS.get(name, name))
