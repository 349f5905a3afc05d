"""`Store`'s jobs (split from store/db.py): insert with its dedupe key and quota caps,
read, compare-and-set, events, history and the counts front ends show (store/jobs.py,
quarantine.py, destroys.py, durations.py, quotas.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import datetime
from typing import Any

from bot.models import Approval, Claim, Job, JobEvent, JobState
from bot.models.notices import Notice
from store import destroys, durations, jobs, quarantine, quotas
from store.access.base import Access
from store.quarantine import Quarantined


class JobAccess(Access):
    """Mixed into `Store`."""

    async def insert_job(
        self,
        job: Job,
        approval: Approval | None = None,
        *,
        dedupe_key: str | None = None,
        announce: bool = False,
        caps: Sequence[quotas.Cap] = (),
    ) -> Job:
        """Raises `DuplicateActive` when a job in flight holds the name or the address,
        `AlreadyDelivered` when `dedupe_key` was used before (then nothing is written),
        `quotas.OverQuota` when it does not fit one of `caps` (checked in the insert's
        transaction). Returns the job as stored: with a fresh id if its random one was
        taken. With `announce`, chat is told of the new job (a notice in the same
        transaction)."""
        stored = await self._write(jobs.insert_job, job, approval, dedupe_key, announce, caps)
        self._noticed(announce)
        return stored

    async def delivered(self, dedupe_key: str) -> str | None:
        """The job a dedupe key was used for, or None when it is new."""
        return await self._call(jobs.delivered, dedupe_key)

    async def holder(self, *, backend: str, name: str, address: str) -> Job | None:
        return await self._call(jobs.holder, backend=backend, name=name, address=address)

    async def get_job(self, job_id: str) -> Job | None:
        """None when there is no such job or it is quarantined (see `quarantined`)."""
        return await self._call(jobs.get_job, job_id)

    async def match_ids(self, prefix: str, limit: int = 10) -> list[tuple[str, str, str]]:
        """(id, name, state) of jobs whose id starts with `prefix`; an exact match first."""
        return await self._call(jobs.match_ids, prefix, limit)

    async def kind_of(self, ref: str) -> str | None:
        """The kind of the job or build `ref` (an id or a prefix) names (bot/kinds/)."""
        return await self._call(jobs.kind_of, ref)

    async def quarantined(self, job_id: str) -> Quarantined | None:
        """Why this job was set aside, or None when it was not."""
        return await self._call(quarantine.find, job_id)

    async def quarantine_records(self, limit: int = 100) -> list[Quarantined]:
        """Every row set aside, newest first."""
        return await self._call(quarantine.records, limit)

    async def transition(
        self,
        job_id: str,
        expected: Iterable[JobState],
        new: JobState,
        *,
        held_by: Claim | None = None,
        notices: Sequence[Notice] = (),
        events: Sequence[JobEvent] = (),
        **fields: Any,
    ) -> bool:
        """Compare-and-set; with `held_by`, only while that claim holds the job. The
        `notices` and `events` are kept in the same transaction, and only if the job
        moved."""
        moved = await self._write(
            jobs.transition, job_id, tuple(expected), new, held_by, notices, events, **fields
        )
        self._noticed(moved and bool(notices))
        return moved

    async def move(
        self,
        job_id: str,
        expected: Iterable[JobState],
        new: JobState,
        *,
        held_by: Claim | None = None,
        notices: Sequence[Notice] = (),
        events: Sequence[JobEvent] = (),
        **fields: Any,
    ) -> tuple[bool, Job | None]:
        """`transition` answering (moved, the job as it now is) in one round trip."""
        moved, job = await self._write(
            jobs.move, job_id, tuple(expected), new, held_by, notices, events, **fields
        )
        self._noticed(moved and bool(notices))
        return moved, job

    async def update_job(
        self,
        job_id: str,
        *,
        held_by: Claim | None = None,
        notices: Sequence[Notice] = (),
        events: Sequence[JobEvent] = (),
        **fields: Any,
    ) -> bool:
        """Set columns; `notices` and `events` in the same transaction, if it changed."""
        changed = await self._write(jobs.update_job, job_id, held_by, notices, events, **fields)
        self._noticed(changed and bool(notices))
        return changed

    async def add_event(
        self, event: JobEvent, notice: Notice | None = None, held_by: Claim | None = None
    ) -> bool:
        """Returns once the event is committed; events of deploys that end a step in the
        same moment are written by one call (store/jobs.add_events). With `held_by`, written only
        while that claim holds the job: False when it did not."""
        added = await self.engine.write_merged(jobs.add_events, (event, notice, held_by))
        self._noticed(added and notice is not None)
        return added

    async def events(self, job_id: str) -> list[JobEvent]:
        return await self._call(jobs.events, job_id)

    async def step_durations(
        self, backend: str, steps: Sequence[str], limit: int
    ) -> list[durations.StepRow]:
        return await self._call(durations.step_durations, backend, steps, limit)

    async def history(
        self,
        *,
        requester: str | None = None,
        state: JobState | None = None,
        name: str | None = None,
        address: str | None = None,
        since: datetime | None = None,
        limit: int = 10,
    ) -> list[Job]:
        return await self._call(
            jobs.history,
            requester=requester,
            state=state,
            name=name,
            address=address,
            since=since,
            limit=limit,
        )

    async def history_pages(
        self,
        *,
        requester: str | None = None,
        state: JobState | None = None,
        name: str | None = None,
        limit: int = 10,
        page_size: int = 500,
    ) -> AsyncIterator[list[Job]]:
        """`history`'s first `limit` jobs, newest first, a page of at most `page_size` at
        a time (one query each): a long listing holds one page in memory, not all."""
        after: jobs.HistoryCursor | None = None
        left = limit
        while left > 0:
            page, after = await self._call(
                jobs.history_page,
                requester=requester,
                state=state,
                name=name,
                after=after,
                limit=min(page_size, left),
            )
            left -= len(page)
            if page:
                yield page
            if after is None:
                return

    async def count_by_state(self) -> dict[str, int]:
        return await self._call(jobs.count_by_state)

    async def jobs_with_wreckage(self) -> list[Job]:
        return await self._call(jobs.jobs_with_wreckage)

    async def jobs_in(self, states: Iterable[JobState]) -> list[Job]:
        return await self._call(jobs.jobs_in, tuple(states))

    async def live_jobs(self, requester: str | None, limit: int, offset: int = 0) -> list[Job]:
        """Jobs that hold their VM (store/destroys.py), newest first: one page."""
        return await self._call(destroys.live, requester, limit, offset)

    async def count_live(self, requester: str | None) -> int:
        return await self._call(destroys.count_live, requester)

    async def quota_usage(self, members: Iterable[str]) -> quotas.Usage:
        """What the jobs of these requesters hold now (store/quotas.py)."""
        return await self._call(quotas.usage, frozenset(members))

    async def transition_once(
        self,
        dedupe_key: str | None,
        job_id: str,
        expected: Iterable[JobState],
        new: JobState,
        *,
        notices: Sequence[Notice] = (),
        **fields: Any,
    ) -> bool:
        """A compare-and-set that claims a chat delivery with it (a destroy's decision):
        raises `AlreadyDelivered` for a key seen before."""
        moved = await self._write(
            destroys.transition_once, dedupe_key, job_id, tuple(expected), new, notices, **fields
        )
        self._noticed(moved and bool(notices))
        return moved
