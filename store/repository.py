"""How a repository (store/repositories.py) turns each store function into an async method.

Every query is written once, as a plain synchronous function of a `Db` in the module of
its table (store/jobs.py, owners.py ...), where other store functions call it inside
their own transactions. A repository names the ones the core may ask for, each with how
the engine runs it (store/engine.py):

    class Approvals(Repository):
        get = call(approvals.get_approval)   # alone: reads, rare writes, probes
        decide = write(approvals.decide)     # batched with the writes of the moment
        add_event = merged(add_event, add_events)  # writes of the moment: one call
        claim_of = gathered(claim_of, claims_of)   # reads of the moment: one call

`Approvals.get` is the function itself; `store.approvals.get(job_id)` awaits it on the
engine. A call that kept a notice for chat (store/outbox.add) tells `Repository.wake`,
so the process that delivers the outbox need not wait for its next look.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from store import outbox
from store.engine import Engine
from store.sql import Db

P = ParamSpec("P")
T = TypeVar("T")


class Wake:
    """Who to tell that this process kept a notice (a front end that delivers the
    outbox sets `on_notice`); shared by all repositories of one `Store`."""

    def __init__(self) -> None:
        self.on_notice: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.on_notice is not None:
            self.on_notice()


class Repository:
    """The queries of one table (or a tight group of tables) on one engine."""

    def __init__(self, engine: Engine, wake: Wake) -> None:
        self.engine = engine
        self.wake = wake


def _counting(fn: Callable[Concatenate[Db, P], T]) -> Callable[Concatenate[Db, P], tuple[T, bool]]:
    """`fn`, also answering whether it kept a notice (counted on the thread it runs on)."""

    def run(db: Db, /, *args: P.args, **kwargs: P.kwargs) -> tuple[T, bool]:
        before = outbox.kept_here()
        value = fn(db, *args, **kwargs)
        return value, outbox.kept_here() > before

    return run


# How a repository's method reaches the engine: given the repository, a function of one
# call's arguments that runs it there (and wakes the delivery when it kept a notice).
Send = Callable[[tuple[Any, ...], dict[str, Any]], Awaitable[T]]


class _Query(Generic[P, T]):
    """A store function as a repository's method (see the module docstring): `fn` itself
    on the class, an async method on a repository, run there as `sender` says."""

    def __init__(
        self, fn: Callable[Concatenate[Db, P], T], sender: Callable[[Repository], Send[T]]
    ) -> None:
        self.fn = fn
        self._sender = sender
        self.__doc__ = fn.__doc__
        self._name = fn.__name__

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, repo: None, owner: type[Any]) -> Callable[Concatenate[Db, P], T]: ...

    @overload
    def __get__(self, repo: Repository, owner: type[Any]) -> Callable[P, Awaitable[T]]: ...

    def __get__(
        self, repo: Repository | None, owner: type[Any]
    ) -> Callable[Concatenate[Db, P], T] | Callable[P, Awaitable[T]]:
        if repo is None:
            return self.fn
        send = self._sender(repo)

        async def method(*args: P.args, **kwargs: P.kwargs) -> T:
            return await send(args, kwargs)

        method.__name__ = method.__qualname__ = self._name
        method.__doc__ = self.__doc__
        # Made once per repository: later look-ups find it in the instance's dict.
        repo.__dict__[self._name] = method
        return method


def _alone(fn: Callable[Concatenate[Db, P], T], batched: bool) -> Callable[[Repository], Send[T]]:
    counted = _counting(fn)

    def sender(repo: Repository) -> Send[T]:
        run_on = repo.engine.write if batched else repo.engine.call

        async def send(args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
            value, kept = await run_on(counted, *args, **kwargs)
            if kept:
                repo.wake()
            return value

        return send

    return sender


def call(fn: Callable[Concatenate[Db, P], T]) -> _Query[P, T]:
    """Run alone on the engine (`Engine.call`): reads, rare writes, and what must fail
    fast rather than be run again (renewals, probes)."""
    return _Query(fn, _alone(fn, batched=False))


def write(fn: Callable[Concatenate[Db, P], T]) -> _Query[P, T]:
    """Batched with the writes made at the same moment (`Engine.write`), and run again
    while the database cannot be reached (store/retry.py)."""
    return _Query(fn, _alone(fn, batched=True))


def merged(
    one: Callable[Concatenate[Db, P], T], many: Callable[[Db, list[Any]], list[T]]
) -> _Query[P, T]:
    """Like `write`, merged with the same function's writes of the moment into one call of
    its set-based twin `many` (`Engine.write_merged`: one read of the claims and one
    insert for all the step events that end together, on SQLite and PostgreSQL alike).
    The method takes `one`'s arguments; the engine runs `many` on the items of all
    callers of the moment."""
    item_of, counted = _item_of(one), _counting_all(many)

    def sender(repo: Repository) -> Send[T]:
        async def send(args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
            value, kept = await repo.engine.write_merged(counted, item_of(args, kwargs))
            if kept:
                repo.wake()
            return value

        return send

    return _Query(one, sender)


def gathered(
    one: Callable[Concatenate[Db, P], T], many: Callable[[Db, list[Any]], list[T]]
) -> _Query[P, T]:
    """Like `call`, gathered with the same function's calls of the moment into one
    `Engine.call` of `many` (the steps' fence reads: `Runners.claim_of`): the first goes
    at once, those that come while it runs go next, together (the fences of the deploys
    that begin a step together ask one after another in the same moment; each alone was
    a round trip to the store's thread). `many` answers one value per item, in order;
    an error reaches every caller of its call."""
    item_of = _item_of(one)
    # An item is one's arguments (but the Db), or its argument when it takes one.
    alone = len(inspect.signature(one).parameters) == 2

    def sender(repo: Repository) -> Send[T]:
        batches: _Batches[T] = _Batches(repo.engine, many)

        async def send(args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
            item = item_of(args, kwargs)
            return await batches.ask(item[0] if alone else item)

        return send

    return _Query(one, sender)


def _counting_all(
    many: Callable[[Db, list[Any]], list[T]],
) -> Callable[[Db, list[Any]], list[tuple[T, bool]]]:
    """`many`, each answer also saying whether the call kept a notice (one call serves
    all its items: a wake-up is cheap and needs no finer count)."""

    def run(db: Db, items: list[Any]) -> list[tuple[T, bool]]:
        before = outbox.kept_here()
        values = many(db, items)
        kept = outbox.kept_here() > before
        return [(value, kept) for value in values]

    return run


def _item_of(
    one: Callable[..., Any],
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]:
    """How a call of `one` (without its `Db`) becomes an item of its set-based twin: its
    arguments, every default filled in, in order. A call that passes them all by
    position (the usual one, once per step of every deploy) is its own item: binding a
    signature each time cost more than the rest of the call."""
    signature = inspect.signature(one)
    count = len(signature.parameters) - 1  # the Db

    def item(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if not kwargs and len(args) == count:
            return args
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())[1:]  # one's arguments but the Db

    return item


class _Batches(Generic[T]):
    """The callers of one gathered read on one engine: who waits, and the call running."""

    def __init__(self, engine: Engine, many: Callable[[Db, list[Any]], list[T]]) -> None:
        self._engine = engine
        self._many = many
        self._pending: list[tuple[Any, asyncio.Future[T]]] = []
        self._running: asyncio.Task[None] | None = None

    async def ask(self, item: Any) -> T:
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((item, done))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._run(), name="store-reads")
        return await done

    async def _run(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                values = await self._engine.call(self._many, [item for item, _ in batch])
            except Exception as exc:  # every caller of this call hears it
                for _item, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            except BaseException:  # cancelled (the loop is going away): nobody may hang
                for _item, done in batch + self._pending:
                    done.cancel()
                self._pending = []
                raise
            for (_item, done), value in zip(batch, values, strict=True):
                if not done.done():  # its caller was cancelled meanwhile
                    done.set_result(value)
