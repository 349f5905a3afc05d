"""The store's one thread, and writes that share a transaction when they arrive together.

Every SQLite call runs on a single thread that owns the connection (store/db.py). A
write is a round trip to that thread and a commit; with 200 deploys finishing a step in
the same moment, 200 round trips queue one behind the other and every deploy waits for
the whole queue. So writes go through `Writer.write`: the first one goes at once, and
those that arrive while the thread is busy go next, together, in one transaction, each
inside a savepoint of its own, so one that fails (a compare-and-set that finds a
conflict, a row that is gone) is undone alone and its caller alone hears of it. A
caller is answered only after the commit: nothing is reported written that a crash
could still lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
Outcome = tuple[Any, BaseException | None]


class Writer:
    """Runs calls on the store's thread: `call` alone, `write` batched with other writes."""

    def __init__(self, executor: ThreadPoolExecutor, conn: sqlite3.Connection) -> None:
        self._executor = executor
        self._conn = conn
        # Each write with its deadline (time.monotonic()), or None: the connection's own
        # busy timeout.
        self._pending: list[tuple[Callable[[], Any], asyncio.Future[Any], float | None]] = []
        self._draining: asyncio.Task[None] | None = None

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` on the thread by itself (reads; writes that must not wait)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def write(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` in the next batch of writes; its result once the batch is committed.
        A cancelled caller stops waiting, not the write (as with any thread call)."""
        return await self.write_within(None, fn, *args, **kwargs)

    async def write_within(
        self, wait_s: float | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`write`, waiting for another process's lock no longer than `wait_s` from now
        (queued behind other calls included): then SQLite's "database is locked"."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        self._pending.append((functools.partial(fn, *args, **kwargs), done, deadline))
        if self._draining is None or self._draining.done():
            self._draining = asyncio.create_task(self._drain(), name="store-writes")
        return await done

    async def close(self) -> None:
        if self._draining is not None:
            await asyncio.gather(self._draining, return_exceptions=True)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            calls = [fn for fn, _done, _deadline in batch]
            deadlines = [d for _fn, _done, d in batch]
            deadline = None if None in deadlines else max(d for d in deadlines if d is not None)
            try:
                outcomes = await loop.run_in_executor(
                    self._executor, _waiting_until, deadline, self._conn, calls
                )
            except Exception as exc:  # not from SQLite: still every caller hears it
                outcomes = [(None, exc)] * len(batch)
            except BaseException:  # cancelled (the loop is going away): nobody may hang
                for _fn, done, _deadline in batch + self._pending:
                    done.cancel()
                self._pending = []
                raise
            for (_fn, done, _deadline), (value, error) in zip(batch, outcomes, strict=True):
                if done.done():  # its caller was cancelled; the write stands
                    continue
                if error is None:
                    done.set_result(value)
                else:
                    done.set_exception(error)


def _waiting_until(
    deadline: float | None, conn: sqlite3.Connection, calls: list[Callable[[], Any]]
) -> list[Outcome]:
    """`_together`, with SQLite's busy timeout cut to what is left before `deadline`
    (counted here, on the thread: time spent queued behind other calls is spent), so a
    write waits for another process's lock no longer than its retry window allows."""
    if deadline is None:
        return _together(conn, calls)
    (usual_ms,) = conn.execute("PRAGMA busy_timeout").fetchone()
    left_ms = max(0, int((deadline - time.monotonic()) * 1000))
    conn.execute(f"PRAGMA busy_timeout = {min(int(usual_ms), left_ms)}")
    try:
        return _together(conn, calls)
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(usual_ms)}")


def _together(conn: sqlite3.Connection, calls: list[Callable[[], Any]]) -> list[Outcome]:
    """On the store's thread: one call as it is (it makes its own transaction), or
    several in one transaction, each in a savepoint."""
    if len(calls) == 1:
        return [_outcome(calls[0])]
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:  # busy past the timeout: every caller hears it
        return [(None, exc)] * len(calls)
    try:
        outcomes = [_in_savepoint(conn, call) for call in calls]
        conn.execute("COMMIT")
    except sqlite3.Error as exc:  # the transaction itself failed (disk full...)
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        return [(None, exc)] * len(calls)
    return outcomes


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return call(), None
    except Exception as exc:  # handed to this call's caller
        return None, exc


def _in_savepoint(conn: sqlite3.Connection, call: Callable[[], Any]) -> Outcome:
    conn.execute("SAVEPOINT batched")
    value, error = _outcome(call)
    if error is not None:
        conn.execute("ROLLBACK TO batched")
    conn.execute("RELEASE batched")
    return value, error
