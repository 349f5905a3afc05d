"""The core's front door: what every front end (shell, Slack) calls.

`Deployer` owns the store, the backends, the queue and the pipeline. It turns parsed
commands into jobs, applies the approval policy, and answers status and history. Every
refusal is a `DeployBotError` whose message says what to do instead; nothing here
formats chat text (that is handlers/messages.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from backends.base import Backend, BackendError, Template, VMRef
from bot.errors import Conflict, JobNotFound, NotAllowed, RequestInvalid, TransitionRefused
from bot.models import (
    ACTIVE_STATES,
    Approval,
    ApprovalState,
    DeployRequest,
    Job,
    JobEvent,
    JobState,
    utcnow,
)
from bot.parser import DeployArgs
from bot.pipeline import Pipeline, Undo, protected
from bot.progress import Fanout, Progress
from bot.queue import JobQueue
from bot.requests import build_request
from bot.settings import ApprovalPolicy, Settings
from store.db import DuplicateActive, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobStatus:
    job: Job
    events: list[JobEvent]
    approval: Approval | None


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


class Deployer:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        progress: Progress | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.backends = dict(backends)
        self.progress = Fanout(*([progress] if progress else []))
        self.pipeline = Pipeline(settings, self.backends, store, self.progress)
        self.queue = JobQueue(
            self.pipeline.run,
            max_running=settings.limits.max_running,
            max_per_backend=settings.limits.max_running_per_backend,
        )
        self._expiry: asyncio.Task[None] | None = None

    # --- life cycle ---------------------------------------------------------------

    async def start(self, *, expire_every_s: float = 30.0) -> None:
        """Resume after a restart: re-queue queued jobs, roll back interrupted ones."""
        for job in await self.store.jobs_in([JobState.RUNNING, JobState.ROLLING_BACK]):
            await protected(self._recover_interrupted(job))
        for job in await self.store.jobs_in([JobState.QUEUED]):
            self.queue.submit(job.id, job.backend)
        self._expiry = asyncio.create_task(self._expire_loop(expire_every_s))

    async def close(self, grace_s: float = 30.0) -> None:
        if self._expiry:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.queue.shutdown(grace_s)

    async def drain(self) -> None:
        await self.queue.drain()

    async def _recover_interrupted(self, job: Job) -> None:
        """The process died mid-deploy: remove what the job may have built, then fail it."""
        backend = self.backends.get(job.backend)
        await self.store.transition(job.id, [JobState.RUNNING], JobState.ROLLING_BACK)
        stack: list[Undo] = []
        ref = None
        if backend is not None and job.vm_id is not None:
            ref = VMRef(job.vm_id, job.id, job.vm_placement)
            t = self.settings.timeouts
            stack = [
                Undo(f"destroy VM {ref.vm_id}", lambda: backend.destroy(ref), t.destroy_s),
                Undo(f"stop VM {ref.vm_id}", lambda: backend.power_off(ref), t.power_off_s),
            ]
        report = await self.pipeline.undo(job, backend, stack, ref) if backend is not None else None
        wreckage = ", ".join(report.wreckage) if report else None
        await self.store.transition(
            job.id,
            [JobState.ROLLING_BACK],
            JobState.FAILED,
            error="interrupted by a restart of the bot",
            wreckage=wreckage or None,
            finished_at=utcnow(),
        )
        final = await self.store.get_job(job.id)
        if final is not None:
            await self.progress.job_finished(final, report)

    # --- deploy -------------------------------------------------------------------

    async def request_deploy(
        self,
        args: DeployArgs,
        requester: str,
        *,
        ssh_keys: tuple[str, ...] = (),
        can_wait_for_approval: bool = True,
    ) -> Job:
        """Validate, record and queue (or send for approval) one deploy.

        A front end where nobody can approve (the one-shot CLI) passes
        `can_wait_for_approval=False`: such a request is refused before it is recorded.
        """
        policy = self.settings.approval
        if policy.deployers and requester not in policy.deployers:
            raise NotAllowed(
                f"{requester} is not on the list of people who may deploy; ask one of "
                f"{', '.join(policy.approvers) or 'the operators'} to add you."
            )
        request = build_request(args, self.settings, requester, user_keys=ssh_keys)
        await self._check_on_backend(request)
        reason = approval_reason(policy, request)
        if reason and not can_wait_for_approval:
            raise NotAllowed(
                f"This request needs approval ({reason}). Ask in Slack or in `deploybot shell`, "
                "where an approver can approve it."
            )
        state = JobState.AWAITING_APPROVAL if reason else JobState.QUEUED
        job = Job.for_request(request, state).model_copy(update={"approval_reason": reason})
        approval = None
        if reason:
            expires = job.created_at + timedelta(seconds=policy.expire_after_s)
            approval = Approval(job_id=job.id, reason_required=reason, expires_at=expires)
        try:
            await self.store.insert_job(job, approval)
        except DuplicateActive as dup:
            raise Conflict(await self._conflict_message(request, dup.what)) from None
        await self.progress.job_updated(job)
        if state is JobState.QUEUED:
            self.queue.submit(job.id, job.backend)
        return job

    async def _check_on_backend(self, request: DeployRequest) -> None:
        """Refuse unknown templates and placements before anything is recorded."""
        backend = self.backends.get(request.backend)
        if backend is None:
            raise RequestInvalid([f"No backend called {request.backend!r} is running."])
        problems = []
        try:
            templates = await backend.templates()
            placements = await backend.placements()
        except BackendError as exc:
            raise RequestInvalid(
                [f"{request.backend} did not answer ({exc.message}); try again in a minute."]
            ) from None
        names = [t.name for t in templates]
        if request.template not in names:
            problems.append(
                f"template: {request.template!r} is not a template on {request.backend}; "
                f"choose one of {', '.join(names)} (see `/deploy templates`)."
            )
        places = [p.name for p in placements]
        if request.placement is not None and request.placement not in places:
            choices = ", ".join([*places, *(b for b in self.backends)])
            problems.append(
                f"on: {request.placement!r} is neither a backend nor a node of "
                f"{request.backend}; choose one of {choices}."
            )
        if problems:
            raise RequestInvalid(problems)

    async def _conflict_message(self, request: DeployRequest, what: str) -> str:
        holder = next(
            (
                j
                for j in await self.store.jobs_in(ACTIVE_STATES)
                if (what == "name" and j.name == request.name and j.backend == request.backend)
                or (what == "address" and j.address == str(request.address.ip))
            ),
            None,
        )
        held = f" by job {holder.id} ({holder.name}, {holder.state.value})" if holder else ""
        if what == "name":
            return f"{request.name} is already being deployed{held}: pick another name or wait."
        return f"{request.address.ip} is already taken{held}: pick another address or wait."

    # --- approvals ----------------------------------------------------------------

    async def approve(self, job_id: str, approver: str) -> Job:
        return await self._decide(job_id, approver, ApprovalState.APPROVED, None)

    async def reject(self, job_id: str, approver: str, reason: str) -> Job:
        return await self._decide(job_id, approver, ApprovalState.REJECTED, reason)

    async def _decide(
        self, job_id: str, approver: str, decision: ApprovalState, note: str | None
    ) -> Job:
        job = await self._job(job_id)
        approvers = self.settings.approval.approvers
        if approver not in approvers:
            raise NotAllowed(
                f"{approver} may not approve deploys; the approvers are {', '.join(approvers)}."
            )
        if approver == job.requester:
            raise NotAllowed("You cannot approve or reject your own request: ask another approver.")
        if not await self.store.decide(job_id, decision, by=approver, note=note):
            current = await self._job(job_id)
            raise TransitionRefused(
                f"Job {job_id} is {current.state.value}, not awaiting approval: nothing to decide."
            )
        decided = await self._job(job_id)
        await self.progress.job_updated(decided, note or "")
        if decision is ApprovalState.APPROVED:
            self.queue.submit(decided.id, decided.backend)
        return decided

    async def expire_approvals(self, now: datetime | None = None) -> list[Job]:
        expired = []
        for job_id in await self.store.expired_approvals(now or utcnow()):
            if await self.store.decide(job_id, ApprovalState.EXPIRED, by=None, at=now):
                job = await self._job(job_id)
                await self.progress.job_updated(job)
                expired.append(job)
        return expired

    async def _expire_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.expire_approvals()
            except Exception:
                log.exception("expiring approvals failed")

    # --- other commands -----------------------------------------------------------

    async def cancel(self, job_id: str, user: str) -> Job:
        job = await self._job(job_id)
        if user != job.requester and user not in self.settings.approval.approvers:
            raise NotAllowed(f"Only {job.requester} or an approver can cancel job {job_id}.")
        if job.state in (JobState.QUEUED, JobState.AWAITING_APPROVAL):
            if await self.store.transition(
                job_id, [job.state], JobState.CANCELLED, error="cancelled", finished_at=utcnow()
            ):
                self.queue.cancel(job_id)
                cancelled = await self._job(job_id)
                await self.progress.job_updated(cancelled, f"cancelled by {user}")
                return cancelled
            job = await self._job(job_id)
        if job.state in (JobState.RUNNING, JobState.ROLLING_BACK) and self.queue.cancel(job_id):
            return job
        raise TransitionRefused(f"Job {job_id} is {job.state.value}: there is nothing to cancel.")

    async def status(self, job_id: str) -> JobStatus:
        job = await self._job(job_id)
        return JobStatus(
            job, await self.store.events(job_id), await self.store.get_approval(job_id)
        )

    async def history(self, limit: int = 10, requester: str | None = None) -> list[Job]:
        return await self.store.history(requester=requester, limit=limit)

    async def templates(self) -> dict[str, list[Template] | str]:
        """Templates per backend; a backend that does not answer gets its error text."""
        found: dict[str, list[Template] | str] = {}
        for name, backend in self.backends.items():
            try:
                found[name] = await backend.templates()
            except BackendError as exc:
                found[name] = exc.message
        return found

    async def _job(self, job_id: str) -> Job:
        job = await self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(f"There is no job {job_id}; `/deploy history` lists recent ones.")
        return job
