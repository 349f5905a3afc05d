"""The notices chat must still be told, as a chat front end delivers them: the core
writes each notice with the change it tells of (store/outbox.py); a front end claims a
job's notices for a while (a delivery claim, so one process writes a thread at a time),
reads them, and marks them delivered part by part (handlers/slack/threads.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from bot.models.notices import Notice
from store.db import Store


class ChatOutbox:
    def __init__(self, store: Store) -> None:
        self.store = store

    def wake_on_notice(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever this process writes a notice (others' are polled for)."""
        self.store.wake.on_notice = wake

    async def new_since(self, after: int, limit: int) -> list[Notice]:
        return await self.store.outbox.new_since(after, limit)

    async def undelivered(self, job_id: str) -> list[Notice]:
        return await self.store.outbox.undelivered(job_id)

    async def claim(
        self, job_ids: Sequence[str], me: str, now: datetime, until: datetime
    ) -> set[str]:
        """The jobs of `job_ids` whose notices `me` now delivers, until `until`."""
        return await self.store.outbox.claim(job_ids, me, now, until)

    async def renew(self, me: str, until: datetime) -> set[str]:
        """Extend `me`'s delivery claims until `until`; the jobs it still holds."""
        return await self.store.outbox.renew_delivery_claims(me, until)

    async def orphaned(self, now: datetime, limit: int) -> list[str]:
        """Jobs with notices undelivered whose delivery claim lapsed (its process died)."""
        return await self.store.outbox.orphaned(now, limit)

    async def mark_delivered(
        self, ids: Sequence[int], now: datetime, parts: Sequence[tuple[int, str]] = ()
    ) -> None:
        await self.store.outbox.mark_delivered(ids, now, parts)

    async def release(self, job_id: str, me: str, now: datetime) -> None:
        await self.store.outbox.release(job_id, me, now)
