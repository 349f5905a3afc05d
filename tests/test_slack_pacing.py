"""The pace kept for per-workspace Slack limits (chat.postEphemeral: Tier 4)."""

from __future__ import annotations

import asyncio

from handlers.slack.pacing import Pacer


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


async def test_a_burst_passes_then_calls_are_spaced_by_the_tier() -> None:
    t = FakeTime()
    pacer = Pacer(per_minute=60, burst=3, clock=t.clock, sleep=t.sleep)
    for _ in range(5):
        await pacer.wait()
    assert t.slept == [1.0, 1.0]  # three at once, then one a second
    t.now += 10  # a quiet spell refills the bucket, up to the burst only
    for _ in range(4):
        await pacer.wait()
    assert t.slept == [1.0, 1.0, 1.0]


async def test_concurrent_callers_are_served_in_turn() -> None:
    t = FakeTime()
    pacer = Pacer(per_minute=120, burst=1, clock=t.clock, sleep=t.sleep)
    await asyncio.gather(*(pacer.wait() for _ in range(4)))
    assert t.slept == [0.5, 0.5, 0.5] and t.now == 1.5
