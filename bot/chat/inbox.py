"""Commands from chat, kept from their acknowledgement until they are answered.

A chat front end acknowledges a command at once (Slack allows 3 s) and carries it out
afterwards; a process that dies in between must not lose it silently. So the front end
calls `receive` before it acknowledges and `done` once it has answered, and looks for
`orphans` now and then: commands whose runner died before answering them, taken over
(store/inbox.py) and carried out again under the same dedupe key, so one that had
already made its job is answered as such rather than run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from bot.jobs import progress as tell
from bot.models import JobEvent
from bot.models.errors import StoreError
from bot.models.notices import Received
from bot.ownership.claims import Ownership
from bot.ownership.storewatch import StoreWatch
from store.db import Store
from store.engine import is_database_error

log = logging.getLogger(__name__)

# Slack waits 3 s for the acknowledgement: keeping the command gets 2 of them.
RECEIVE_WITHIN_S = 2.0
_REFUSING: set[asyncio.Task[None]] = set()  # refusals still to be recorded

ORPHANS_PER_LOOK = 10
RESUMED_STEP = "inbox"  # the job event that says its command was carried out late


class NotKept(StoreError):
    """The database did not answer in time: the command was not kept, and never runs."""


class Inbox:
    """This runner's commands from chat, kept in the store (store/inbox.py)."""

    def __init__(
        self, store: Store, ownership: Ownership, storewatch: StoreWatch, tick_s: float
    ) -> None:
        """`tick_s`: how often a refusal the database did not take is tried again."""
        self.store, self.ownership, self.storewatch = store, ownership, storewatch
        self.tick_s = tick_s

    async def tell_resumed(self, key: str, text: str) -> bool:
        """The command kept under `key`, taken over from a process that stopped before
        answering, made (or had made) a job: say so in that job's thread (`text`), once,
        through the outbox. The person may have been shown an error by the chat while
        the VM was being built; this tells the channel the command is carried out after
        all. False when the command made no job, or the job was already told."""
        store = self.store
        job_id = await store.jobs.delivered(key)
        if job_id is None:
            return False
        if any(e.step == RESUMED_STEP for e in await store.jobs.events(job_id)):
            return False  # told by a process that stopped before striking the command
        event = JobEvent(job_id=job_id, step=RESUMED_STEP, phase="note", detail=text)
        await store.jobs.add_event(event, tell.noted(job_id, text))
        return True

    async def receive(
        self, key: str, user: str, channel: str, text: str, within_s: float = RECEIVE_WITHIN_S
    ) -> bool:
        """Keep the command for this runner; False when this delivery was received before.

        Raises `NotKept` at once while the database is known not to answer
        (bot/ownership/storewatch.py), or when keeping it takes longer than `within_s` (the chat
        waits for its acknowledgement): the person is told it was refused, so it must
        never run. The write still waiting is told to roll back instead of committing,
        and once the database answers the command is marked done in any case (should it
        have committed after all), so neither this process nor another ever carries it
        out."""
        own, store = self.ownership, self.store
        if not self.storewatch.reachable:
            raise NotKept(self.storewatch.problem)
        now = own.clock()
        item = Received(key=key, user=user, channel=channel, text=text, received_at=now)
        gave_up = threading.Event()  # read by the store's thread just before its commit
        adding = asyncio.ensure_future(
            store.inbox.add(item, own.id, own.claim_until(now), lambda: not gave_up.is_set())
        )
        done, _pending = await asyncio.wait({adding}, timeout=within_s)
        if adding in done and not _unanswered(adding):
            return adding.result()
        gave_up.set()
        task = asyncio.create_task(self._refuse(item, adding), name=f"refuse-{key}")
        _REFUSING.add(task)
        task.add_done_callback(_REFUSING.discard)
        raise NotKept(self.storewatch.problem or "no answer in time")

    async def _refuse(self, item: Received, adding: asyncio.Future[bool]) -> None:
        """Once the abandoned write has ended, mark the command done, trying again every
        tick until the database answers."""
        with contextlib.suppress(Exception):
            await adding
        while True:
            try:
                await self.store.inbox.refuse(item, self.ownership.clock())
                return
            except Exception as exc:
                log.info(
                    "command %s: cannot mark it refused yet (%s)", item.key, type(exc).__name__
                )
            await asyncio.sleep(self.tick_s)  # pacing, not sync

    async def done(self, key: str) -> None:
        await self.store.inbox.done(key, self.ownership.clock())

    async def orphans(self) -> list[Received]:
        """Commands a dead runner took and never answered, now this runner's to carry
        out. Only a long-lived process takes them (a one-shot CLI run takes nothing
        over)."""
        own = self.ownership
        if not own.takes_over or own.closing:
            return []
        now = own.clock()
        return await self.store.inbox.claim_orphaned(
            own.id, now, own.claim_until(now), ORPHANS_PER_LOOK
        )


def _unanswered(adding: asyncio.Future[bool]) -> bool:
    """The write failed because the database did not answer (not a bug: refuse plainly)."""
    error = adding.exception()
    return error is not None and is_database_error(error)


async def settle_refusals(within_s: float) -> None:
    """At stop, before this runner's commands go back to the others: record the
    refusals still pending (a refused command must never be carried out by another
    process), for as long as `within_s` allows."""
    if _REFUSING:
        await asyncio.wait(set(_REFUSING), timeout=within_s)
    if _REFUSING:
        log.warning("%d refused command(s) not yet recorded as refused", len(_REFUSING))
