"""`Store`'s messages to and from chat (split from store/db.py): the outbox of notices a
front end delivers (store/outbox.py) and the inbox of chat deliveries being handled
(store/inbox.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from bot.models.notices import Notice, Received
from store import inbox, outbox
from store.access.base import Access


class MessageAccess(Access):
    """Mixed into `Store`."""

    # --- the outbox (store/outbox.py) -------------------------------------------------

    async def outbox_new_since(self, after: int, limit: int) -> list[Notice]:
        return await self._call(outbox.new_since, after, limit)

    async def outbox_undelivered(self, job_id: str) -> list[Notice]:
        return await self._call(outbox.undelivered, job_id)

    async def outbox_claim(
        self, job_ids: Sequence[str], me: str, now: datetime, until: datetime
    ) -> set[str]:
        if not job_ids:
            return set()
        return await self._write(outbox.claim, list(job_ids), me, now, until)

    async def outbox_renew(self, me: str, until: datetime) -> None:
        await self._call(outbox.renew, me, until)

    async def outbox_orphaned(self, now: datetime, limit: int) -> list[str]:
        return await self._call(outbox.orphaned, now, limit)

    async def outbox_mark_delivered(
        self, ids: Sequence[int], now: datetime, parts: Sequence[tuple[int, str]] = ()
    ) -> None:
        await self._write(outbox.mark_delivered, list(ids), now, list(parts))

    async def outbox_release(self, job_id: str, me: str, now: datetime) -> None:
        await self._write(outbox.release, job_id, me, now)

    async def outbox_pending(self) -> int:
        return await self._call(outbox.pending_count)

    # --- the inbox (store/inbox.py) ---------------------------------------------------

    async def inbox_add(
        self,
        item: Received,
        me: str,
        until: datetime,
        wanted: Callable[[], bool] | None = None,
    ) -> bool:
        """Keep a command; with `wanted`, only if it still says yes at the commit."""
        return await self._call(inbox.add, item, me, until, wanted)

    async def inbox_refuse(self, item: Received, now: datetime) -> None:
        """Mark a refused command done, kept or not (store/inbox.refuse)."""
        await self._call(inbox.refuse, item, now)

    async def inbox_done(self, key: str, now: datetime) -> None:
        await self._write(inbox.done, key, now)

    async def inbox_claim_orphaned(
        self, me: str, now: datetime, until: datetime, limit: int
    ) -> list[Received]:
        return await self._write(inbox.claim_orphaned, me, now, until, limit)
