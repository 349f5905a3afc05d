"""Whether the database answers, as last seen, for what must not wait on it.

`/readyz`, `/metrics` and chat's acknowledgements (Slack allows 3 s) cannot wait for a
database that has stopped answering: a write then waits for a connection (PostgreSQL's
pool, up to its timeout) or for SQLite's lock. So one probe at a time (`SELECT 1`) is
made every `every_s`; an answer within `timeout_s` means reachable, anything else
(an error, no answer yet) unreachable, until a later probe answers. A probe still
waiting is not started again: a dead database never piles up a probe per look.
"""

from __future__ import annotations

import asyncio
import logging
import time

from store.db import Store

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 1.0


class StoreWatch:
    def __init__(self, store: Store, every_s: float, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.store = store
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.reachable = True  # until a probe says otherwise: the store opened
        self.problem = ""  # why not, for the log and /readyz
        self.since = time.monotonic()
        self._probe: asyncio.Task[None] | None = None

    async def check(self) -> bool:
        """Probe now (or wait for the probe under way), up to `timeout_s`."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self.store.ping(), name="store-probe")
        done, _pending = await asyncio.wait({self._probe}, timeout=self.timeout_s)
        if not done:
            self.seen(f"no answer within {self.timeout_s:g} s")
        elif (error := self._probe.exception()) is not None:
            self.seen(f"{type(error).__name__}: {str(error).strip()[:200]}")
        else:
            self.seen("")
        return self.reachable

    def seen(self, problem: str) -> None:
        """What a look at the store found: "" when it answered, else why not."""
        reachable = not problem
        if reachable != self.reachable:
            self.since = time.monotonic()
            if reachable:
                log.warning("the database answers again")
            else:
                log.warning("the database is not answering: %s", problem)
        self.reachable, self.problem = reachable, problem

    async def loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.every_s)  # pacing, not synchronisation
