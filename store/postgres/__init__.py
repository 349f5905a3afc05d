"""The store on PostgreSQL, for several replicas sharing one database.

The store's functions are the SQLite store's own (store/sql.py): one copy of every query
and compare-and-set. They are synchronous, so they run on worker threads, each with a
connection from psycopg's pool (psycopg_pool.ConnectionPool); the event loop only awaits
them, as it does SQLite's thread. A function whose transaction PostgreSQL chose as a
deadlock's victim is run again from the start, on fresh reads; so is a write whose
connection failed (the server restarting, a failover), for up to `[store]
write_retry_s` (store/retry.py).

Writes stand alone on the pool's connections, in parallel, except the set-based ones
(`write_merged`: the step events of deploys ending a step together): those that arrive
while the last such call is on its way are merged into the next one (`Merger`), a fixed
number of round trips for all of them. (Batching every write into one transaction on
one connection was tried, and was slower: it gave up the pool's parallelism, and the
cost was the round trips of each statement, which it did not remove.)

The password comes from the environment (`database_password_env`, or libpq's own
PGPASSWORD / .pgpass), never from the URL; TLS options in the URL (`sslmode`,
`sslrootcert` ...) go to libpq as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import psycopg
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from store.owners import installation_id
from store.postgres.db import PgDb
from store.postgres.schema import migrate
from store.retry import RetryPolicy, Unavailable, retrying
from store.sql import Db

P = ParamSpec("P")
T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 (an item of a merged write)

POOL_SIZE = 8
CONNECT_TIMEOUT_S = 10.0
# While the server is away, how long one attempt of a write waits for the pool to hand
# it a connection (the pool reconnects in the background) before it is retried.
POOL_WAIT_S = 5.0
RECONNECT_S = 2.0  # how long the pool keeps reconnecting with backoff before starting over
ASK_AGAIN_S = 0.5  # a wait for a connection is asked anew this often (`_connection`)
# A deadlock's victim is run again; so many times before its caller hears.
RACE_RETRIES = 20
_RACES = (errors.SerializationFailure, errors.DeadlockDetected)


def redacted(url: str) -> str:
    """The URL without a password, for logs and messages."""
    try:
        params = conninfo_to_dict(url)
    except Exception:  # not parseable: show nothing of it
        return "postgresql://(unreadable URL)"
    params.pop("password", None)
    host, db = params.get("host", ""), params.get("dbname", "")
    user = f"{params['user']}@" if params.get("user") else ""
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{user}{host}{port}/{db}"


class PostgresEngine:
    """An `Engine` (store/engine.py) on a pool of PostgreSQL connections."""

    def __init__(
        self, url: str, pool: ConnectionPool, executor: ThreadPoolExecutor, retry: RetryPolicy
    ) -> None:
        self.label = redacted(url)
        self.installation_id = ""
        self._pool = pool
        self._executor = executor
        self._retry = retry
        self._merger = Merger(self.write)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        password: str | None = None,
        pool_size: int = POOL_SIZE,
        retry: RetryPolicy | None = None,
    ) -> PostgresEngine:
        conninfo = make_conninfo(url, password=password) if password else url
        pool: ConnectionPool = ConnectionPool(
            conninfo,
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": True},
            open=False,
            name="deploybot-store",
            # After the server went away the pool reconnects with a doubling backoff
            # (1, 2, 4 ... s) for up to this long, then starts again when a caller
            # waits: without a bound, a runner could stay cut off for as long as its
            # outage lasted again after the server is back, and lose its jobs to a
            # runner whose pool happened to retry sooner (bot/ownership/claims.py fencing).
            reconnect_timeout=RECONNECT_S,
        )
        executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="deploybot-pg")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, _open, conninfo, redacted(url), pool)
        except BaseException:
            executor.shutdown(wait=False)
            await loop.run_in_executor(None, pool.close)
            raise
        engine = cls(url, pool, executor, retry or RetryPolicy())
        engine.installation_id = await engine.call(installation_id)
        return engine

    async def call(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Reads, probes and renewals: once (their loops ask again anyway)."""
        loop = asyncio.get_running_loop()
        run = functools.partial(self._run, functools.partial(fn, **kwargs), args, None)
        return await loop.run_in_executor(self._executor, run)

    async def write(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Every write stands alone (PostgreSQL takes many writers at once), and is run
        again from the start while the server cannot be reached (store/retry.py)."""
        loop = asyncio.get_running_loop()
        bound = functools.partial(fn, **kwargs)

        async def attempt(left_s: float) -> T:
            wait_s = max(0.1, min(left_s, POOL_WAIT_S))
            run = functools.partial(self._run, bound, args, wait_s)
            return await loop.run_in_executor(self._executor, run)

        return await retrying(attempt, self._retry, self.label)

    async def write_merged(self, fn: Callable[[Db, list[I]], list[T]], item: I) -> T:
        """`write` of `fn(db, [item])[0]`, merged with the items of `fn` that arrive while
        its last call is on its way (`Merger`)."""
        return cast(T, await self._merger.write(fn, item))

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], wait_s: float | None) -> T:
        for attempt in range(RACE_RETRIES):
            with self._connection(wait_s) as conn:
                try:
                    return fn(PgDb(conn), *args)
                except _RACES:
                    if attempt == RACE_RETRIES - 1:
                        raise
            # Apart a little, so the replicas that collided do not collide again.
            time.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _connection(self, wait_s: float | None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection, waited for up to `wait_s` (None: the pool's timeout) in
        short asks: after the server went away, the pool tries to reconnect only for a
        caller that asks anew once its reconnect attempts gave up (`RECONNECT_S`), so a
        caller waiting in one long ask could stay without a connection long after the
        server is back (a runner then misses its renewals: bot/ownership/claims.py)."""
        deadline = time.monotonic() + (self._pool.timeout if wait_s is None else wait_s)
        while True:
            left = deadline - time.monotonic()
            try:
                conn = self._pool.getconn(timeout=max(0.01, min(ASK_AGAIN_S, left)))
                break
            except PoolTimeout:
                if left <= ASK_AGAIN_S:
                    raise
        try:
            with conn:  # as the pool's own connection(): ends what the call left open
                yield conn
        finally:
            self._pool.putconn(conn)

    async def integrity_check(self) -> str:
        # PostgreSQL checks its pages itself (and amcheck is an extension); what the
        # store can check is that the database answers.
        return await self.call(lambda db: "ok" if db.query("SELECT 1 AS one") else "no answer")

    async def close(self) -> None:
        await self._merger.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._pool.close)
        self._executor.shutdown(wait=True)


