"""A pace for Slack methods whose limit is per workspace (Slack's "tiers").

chat.postMessage has its own limit per channel (handlers/slack/outbox.py); the other
methods are limited per method per workspace, by tier: chat.postEphemeral is Tier 4,
"100+ per minute". Answers to commands go through a `Pacer` so that a burst of people
(or of retries) never turns into 429s: up to `burst` calls at once, then one every
`60 / per_minute` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

TIER_4_PER_MINUTE = 100.0


class Pacer:
    """A token bucket. `clock` and `sleep` are injectable for tests."""

    def __init__(
        self,
        per_minute: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.interval_s = 60.0 / per_minute
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._at = clock()
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        """Return when one more call fits the pace (callers are served in turn)."""
        async with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) / self.interval_s)
            self._at = now
            if self._tokens < 1:
                await self._sleep((1 - self._tokens) * self.interval_s)  # pacing, not sync
                self._tokens = 1.0
                self._at = self._clock()
            self._tokens -= 1
