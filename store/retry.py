"""Writes that meet a database which is not answering are run again, for a while.

A write is one store function, and a store function is one transaction (store/sql.py):
if the connection fails under it, the database rolled it back, so running the whole
function again from the start (fresh reads, the same compare-and-set) lands its state
change, its events and its notices once, or not at all. What is retried is only what
says the database could not be reached: a lost or refused connection, a server
shutting down, SQLite's lock held past its busy timeout, a transient I/O error, a file
that became read-only (an operator can make it writable again within the window; until
then nothing can be recorded, as when the server is down). A
constraint that refused a write (`ConstraintViolation`) or a compare-and-set that found another
state are answers, and are never retried. Nor is a connection lost during COMMIT: the
transaction may have landed, and running it again could land it twice (`Unavailable`
then says so).

The window is `[store] write_retry_s`; past it, the caller hears `Unavailable` naming the
database and its last error.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from bot.models.errors import StoreError

T = TypeVar("T")
log = logging.getLogger(__name__)

# SQLite's result codes (extended ones start with these) that mean "not now".
_SQLITE_LOCKED = ("SQLITE_BUSY", "SQLITE_LOCKED")
_SQLITE_TRANSIENT = (*_SQLITE_LOCKED, "SQLITE_IOERR", "SQLITE_READONLY")
# What an operator should look at, by SQLite's result code.
_SQLITE_HINTS = {
    "SQLITE_BUSY": "another process holds the file's write lock (a sqlite3 shell or a "
    "backup in a transaction?)",
    "SQLITE_LOCKED": "another process holds the file's write lock",
    "SQLITE_READONLY": "the file, its -wal and -shm files or their directory are not "
    "writable by this process: check their owner and mode, and whether the filesystem "
    "is mounted read-only",
    "SQLITE_IOERR": "the disk refused a read or write: check the filesystem (mounted "
    "read-only after errors? full? an immutable file, lsattr?)",
}
# PostgreSQL's SQLSTATEs of a server going away: class 08 (connection exception),
# admin_shutdown, crash_shutdown, cannot_connect_now. A client-side failure (refused,
# closed, lost) has no SQLSTATE at all.
_PG_SHUTDOWN = ("57P01", "57P02", "57P03")


class Unavailable(StoreError):
    """The database cannot be reached or refuses us: the text says which and why."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a write is run again. `clock` and `sleep` are injected so
    tests need not wait; `on_retry` hears each failure that will be retried."""

    window_s: float = 30.0
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    on_retry: Callable[[BaseException], None] | None = None


def transient(exc: BaseException) -> bool:
    """Whether `exc` says the database could not be reached now (worth running again)."""
    if isinstance(exc, sqlite3.OperationalError):
        name = getattr(exc, "sqlite_errorname", "") or ""
        return name.startswith(_SQLITE_TRANSIENT)
    root = type(exc).__module__.split(".")[0]
    if root == "psycopg_pool":
        return type(exc).__name__ == "PoolTimeout"  # no connection came back in time
    if root != "psycopg":
        return False
    if not any(c.__name__ == "OperationalError" for c in type(exc).__mro__):
        return False
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith("08") or state in _PG_SHUTDOWN


def locked(exc: BaseException) -> bool:
    """Whether `exc` is SQLite's "database is locked": another process's write lock was
    held for as long as we waited. Contention, not yet an outage."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    return isinstance(exc, sqlite3.OperationalError) and name.startswith(_SQLITE_LOCKED)


def hint(exc: BaseException) -> str:
    """What to check, for the log, when SQLite says why it cannot write; else ""."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    return next((text for code, text in _SQLITE_HINTS.items() if name.startswith(code)), "")


async def retrying(attempt: Callable[[float], Awaitable[T]], policy: RetryPolicy, label: str) -> T:
    """`attempt(seconds_left)` until it answers, raises what is not `transient`, or the
    window ends (then `Unavailable` naming `label`, the database)."""
    start = policy.clock()
    delay = policy.first_delay_s
    tries = 0
    while True:
        left = policy.window_s - (policy.clock() - start)
        try:
            return await attempt(max(left, 0.0))
        except Exception as exc:
            if not transient(exc):
                raise
            tries += 1
            left = policy.window_s - (policy.clock() - start)
            if left <= 0:
                raise Unavailable(
                    f"{label}: a write failed {tries} time(s) over {policy.window_s:g} s "
                    f"([store] write_retry_s) and was not recorded; the database's last "
                    f"error: {_reason(exc)}"
                ) from exc
            log.warning(
                "%s: a write failed (%s%s); running it again in %.2f s",
                label,
                _reason(exc),
                f"; {hint(exc)}" if hint(exc) else "",
                delay,
            )
            if policy.on_retry is not None:
                policy.on_retry(exc)
            await policy.sleep(min(delay * random.uniform(0.5, 1.0), left))
            delay = min(delay * 2, policy.max_delay_s)


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
