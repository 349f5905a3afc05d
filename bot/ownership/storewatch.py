"""Whether the database answers, as last seen, for what must not wait on it.

`/readyz`, `/metrics` and chat's acknowledgements (Slack allows 3 s) cannot wait for a
database that has stopped answering: a write then waits for a connection (PostgreSQL's
pool, up to its timeout) or for SQLite's lock. So one probe at a time is made every
`every_s`: can the database record something now (store/db.py `ping`: a `SELECT 1` in a
write transaction; on SQLite that takes the file's write lock and lets it go). An error
(the driver's: no connection, the server shut down, a read-only file) means unreachable
at once. A probe
that is only slow does not: on SQLite it waits behind the writes queued on the store's
one thread, or for another process's write lock ("database is locked" after
`timeout_s`), and a burst of deploys or a CLI's write is no outage; only `slow_probes`
probes in a row without an answer within `timeout_s` are (a lock held that long is:
nothing can be recorded meanwhile).
A probe still waiting is not started again: a dead database never piles up a probe
per look. A later probe that answers makes it reachable again.
"""

from __future__ import annotations

import asyncio
import logging

from store.db import Store
from store.retry import hint, locked

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 1.0
LOCK_WAIT_SHARE = 0.8
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
            # Waiting for the lock a little less than the look, so that a lock held
            # through it is seen as such (and named), not merely as no answer.
            probe = self.store.ping(wait_s=self.timeout_s * LOCK_WAIT_SHARE)
            self._probe = asyncio.create_task(probe, name="store-probe")
        done, _pending = await asyncio.wait({self._probe}, timeout=self.timeout_s)
        error = self._probe.exception() if done else None
        if not done or (error is not None and locked(error)):
            self._slow += 1
            if self._slow >= self.slow_probes:
                waited = self._slow * self.timeout_s
                why = f"; {hint(error)}" if error is not None else ""
                self.seen(f"no answer to {self._slow} probes in a row (over {waited:g} s){why}")
        elif error is not None:
            why = f" ({hint(error)})" if hint(error) else ""
            self.seen(f"{type(error).__name__}: {str(error).strip()[:200]}{why}")
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
                log.warning("the database %s is not answering: %s", self.store.label, problem)
        self.reachable, self.problem = reachable, problem

    async def loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.every_s)  # pacing, not synchronisation
