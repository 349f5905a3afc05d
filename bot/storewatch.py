"""Whether the database answers, as last seen, for what must not wait on it.

`/readyz`, `/metrics` and chat's acknowledgements (Slack allows 3 s) cannot wait for a
database that has stopped answering: a write then waits for a connection (PostgreSQL's
pool, up to its timeout) or for SQLite's lock. So one probe at a time (`SELECT 1`) is
made every `every_s`. An error (the driver's: no connection, the server shut down)
means unreachable at once. A probe that is only slow does not: on SQLite it waits
behind the writes queued on the store's one thread, and a burst of deploys is no
outage; only `slow_probes` probes in a row without an answer within `timeout_s` are.
A probe still waiting is not started again: a dead database never piles up a probe
per look. A later probe that answers makes it reachable again.
"""

from __future__ import annotations

import asyncio
import logging

from store.db import Store

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 1.0
SLOW_PROBES = 3  # in a row, each unanswered for PROBE_TIMEOUT_S: an outage, not a burst


class StoreWatch:
    def __init__(
        self,
        store: Store,
        every_s: float,
        timeout_s: float = PROBE_TIMEOUT_S,
        slow_probes: int = SLOW_PROBES,
    ) -> None:
        self.store = store
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.slow_probes = slow_probes
        self.reachable = True  # until a probe says otherwise: the store opened
        self.problem = ""  # why not, for the log and /readyz
        self._slow = 0  # probes in a row that got no answer within timeout_s
        self._probe: asyncio.Task[None] | None = None

    async def check(self) -> bool:
        """Probe now (or wait for the probe under way), up to `timeout_s`."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self.store.ping(), name="store-probe")
        done, _pending = await asyncio.wait({self._probe}, timeout=self.timeout_s)
        if not done:
            self._slow += 1
            if self._slow >= self.slow_probes:
                waited = self._slow * self.timeout_s
                self.seen(f"no answer to {self._slow} probes in a row (over {waited:g} s)")
        elif (error := self._probe.exception()) is not None:
            self.seen(f"{type(error).__name__}: {str(error).strip()[:200]}")
        else:
            self.seen("")
        return self.reachable

    def seen(self, problem: str) -> None:
        """What a look at the store found: "" when it answered, else why not (an error,
        or answers that stopped coming)."""
        reachable = not problem
        if reachable:
            self._slow = 0
        if reachable != self.reachable:
            if reachable:
                log.warning("the database answers again")
            else:
                log.warning("the database is not answering: %s", problem)
        self.reachable, self.problem = reachable, problem

    async def loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.every_s)  # pacing, not synchronisation
