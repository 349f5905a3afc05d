"""What a backend call is waiting out, told to its caller while the call goes on.

A call may spend its time inside the backend without failing: waiting for a lock that
someone else holds (until `lock_wait_s`), or asking again for the state of its task
when a read of it failed. When the caller's own timeout ends the call first, "timed out
after 45 s" alone hides why; so the backend says what it met (`trouble`) into the list
the caller handed in (`told`, which keeps the last), and the caller's timeout names it, as it
does for the retryable errors it saw itself (bot/jobs/waiting.py `retrying`).

The list travels in a context variable: a call's coroutines share their task's context,
so every layer of a backend can tell without an extra parameter. Work that runs in a
task of its own (one poller serving many waits) takes the list when a wait begins
(`current`) and appends to it directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_TOLD: ContextVar[list[str] | None] = ContextVar("backend_troubles", default=None)


@contextlib.contextmanager
def told(into: list[str]) -> Iterator[None]:
    """Within: what backend calls wait out is appended to `into`."""
    token = _TOLD.set(into)
    try:
        yield
    finally:
        _TOLD.reset(token)


def current() -> list[str] | None:
    """The list of the call running in this context; None when nobody listens."""
    return _TOLD.get()


def trouble(message: str) -> None:
    """Say what the call is waiting out (the whole sentence: what, and what was met)."""
    into = _TOLD.get()
    if into is not None:
        into[:] = [message]  # the caller names the last; a wait of hours keeps one
