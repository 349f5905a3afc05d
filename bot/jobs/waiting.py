"""How the core waits on backends: retries (an error backoff, or a polling pace for
"not yet" answers), cleanup that a cancel cannot cut short, and stop-then-destroy.

The pipeline, the recovery at start and `deploybot gc` all remove VMs and retry the same
way; this module is the one place that says how.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from backends import troubles
from backends.base import Backend, Unreachable, VMRef
from bot.config.sections import Timeouts
from bot.models.errors import BackendError

log = logging.getLogger(__name__)
T = TypeVar("T")


async def protected(awaitable: Awaitable[T]) -> T:
    """Finish `awaitable` even if the caller is cancelled meanwhile (rollbacks, final writes).

    asyncio.shield alone returns control to a cancelled caller while the work goes on
    unobserved; this keeps waiting, so a job's task ends only once its cleanup has.
    """
    task = asyncio.ensure_future(awaitable)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise


async def woken(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event` at most `timeout_s`; say whether it was set.

    Not asyncio.wait_for: on Python 3.11 it runs the wait as a task of its own and loses
    a cancel that arrives just as the event is set (cpython gh-86296), so a loop built
    on it may never stop (seen as a hung shutdown under load)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def retrying(
    action: Callable[[], Awaitable[T]],
    timeouts: Timeouts,
    seen: list[str] | None = None,
    on_retry: Callable[[BackendError], Awaitable[None]] | None = None,
    *,
    polling: bool = False,
) -> T:
    """Retry retryable backend errors; the caller's timeout bounds the whole. The last
    retried error is kept in `seen` and each is passed to `on_retry`; so is what the
    backend tells it waits out within a call (`backends.troubles`).

    Errors back off exponentially (`retry_initial_s`, doubling, capped at `retry_max_s`).
    With `polling` a retryable answer is the expected "not yet" (an sshd still starting
    after the guest agent): ask again after `poll_initial_s`, then after a twentieth of
    the time waited so far, so a poll adds at most ~5% to the wait (same cap). An
    endpoint that does not answer at all (`Unreachable`) still backs off."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    delay = timeouts.retry_initial_s
    while True:
        try:
            # What the backend waits out inside a call (a lock, a failed read of its
            # task) joins `seen`: a timeout then names it (backends/troubles.py).
            with troubles.told(seen) if seen is not None else contextlib.nullcontext():
                return await action()
        except BackendError as exc:
            if not exc.retryable:
                raise
            not_yet = polling and not isinstance(exc, Unreachable)
            log.info("retrying after %s", exc.message)
            if seen is not None:
                seen[:] = [exc.message]  # only the last is read; a long wait keeps one
            if on_retry is not None:
                await on_retry(exc)
        if not_yet:
            waited = loop.time() - began
            pause = min(timeouts.retry_max_s, max(timeouts.poll_initial_s, waited / 20))
        else:
            pause, delay = delay, min(delay * 2, timeouts.retry_max_s)
        await asyncio.sleep(pause)


# Told of each move of `remove_vm`: (move, None) before it, (move, seconds) once done.
OnMove = Callable[[str, float | None], Awaitable[None]]


async def remove_vm(
    backend: Backend, ref: VMRef, timeouts: Timeouts, on_move: OnMove | None = None
) -> None:
    """Stop (and wait), then destroy (and wait); each under its timeout, with retries.

    Raises the BackendError of the move that failed, or a TimeoutError that says which
    move ran out of time and the last error it met (a lock, a refusal) rather than
    only "timed out". A destroy (bot/kinds/deploy/destroy.py) follows each move with `on_move`, so
    its thread shows them and a restart can tell how far it got.
    """
    moves = (
        ("stop", backend.power_off, timeouts.power_off_s),
        ("destroy", backend.destroy, timeouts.destroy_s),
    )
    loop = asyncio.get_running_loop()
    for what, move, limit_s in moves:
        if on_move is not None:
            await on_move(what, None)
        began = loop.time()
        seen: list[str] = []
        try:
            async with asyncio.timeout(limit_s):
                await retrying(functools.partial(move, ref), timeouts, seen)
        except TimeoutError:
            last = f" (last: {seen[-1]})" if seen else ""
            raise TimeoutError(f"{what} timed out after {limit_s:g} s{last}") from None
        if on_move is not None:
            await on_move(what, loop.time() - began)
