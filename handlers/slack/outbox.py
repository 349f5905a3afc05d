"""Paced, coalescing delivery of the bot's channel messages.

Slack allows about one message per second per channel. Fifty deploys reporting seven
steps each would need hundreds of posts, so nothing here posts per event: each job's
thread (and each approval request) keeps only what is still to be said, and one worker
per channel sends, in turn, the single most useful call for the next item that has
something pending. Whatever piled up meanwhile goes out as one reply. The worker waits
`1 / rate` seconds after each call *finishes*, so even a slow answer cannot squeeze two
calls closer than the interval at Slack's end.

A 429 that outlives the SDK's own retry (AsyncRateLimitErrorRetryHandler) puts the item
back and pauses the channel for Retry-After; nothing pending is lost. So does a Slack
that does not answer, with backoff. An item with an outcome to tell (a job ready or
failed) goes before items with only progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot.models.errors import StoreError

log = logging.getLogger(__name__)
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 60.0


class Item(Protocol):
    """Something with calls to make in one channel (a job's thread, an approval request)."""

    channel: str

    def pending(self) -> bool: ...

    def urgent(self) -> bool:
        """An outcome is waiting (a job ready or failed): it goes before progress."""
        ...

    async def flush_one(self, client: AsyncWebClient) -> None:
        """Make exactly one Web API call; update own state only once it succeeded."""
        ...

    def give_up(self) -> None:
        """Slack refused the call for good (channel gone, not allowed): forget it."""
        ...


class ChannelOutbox:
    """The one worker that talks to one channel, at most `rate` calls per second."""

    def __init__(self, channel: str, client: AsyncWebClient, rate: float) -> None:
        self.channel = channel
        self.client = client
        self.interval = 1.0 / rate
        self.on_throttled: Callable[[], None] | None = None
        self._queue: deque[Item] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._next_at = 0.0
        self._failures = 0  # calls in a row that Slack did not answer
        self._task: asyncio.Task[None] | None = None

    def touch(self, item: Item) -> None:
        """`item` has something new to say; queue it once, start the worker if needed."""
        if item not in self._queue:
            self._queue.append(item)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._work(), name=f"slack-outbox-{self.channel}")

    async def idle(self) -> None:
        await self._idle.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            # Outcomes first: with the channel backlogged, the SSH line must not queue
            # behind other jobs' step progress (that piles up and goes as one reply).
            item = next((i for i in self._queue if i.urgent()), self._queue[0])
            self._queue.remove(item)
            if not item.pending():
                continue
            delay = self._next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing, not synchronisation
            pause = await self._call(item)
            self._next_at = loop.time() + max(self.interval, pause)
            if item.pending() and item not in self._queue:
                self._queue.append(item)  # round robin: other jobs get their turn first

    async def _call(self, item: Item) -> float:
        """One call for `item`; returns how long the channel must rest afterwards."""
        try:
            await item.flush_one(self.client)
            self._failures = 0
        except SlackApiError as exc:
            if exc.response.status_code == 429:
                if self.on_throttled is not None:
                    self.on_throttled()
                retry_after = _retry_after(exc)
                log.warning("Slack rate-limits %s; waiting %.0f s", self.channel, retry_after)
                return retry_after
            log.error("Slack refused a call to %s: %s", self.channel, exc.response.get("error"))
            item.give_up()
        except (aiohttp.ClientError, TimeoutError, StoreError) as exc:
            # Slack did not answer, or took a message whose place the database could not
            # keep: the item keeps what it has to say (or to keep) and tries again; its
            # notices stay undelivered in the store meanwhile.
            self._failures += 1
            pause = min(RETRY_MAX_S, RETRY_INITIAL_S * 2.0 ** (self._failures - 1))
            what = (
                "the database did not keep where a message is"
                if isinstance(exc, StoreError)
                else "Slack did not answer"
            )
            log.warning("%s for %s (%s); again in %.1f s", what, self.channel, exc, pause)
            return pause
        except Exception:
            log.exception("posting to %s failed; dropping that update", self.channel)
            item.give_up()
        return 0.0


def _retry_after(exc: SlackApiError) -> float:
    header = exc.response.headers.get("Retry-After") or exc.response.headers.get("retry-after")
    if isinstance(header, list):
        header = header[0] if header else None
    try:
        return max(0.0, float(header)) if header is not None else 1.0
    except ValueError:
        return 1.0


class Outboxes:
    """One `ChannelOutbox` per channel, created on first use."""

    def __init__(self, client: AsyncWebClient, rate: float) -> None:
        self.client = client
        self.rate = rate
        self._boxes: dict[str, ChannelOutbox] = {}
        self.on_throttled: Callable[[], None] | None = None  # a 429 past the SDK's retries

    def touch(self, item: Item) -> None:
        box = self._boxes.get(item.channel)
        if box is None:
            box = self._boxes[item.channel] = ChannelOutbox(item.channel, self.client, self.rate)
            box.on_throttled = self.on_throttled
        box.touch(item)

    async def idle(self) -> None:
        """Wait until every channel has said all it had to say."""
        while not all(box._idle.is_set() for box in self._boxes.values()):
            await asyncio.gather(*(box.idle() for box in list(self._boxes.values())))

    async def close(self, grace_s: float = 5.0) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self.idle()
        for box in self._boxes.values():
            await box.close()
