"""Where the store's functions run: the `Engine` each database provides.

Every store function is a plain function of a `Db` (store/sql.py). An engine runs one on
a connection of its database, off the event loop: `call` alone, `write` possibly batched
with the writes of the same moment. SQLite's engine is below; PostgreSQL's is in
store/postgres/.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from sqlite_utils import Database

from store.migrations import migrate
from store.owners import installation_id
from store.retry import RetryPolicy, Unavailable, retrying
from store.sql import Db, SqliteDb
from store.writer import Writer

P = ParamSpec("P")
T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 (an item of a merged write)
BUSY_TIMEOUT_MS = 10_000
WAL_ATTEMPTS = 100


def is_database_error(exc: BaseException) -> bool:
    """Whether `exc` came from the database or its driver (SQLite, psycopg, its pool),
    as when the server stopped answering in the middle of a write."""
    root = type(exc).__module__.split(".")[0]
    return isinstance(exc, (Unavailable, sqlite3.Error)) or root in ("psycopg", "psycopg_pool")


class Engine(Protocol):
    """Runs store functions on a database. Contract:

    - `call(fn, ...)` runs `fn(db, ...)` on a connection of its own and answers its
      result or raises its exception; `fn` makes its own transactions (store/sql.py).
    - `write(fn, ...)` is the same for the writes every deploy makes; an engine may
      batch those that arrive together, but answers each only once it is committed.
    - `write_merged(fn, item)` is `write` of `fn(db, [item])[0]` for a set-based `fn`
      (one result per item, in order: `store.jobs.add_events`); an engine may run the
      items of the same moment as one `fn(db, items)`, a fixed number of statements
      for all of them. If that call fails, each item is run again alone, so a failure
      (a row that is gone) reaches only its own caller.
      A write that failed because the database could not be reached is run again from
      the start for up to its `RetryPolicy`'s window (store/retry.py); `call` is not
      (reads, renewals and probes must fail fast: their loops ask again anyway).
    - The answer is what the database holds: a write answered is durable.
    """

    installation_id: str
    label: str  # the database as people may see it: a path, or a URL without secrets

    async def call(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T: ...

    async def write(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T: ...

    async def write_merged(self, fn: Callable[[Db, list[I]], list[T]], item: I) -> T: ...

    async def integrity_check(self) -> str:
        """'ok', or what the database says is wrong with itself."""
        ...

    async def close(self) -> None: ...


def _connect(path: Path, busy_timeout_ms: int) -> sqlite3.Connection:
    if str(path) != ":memory:":
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created 0600 before SQLite opens it: the history names people and machines.
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
    conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    # Text that is not UTF-8 (written by another tool) would fail the whole query that
    # meets it; decoded with replacement characters, its row fails validation instead and
    # is quarantined alone (store/quarantine.py).
    conn.text_factory = _decode
    _into_wal(conn)
    for pragma in (
        "foreign_keys = ON",
        f"busy_timeout = {busy_timeout_ms}",
        "synchronous = NORMAL",
    ):
        conn.execute(f"PRAGMA {pragma}")
    migrate(Database(conn))
    return conn


def _into_wal(conn: sqlite3.Connection) -> None:
    """Switching a new file to WAL needs it to itself for a moment, and SQLite answers
    "database is locked" without waiting when another process is creating the schema
    (its busy handler is not used there): try again for a while."""
    for attempt in range(WAL_ATTEMPTS):
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == WAL_ATTEMPTS - 1:
                raise
            time.sleep(0.01 * (attempt + 1))  # on the store's thread, before it serves


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class SqliteEngine:
    """One SQLite file in WAL mode, owned by one worker thread.

    SQLite calls block, and the bot is one event loop serving many deploys; so every call
    runs on a single dedicated thread that owns the connection. One thread also means
    this process never contends with itself for the write lock; other processes on the
    same file (a CLI next to the server) are handled by SQLite's busy timeout and BEGIN
    IMMEDIATE."""

    def __init__(
        self,
        path: Path,
        executor: ThreadPoolExecutor,
        conn: sqlite3.Connection,
        retry: RetryPolicy,
    ) -> None:
        self.label = str(path)
        self.db = SqliteDb(conn)
        self._executor = executor
        self._writer = Writer(executor, conn)
        self._retry = retry
        self.installation_id = ""

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        retry: RetryPolicy | None = None,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    ) -> SqliteEngine:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deploybot-store")
        loop = asyncio.get_running_loop()
        try:
            conn = await loop.run_in_executor(executor, _connect, path, busy_timeout_ms)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        engine = cls(path, executor, conn, retry or RetryPolicy())
        engine.installation_id = await engine.call(installation_id)
        return engine

    async def call(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Reads, and writes that are rare: on the store's thread, alone."""
        return await self._writer.call(fn, self.db, *args, **kwargs)

    async def write(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Batched with the writes made at the same moment (store/writer.py); run again
        in a later batch while the file is locked past the busy timeout (store/retry.py).
        A failed batch rolled back whole, so each of its writes is run again alone."""

        async def attempt(left_s: float) -> T:
            # The wait for another process's lock is part of the window, not added to it
            # (a window of 0, no retries, keeps the busy timeout).
            wait_s = left_s if self._retry.window_s > 0 else None
            return await self._writer.write_within(wait_s, fn, self.db, *args, **kwargs)

        return await retrying(attempt, self._retry, self.label)

    async def write_merged(self, fn: Callable[[Db, list[I]], list[T]], item: I) -> T:
        """`write`, merged with the batch's other items of `fn` (store/writer.py)."""

        async def attempt(left_s: float) -> T:
            wait_s = left_s if self._retry.window_s > 0 else None
            return await self._writer.write_merged(wait_s, fn, self.db, item)

        return await retrying(attempt, self._retry, self.label)

    async def integrity_check(self) -> str:
        return await self.call(lambda db: str(db.execute("PRAGMA integrity_check").fetchone()[0]))

    async def close(self) -> None:
        await self._writer.close()
        await self._writer.call(self.db.conn.close)
        self._executor.shutdown(wait=True)
