"""The event loop's worst stall, as every benchmark measures it."""

from __future__ import annotations

import asyncio


async def ticker(worst: list[float], stop: asyncio.Event, period_s: float = 0.005) -> None:
    """How late a short timer fires, at worst: a blocking call on the loop shows here.

    Keeps the largest lateness in `worst[0]` until `stop` is set.
    """
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(period_s)
        worst[0] = max(worst[0], loop.time() - before - period_s)
