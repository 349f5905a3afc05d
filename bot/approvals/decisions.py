"""Approvals: which requests wait for an approver, who may decide, and the decision.

The policy comes from configuration; the decision is one compare-and-set in the store
(the approval row and the job move together or not at all), so a double click or two
approvers at once decide once. Nobody decides on their own request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

from bot.config.sections import ApprovalPolicy
from bot.config.settings import Settings
from bot.jobs import progress as tell
from bot.jobs.progress import Progress
from bot.models import ApprovalState, DeployRequest, Job, JobState, utcnow
from bot.models.errors import Duplicate, NotAllowed, TransitionRefused, UserError
from store.db import AlreadyDelivered, Store

log = logging.getLogger(__name__)
# How to list the members of a chat user group (an approver or quota group).
GroupMembers = Callable[[str], Awaitable[frozenset[str]]]


class Groups:
    """Chat user groups, for approver groups and quota groups (bot/requests/quotas.py). A chat
    front end that can list a group's members sets `members` when it starts; without
    one (the shell, the CLI) nobody is in a group."""

    def __init__(self) -> None:
        self.members: GroupMembers | None = None


def approval_reason(policy: ApprovalPolicy, request: DeployRequest) -> str | None:
    """Why this request needs an approver, or None when it may run at once."""
    if policy.always:
        return "every deploy needs approval"
    if request.backend in policy.backends:
        return f"deploys to {request.backend} need approval"
    if request.template in policy.templates:
        return f"deploys of {request.template} need approval"
    over = (
        ("cores", request.cores, policy.cores_over, ""),
        ("memory", request.memory_mib, policy.memory_mib_over, " MiB"),
        ("disk growth", request.disk_grow_gib, policy.disk_grow_gib_over, " GiB"),
    )
    for what, value, limit, unit in over:
        if limit is not None and value > limit:
            return f"{what} over {limit}{unit} needs approval"
    return None


def build_approval_reason(policy: ApprovalPolicy, requester_approves: bool) -> str | None:
    """Why a template build needs an approver (`[approval] builds`), or None. A template
    is shared: whoever deploys from it gets what the build put in it."""
    if policy.builds == "never":
        return None
    if policy.builds == "always":
        return "every template build needs approval"
    if requester_approves or not (policy.approvers or policy.approver_groups):
        return None  # an approver's own build, or nobody who could approve one
    return "template builds change templates everyone deploys from"


class Approvals:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        progress: Progress,
        start: Callable[[Job], Awaitable[bool]],
        job: Callable[[str], Awaitable[Job]],
        groups: Groups,
    ) -> None:
        self.policy = settings.approval
        self.store = store
        self.progress = progress
        self._start = start  # claims an approved job for this runner and queues it
        self._job = job
        self.groups = groups

    async def is_approver(self, user: str) -> bool:
        policy = self.policy
        if user in policy.approvers:
            return True
        return await self.in_groups(user, policy.approver_groups, "approver")

    async def in_groups(self, user: str, groups: Sequence[str], kind: str) -> bool:
        """Whether `user` is a member of one of these chat user groups. Without a front
        end that can list groups (the shell, the CLI) nobody is; a group that cannot be
        listed counts for nobody (logged as a `kind` group)."""
        members = self.groups.members
        if members is None:
            return False
        for group in groups:
            try:
                if user in await members(group):
                    return True
            except Exception:
                log.exception("could not list the members of %s group %s", kind, group)
        return False

    def approvers_text(self) -> str:
        policy = self.policy
        names = [*policy.approvers, *(f"the members of {g}" for g in policy.approver_groups)]
        return ", ".join(names) or "nobody (set approval.approvers)"

    async def decide(
        self,
        job_id: str,
        approver: str,
        decision: ApprovalState,
        note: str | None,
        dedupe_key: str | None = None,
    ) -> Job:
        if dedupe_key is not None and await self.store.jobs.delivered(dedupe_key):
            raise Duplicate(f"This decision on job {job_id} was already made.", job_id)
        await self.check_decider(job_id, approver)
        try:
            decided_now = await self.store.approvals.decide(
                job_id,
                decision,
                by=approver,
                note=note,
                dedupe_key=dedupe_key,
                notices=[tell.updated(job_id, note or "")],
            )
        except AlreadyDelivered:
            raise Duplicate(f"This decision on job {job_id} was already made.", job_id) from None
        if not decided_now:
            raise await self._undecidable(job_id)
        decided = await self._job(job_id)
        await self.progress.job_updated(decided, note or "")
        if decision is ApprovalState.APPROVED:
            await self._start(decided)  # False: another runner claimed it first
        return decided

    async def check_decider(self, job_id: str, approver: str) -> Job:
        """Refuse non-approvers, the requester, and jobs no longer awaiting approval."""
        job = await self._job(job_id)
        if not await self.is_approver(approver):
            raise NotAllowed(
                f"{approver} may not approve deploys; the approvers are {self.approvers_text()}.",
                people=(approver, *self.policy.approvers),
            )
        if approver == job.requester:
            raise NotAllowed("You cannot approve or reject your own request: ask another approver.")
        await self._refuse_if_expired(job)
        if job.state is not JobState.AWAITING_APPROVAL:
            raise await self._undecidable(job_id)
        return job

    async def _refuse_if_expired(self, job: Job) -> None:
        """A pending approval past its time expires now, even if the sweep has not run."""
        approval = await self.store.approvals.get(job.id)
        if approval is None or approval.state is not ApprovalState.PENDING:
            return
        if approval.expires_at > utcnow():
            return
        told = [tell.updated(job.id)]
        if await self.store.approvals.decide(job.id, ApprovalState.EXPIRED, by=None, notices=told):
            await self.progress.job_updated(await self._job(job.id))
        raise await self._undecidable(job.id)

    async def _undecidable(self, job_id: str) -> TransitionRefused:
        """Why a job cannot be decided on: already decided (by whom), expired, cancelled."""
        job = await self._job(job_id)
        approval = await self.store.approvals.get(job_id)
        if approval is not None and approval.state is ApprovalState.EXPIRED:
            return TransitionRefused(
                f"Job {job_id} expired at {approval.decided_at or approval.expires_at:%H:%M} UTC: "
                f"nobody approved it in time. {job.requester} can ask again.",
                people=(job.requester,),
            )
        if approval is not None and approval.decided_by:
            when = f" at {approval.decided_at:%H:%M} UTC" if approval.decided_at else ""
            return TransitionRefused(
                f"Job {job_id} is not awaiting approval any more: {approval.decided_by} "
                f"{approval.state.value} it{when}.",
                people=(approval.decided_by,),
            )
        return TransitionRefused(
            f"Job {job_id} is {job.state.value}, not awaiting approval: nothing to decide."
        )

    async def expire(self, now: datetime | None = None) -> list[Job]:
        """Expire every pending approval past its time; the jobs that expired now."""
        expired = []
        for job_id in await self.store.approvals.expired(now or utcnow()):
            told = [tell.updated(job_id)]
            if await self.store.approvals.decide(
                job_id, ApprovalState.EXPIRED, by=None, at=now, notices=told
            ):
                try:
                    job = await self._job(job_id)
                except UserError:  # its record is damaged (now quarantined): skip it
                    continue
                await self.progress.job_updated(job)
                expired.append(job)
        return expired
