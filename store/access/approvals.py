"""`Store`'s approvals (split from store/db.py): read one, decide it with its notices in
the same transaction, expire and cancel (store/approvals.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from bot.models import Approval, ApprovalState, utcnow
from bot.models.notices import Notice
from store import approvals
from store.access.base import Access


class ApprovalAccess(Access):
    """Mixed into `Store`."""

    async def get_approval(self, job_id: str) -> Approval | None:
        return await self._call(approvals.get_approval, job_id)

    async def decide(
        self,
        job_id: str,
        decision: ApprovalState,
        *,
        by: str | None,
        note: str | None = None,
        at: datetime | None = None,
        dedupe_key: str | None = None,
        notices: Sequence[Notice] = (),
    ) -> bool:
        decided = await self._write(
            approvals.decide,
            job_id,
            decision,
            by=by,
            note=note,
            at=at,
            dedupe_key=dedupe_key,
            notices=notices,
        )
        self._noticed(decided and bool(notices))
        return decided

    async def expired_approvals(self, now: datetime) -> list[str]:
        return await self._call(approvals.expired_approvals, now)

    async def cancel_awaiting(
        self, job_id: str, *, by: str, notices: Sequence[Notice] = ()
    ) -> bool:
        """Cancel a job awaiting approval and close its approval in one transaction."""
        cancelled = await self._write(
            approvals.cancel_awaiting, job_id, by=by, at=utcnow(), notices=notices
        )
        self._noticed(cancelled and bool(notices))
        return cancelled