Many = Callable[[Db, list[Any]], list[Any]]
Waiting = list[tuple[Any, "asyncio.Future[Any]"]]


class Merger:
    """Calls of one set-based store function, merged: the first goes at once, and the
    items that arrive while it is on its way go next, together, in one call. One that
    failed is run again alone with each of its items, so only the item's own caller
    hears of its failure (the database being away is every item's: not run again)."""

    def __init__(self, write: Callable[..., Awaitable[Any]]) -> None:
        self._write = write  # the engine's `write`: it retries while the server is away
        self._pending: dict[Many, Waiting] = {}
        self._draining: dict[Many, asyncio.Task[None]] = {}

    async def write(self, fn: Many, item: Any) -> Any:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(fn, []).append((item, done))
        task = self._draining.get(fn)
        if task is None or task.done():
            self._draining[fn] = asyncio.create_task(self._drain(fn), name="store-merged")
        return await done

    async def close(self) -> None:
        await asyncio.gather(*self._draining.values(), return_exceptions=True)

    async def _drain(self, fn: Many) -> None:
        while batch := self._pending.pop(fn, []):
            items = [item for item, _done in batch]
            try:
                outcomes = await self._outcomes(fn, items)
            except BaseException:  # cancelled (the loop is going away): nobody may hang
                for _item, done in batch + self._pending.pop(fn, []):
                    done.cancel()
                raise
            for (_item, done), (value, error) in zip(batch, outcomes, strict=True):
                if done.done():  # its caller was cancelled; the write stands
                    continue
                if error is None:
                    done.set_result(value)
                else:
                    done.set_exception(error)

    async def _outcomes(self, fn: Many, items: list[Any]) -> list[tuple[Any, Exception | None]]:
        try:
            return [(value, None) for value in await self._write(fn, items)]
        except Exception as exc:
            if len(items) == 1 or isinstance(exc, Unavailable):
                return [(None, exc)] * len(items)
        alone = await asyncio.gather(
            *(self._write(fn, [item]) for item in items), return_exceptions=True
        )
        outcomes: list[tuple[Any, Exception | None]] = []
        for answer in alone:
            if isinstance(answer, Exception):
                outcomes.append((None, answer))
            elif isinstance(answer, BaseException):
                raise answer
            else:
                outcomes.append((answer[0], None))
        return outcomes


def _open(conninfo: str, label: str, pool: ConnectionPool) -> None:
    """Connect once by hand first: the pool only says it timed out, libpq says why
    (refused, no such host, password authentication failed, certificate ...)."""
    try:
        with psycopg.connect(conninfo, connect_timeout=int(CONNECT_TIMEOUT_S)) as conn:
            conn.autocommit = True
            migrate(conn)
    except psycopg.OperationalError as exc:
        raise Unavailable(f"{label}: {libpq_reason(exc)}") from exc
    pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)


def libpq_reason(exc: psycopg.Error) -> str:
    """libpq's whole reason on one line: its first line says what failed ("Connection
    refused", "database ... does not exist"), the next ones add hints, and with several
    addresses for a host each address has its own lines. No password is ever in it."""
    lines: list[str] = []
    for line in str(exc).splitlines():
        line = " ".join(line.split()).removeprefix("connection failed: ")
        if line and line not in lines:
            lines.append(line)
    ends = [line if line.endswith((".", "?", "!")) else line + "." for line in lines[:-1]]
    return " ".join([*ends, *lines[-1:]]) or type(exc).__name__
