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

Writes of one set-based function (`write_merged`: the step events of every deploy
ending a step together) are merged further: the batch runs that function once for all
of them, a fixed number of statements however many there are; if that call fails, each
is run again alone in its own savepoint, so again only its caller hears of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, cast

P = ParamSpec("P")
T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 (an item of a merged write)
Outcome = tuple[Any, BaseException | None]
# A set-based store function, bound to its `Db`: one result per item, in order.
ManyFn = Callable[[list[Any]], list[Any]]


@dataclass(frozen=True)
class _Item:
    """One caller's share of a merged write: `fn` is its function (the merge key)."""

    fn: Callable[..., list[Any]]
    bound: ManyFn
    item: Any


@dataclass
class _Merged:
    """The items of one set-based function in a batch, run as one call."""

    bound: ManyFn
    items: list[Any] = field(default_factory=list)


# What the thread runs for one batch: plain calls (one caller each) and merged calls.
Unit = Callable[[], Any] | _Merged


class Writer:
    """Runs calls on the store's thread: `call` alone, `write` batched with other writes,
    `write_merged` merged with the same function's writes of the batch."""

    def __init__(self, executor: ThreadPoolExecutor, conn: sqlite3.Connection) -> None:
        self._executor = executor
        self._conn = conn
        # Each write with its deadline (time.monotonic()), or None: the connection's own
        # busy timeout.
        self._pending: list[tuple[Callable[[], Any] | _Item, asyncio.Future[Any], float | None]]
        self._pending = []
        self._draining: asyncio.Task[None] | None = None
        self._usual_ms: int | None = None  # the connection's busy timeout

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
        return cast(T, await self._queued(wait_s, functools.partial(fn, *args, **kwargs)))

    async def write_merged(
        self, wait_s: float | None, fn: Callable[[Any, list[I]], list[T]], db: Any, item: I
    ) -> T:
        """`write_within` of `fn(db, [item])[0]`, run as one `fn(db, items)` with the
        items of the other callers of `fn` in the same batch."""
        return cast(T, await self._queued(wait_s, _Item(fn, functools.partial(fn, db), item)))

    async def _queued(self, wait_s: float | None, what: Callable[[], Any] | _Item) -> Any:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        self._pending.append((what, done, deadline))
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
            units = _units(batch)
            deadlines = [d for _what, _done, d in batch]
            deadline = None if None in deadlines else max(d for d in deadlines if d is not None)
            try:
                if self._usual_ms is None:  # as the connection was opened
                    self._usual_ms = await self.call(_busy_timeout_ms, self._conn)
                run = functools.partial(_waiting_until, deadline, self._conn, self._usual_ms)
                outcomes = await loop.run_in_executor(self._executor, run, [u for u, _ in units])
            except Exception as exc:  # not from SQLite: still every caller hears it
                outcomes = [[(None, exc)] * len(callers) for _unit, callers in units]
            except BaseException:  # cancelled (the loop is going away): nobody may hang
                for _what, done, _deadline in batch + self._pending:
                    done.cancel()
                self._pending = []
                raise
            for (_unit, callers), answers in zip(units, outcomes, strict=True):
                for done, (value, error) in zip(callers, answers, strict=True):
                    if done.done():  # its caller was cancelled; the write stands
                        continue
                    if error is None:
                        done.set_result(value)
                    else:
                        done.set_exception(error)


def _units(
    batch: list[tuple[Callable[[], Any] | _Item, asyncio.Future[Any], float | None]],
) -> list[tuple[Unit, list[asyncio.Future[Any]]]]:
    """The batch as the thread runs it, each unit with its callers: a plain write alone,
    the items of each set-based function as one call where its first item was (writes
    in one batch are concurrent: none of their callers waits for another)."""
    units: list[tuple[Unit, list[asyncio.Future[Any]]]] = []
    groups: dict[Callable[..., list[Any]], tuple[_Merged, list[asyncio.Future[Any]]]] = {}
    for what, done, _deadline in batch:
        if not isinstance(what, _Item):
            units.append((what, [done]))
            continue
        group = groups.get(what.fn)
        if group is None:
            group = groups[what.fn] = (_Merged(what.bound), [])
            units.append(group)
        group[0].items.append(what.item)
        group[1].append(done)
    return units


def _waiting_until(
    deadline: float | None, conn: sqlite3.Connection, usual_ms: int, units: list[Unit]
) -> list[list[Outcome]]:
    """`_together`, with SQLite's busy timeout cut to what is left before `deadline`
    (counted here, on the thread: time spent queued behind other calls is spent), so a
    write waits for another process's lock no longer than its retry window allows. The
    timeout is changed only when the deadline is nearer than it (one statement less per
    batch, and two, than asking and restoring it every time)."""
    left_ms = usual_ms if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
    if left_ms >= usual_ms:
        return _together(conn, units)
    conn.execute(f"PRAGMA busy_timeout = {left_ms}")
    try:
        return _together(conn, units)
    finally:
        conn.execute(f"PRAGMA busy_timeout = {usual_ms}")


def _busy_timeout_ms(conn: sqlite3.Connection) -> int:
    (usual,) = conn.execute("PRAGMA busy_timeout").fetchone()
    return int(usual)


def _together(conn: sqlite3.Connection, units: list[Unit]) -> list[list[Outcome]]:
    """On the store's thread: one call as it is (it makes its own transaction), or
    several in one transaction, each in a savepoint."""
    if len(units) == 1:
        (unit,) = units
        return [_merged(conn, unit) if isinstance(unit, _Merged) else [_outcome(unit)]]
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:  # busy past the timeout: every caller hears it
        return [[(None, exc)] * _callers(unit) for unit in units]
    try:
        outcomes = [
            _merged(conn, unit) if isinstance(unit, _Merged) else [_in_savepoint(conn, unit)]
            for unit in units
        ]
        conn.execute("COMMIT")
    except sqlite3.Error as exc:  # the transaction itself failed (disk full...)
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        return [[(None, exc)] * _callers(unit) for unit in units]
    return outcomes


def _callers(unit: Unit) -> int:
    return len(unit.items) if isinstance(unit, _Merged) else 1


def _merged(conn: sqlite3.Connection, unit: _Merged) -> list[Outcome]:
    """A set-based function's items in one call; if it fails, each alone (in a savepoint
    of the batch's transaction, or in its own), so the failure reaches only its caller."""
    whole = functools.partial(unit.bound, unit.items)
    value, error = _in_savepoint(conn, whole) if conn.in_transaction else _outcome(whole)
    if error is None:
        return [(v, None) for v in value]
    if len(unit.items) == 1 or isinstance(error, sqlite3.OperationalError):
        return [(None, error)] * len(unit.items)  # the file busy, say: every item's
    alone = [functools.partial(_first, unit.bound, item) for item in unit.items]
    if conn.in_transaction:
        return [_in_savepoint(conn, call) for call in alone]
    return [_outcome(call) for call in alone]


def _first(bound: ManyFn, item: Any) -> Any:
    (value,) = bound([item])
    return value


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
