"""The deploy kind: a VM from a template, run by the pipeline (bot/kinds/deploy/pipeline.py).

A destroy is a phase of this kind, not a kind of its own: it acts on the deploy's VM
under the deploy's id and row (DESTROY_REQUESTED -> DESTROYING -> DESTROYED), so its
approval and its recovery are this kind's, picked by the row's state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from backends.base import Backend
from bot.jobs.waiting import protected
from bot.kinds import DEPLOY, Rows
from bot.models import ApprovalState, Job, JobState
from bot.ownership.recovery import INTERRUPTED, interrupted_by, recover_interrupted

if TYPE_CHECKING:
    from bot.addresses.allocation import Addressing
    from bot.approvals.decisions import Approvals
    from bot.kinds.deploy.destroy import Destroyer
    from bot.kinds.deploy.pipeline import Pipeline
    from bot.ownership.claims import Ended


class DeployKind:
    name = DEPLOY
    noun = "job"
    rows: Rows = "jobs"

    def __init__(
        self,
        pipeline: Pipeline,
        backends: Mapping[str, Backend],
        approvals: Approvals,
        destroyer: Destroyer,
        addressing: Addressing,
        resolve: Callable[[str], Awaitable[str]],
        load: Callable[[str], Awaitable[Job]],
        cancel: Callable[[str, str], Awaitable[Job]],
    ) -> None:
        """`resolve`: the id of the job a person named (an id or a prefix:
        bot/jobs/refs.py); `load`: the job of an id; `cancel`: bot/jobs/cancel.py."""
        self.pipeline, self.backends, self.approvals = pipeline, backends, approvals
        self.destroyer, self.addressing = destroyer, addressing
        self._resolve, self._load, self._cancel = resolve, load, cancel

    async def run(self, job_id: str) -> object:
        return await self.pipeline.run(job_id)

    async def recover(self, job: Job, ended: Ended | None) -> bool:
        if job.state is JobState.DESTROYING:  # a destroy: finish it (bot/kinds/deploy/destroy.py)
            await protected(self.destroyer.run(job))
            return False
        why = interrupted_by(ended.error) if ended else INTERRUPTED
        report = await protected(recover_interrupted(self.pipeline, self.backends, job, why))
        return report is None

    def sweep(self) -> Coroutine[Any, Any, object] | None:
        return None  # its rows are `jobs` rows: ownership takes them over one by one

    async def decide(
        self,
        ref: str,
        approver: str,
        approved: bool,
        reason: str | None = None,
        dedupe_key: str | None = None,
    ) -> Job:
        """The deploy's approval, or its destroy's when one waits for an approver."""
        job = await self._load(await self._resolve(ref))
        if job.state is JobState.DESTROY_REQUESTED:
            return await self.destroyer.decide(job.id, approver, approved, reason, dedupe_key)
        outcome = ApprovalState.APPROVED if approved else ApprovalState.REJECTED
        decided = await self.approvals.decide(job.id, approver, outcome, reason, dedupe_key)
        if not approved:
            await self.addressing.release_quietly(decided)
        return decided

    async def may_decide(self, ref: str, approver: str) -> Job:
        job = await self._load(await self._resolve(ref))
        if job.state is JobState.DESTROY_REQUESTED:
            return await self.destroyer.check_decider(job.id, approver)
        return await self.approvals.check_decider(job.id, approver)

    async def cancel(self, ref: str, user: str) -> Job:
        return await self._cancel(await self._resolve(ref), user)
