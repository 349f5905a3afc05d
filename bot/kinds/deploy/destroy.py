"""Destroying a VM deploybot built: the other half of a job's life.

    succeeded ──destroy──────────────────────────> destroying ──VM gone──> destroyed
        │  ^                                          │
        │  └───────refused or failed (VM still there)─┘
        └──(policy: approval)──> destroy_requested ──approve──> destroying
                                     └──reject / cancel / expire──> succeeded

A destroy is a state of the job in the store, so it outlives the process that began
it: a `destroying` job has an owner and a claim like a running deploy
(bot/ownership/claims.py). When its owner dies another runner takes it over and `finish`es the
same destroy. Removing the VM is the rollback's path (bot/jobs/waiting.remove_vm): stop and
wait, destroy and wait; the backend refuses a VM without this job's tag (`NotOurVM`,
before touching anything) and counts a VM already gone as done, so a destroy carried
out twice removes once. The job's state change to `destroyed` frees its name and
address (the store's unique indexes no longer count it); its IPAM record goes back.

A later lease expiry can reuse this path: move the job to `destroying` with this runner
as owner, then `start` it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta

from backends.base import Backend, NotOurVM
from bot.addresses.allocation import Addressing
from bot.approvals.decisions import Approvals
from bot.config.settings import Settings
from bot.jobs import progress as tell
from bot.jobs import refs as jobrefs
from bot.jobs.progress import Progress
from bot.jobs.waiting import protected, remove_vm
from bot.kinds.deploy.destroyable import check_destroyable, failed, not_ours, unreachable_backend
from bot.kinds.deploy.runs import vm_ref
from bot.models import HOLDING_STATES, AuditEvent, Job, JobEvent, JobState
from bot.models.errors import (
    BackendError,
    Duplicate,
    JobNotFound,
    NotAllowed,
    RequestInvalid,
    TransitionRefused,
)
from bot.models.ids import JOB_REF_RE
from bot.models.notices import Notice
from bot.ownership.claims import Clock, Lost, Ownership
from store.db import AlreadyDelivered, Store

log = logging.getLogger(__name__)
Audit = Callable[[AuditEvent], Awaitable[None]]


class Destroyer:
    """Asks for, decides on and carries out destroys for one runner."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        progress: Progress,
        ownership: Ownership,
        addressing: Addressing,
        approvals: Approvals,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.policy = settings.approval
        self.store = store
        self.backends = backends
        self.progress = progress
        self.ownership = ownership
        self.addressing = addressing
        self.approvals = approvals
        self.clock = clock
        self.tasks: dict[str, asyncio.Task[Job | None]] = {}

    # --- asking -----------------------------------------------------------------------

    async def find(self, target: str) -> Job:
        """The job whose VM `target` names: a VM name deploybot holds, else a job id."""
        name = target.strip().lower() if target.isascii() else target
        held = [
            j
            for j in await self.store.jobs.history(name=name, limit=50)
            if j.state in HOLDING_STATES
        ]
        if len(held) > 1:
            which = ", ".join(f"{j.short_id} on {j.backend}" for j in held)
            raise RequestInvalid(
                [f"{target[:64]} names several VMs ({which}): say which with its job id."]
            )
        if held:
            return held[0]
        if JOB_REF_RE.fullmatch(name):
            return await jobrefs.load(self.store, await jobrefs.resolve(self.store, name))
        raise JobNotFound(
            f"deploybot holds no VM called {target[:64]}: check the name with `/deploy list` "
            "(it lists yours; `/deploy list all` everyone's)."
        )

    async def request(
        self,
        target: str,
        user: str,
        *,
        can_wait_for_approval: bool = True,
        dedupe_key: str | None = None,
    ) -> Job:
        """Destroy the VM `target` names now, or ask the approvers first (by policy)."""
        job = await self.find(target)
        await self._check_asker(job, user)
        check_destroyable(job)
        wait = self.policy.destroy == "always"
        if wait and not can_wait_for_approval:
            raise NotAllowed(
                "Destroys need approval here. Ask in Slack or in `deploybot shell`, where an "
                "approver can approve it."
            )
        new = JobState.DESTROY_REQUESTED if wait else JobState.DESTROYING
        fields: dict[str, object] = {
            "destroy_by": user,
            "destroy_asked_at": self.clock(),
            "destroy_approver": None,
            "destroy_ref": None,
        }
        if not wait:
            fields.update(owner=self.ownership.id, lease_until=self.ownership.claim_until())
        note = f"destroy asked by {user}"
        told = self._tell(job, tell.updated(job.id, note, by=user), wait)
        ready = [JobState.SUCCEEDED, JobState.EXPIRED_OFF]  # EXPIRED_OFF: its lease ended
        moved = await self._once(dedupe_key, job.id, ready, new, told, fields)
        if not moved:
            raise TransitionRefused(await self._why_not(job.id))
        return await self._moved(job.id, user, "requested", note)

    async def _once(
        self,
        key: str | None,
        job_id: str,
        expected: list[JobState],
        new: JobState,
        notices: list[Notice],
        fields: Mapping[str, object],
    ) -> bool:
        try:
            return await self.store.jobs.transition_once(
                key, job_id, expected, new, notices=notices, **fields
            )
        except AlreadyDelivered:
            raise Duplicate(
                f"This request about job {job_id} was already handled.", job_id
            ) from None

    async def _moved(self, job_id: str, user: str, outcome: str, note: str) -> Job:
        """After a move: audit it, tell the front ends, and start the destroy if due."""
        job = await jobrefs.load(self.store, job_id)
        await self._audit(user, job, outcome)
        await self.progress.job_updated(job, note)
        if job.state is JobState.DESTROYING and job.owner == self.ownership.id:
            self.start(job)
        return job

    async def may_destroy(self, user: str, job: Job) -> bool:
        """The VM's requester, an approver, a destroyer or a member of a destroyer group."""
        if user == job.requester or user in self.policy.destroyers:
            return True
        if await self.approvals.is_approver(user):
            return True
        return await self.approvals.in_groups(user, self.policy.destroyer_groups, "destroyer")

    async def _check_asker(self, job: Job, user: str) -> None:
        if not await self.may_destroy(user, job):
            raise NotAllowed(  # the people first: a VM's name could look like an id
                f"Only {job.requester} (who deployed it), an approver "
                f"({self.approvals.approvers_text()}) or a destroyer may destroy {job.name}; "
                "ask one of them.",
                people=(job.requester, *self.approvals.policy.approvers),
            )

    async def _why_not(self, job_id: str) -> str:
        job = await jobrefs.load(self.store, job_id)
        try:
            check_destroyable(job)
        except TransitionRefused as exc:
            return exc.message
        return f"Job {job.id} changed meanwhile; look at it with `/deploy status {job.id}`."

    # --- deciding -----------------------------------------------------------------------

    async def decide(
        self,
        job_id: str,
        approver: str,
        approve: bool,
        reason: str | None = None,
        dedupe_key: str | None = None,
    ) -> Job:
        """Approve (the destroy starts here) or reject a destroy awaiting approval."""
        if dedupe_key is not None and await self.store.jobs.delivered(dedupe_key):
            raise Duplicate(f"This decision on job {job_id} was already made.", job_id)
        job = await self.check_decider(job_id, approver)
        if approve:
            new, note = JobState.DESTROYING, f"destroy approved by {approver}"
            fields: dict[str, object] = {
                "destroy_approver": approver,
                "owner": self.ownership.id,
                "lease_until": self.ownership.claim_until(),
            }
        else:
            why = reason or "no reason given"
            new, note, fields = JobState.SUCCEEDED, f"destroy rejected by {approver}: {why}", {}
        told = [tell.updated(job.id, note, by=approver)]
        expected = [JobState.DESTROY_REQUESTED]
        if not await self._once(dedupe_key, job.id, expected, new, told, fields):
            raise await self._undecidable(job.id)
        return await self._moved(job.id, approver, "approved" if approve else "rejected", note)

    async def check_decider(self, job_id: str, approver: str) -> Job:
        """Refuse non-approvers, the one who asked, and jobs no longer waiting."""
        job = await jobrefs.load(self.store, job_id)
        if not await self.approvals.is_approver(approver):
            raise NotAllowed(
                f"{approver} may not approve destroys; the approvers are "
                f"{self.approvals.approvers_text()}.",
                people=(approver, *self.approvals.policy.approvers),
            )
        if approver == job.destroy_by:
            raise NotAllowed(
                "You cannot approve or reject the destroy you asked for: ask another approver."
            )
        if job.state is not JobState.DESTROY_REQUESTED:
            raise await self._undecidable(job.id)
        return job

    async def _undecidable(self, job_id: str) -> TransitionRefused:
        job = await jobrefs.load(self.store, job_id)
        if job.state in (JobState.DESTROYING, JobState.DESTROYED) and job.destroy_approver:
            return TransitionRefused(
                f"The destroy of job {job.id} was already approved by {job.destroy_approver}.",
                people=(job.destroy_approver,),
            )
        return TransitionRefused(
            f"Job {job.id} ({job.name}) is {job.state.value}, not waiting for a destroy "
            "approval: nothing to decide."
        )

    async def cancel(self, job: Job, user: str) -> Job:
        """Withdraw a destroy awaiting approval: the one who asked, the VM's requester or
        an approver may."""
        allowed = user in (job.destroy_by, job.requester) or await self.approvals.is_approver(user)
        if not allowed:
            raise NotAllowed(
                f"Only {job.destroy_by}, {job.requester} or an approver can withdraw this destroy.",
                people=tuple(p for p in (job.destroy_by, job.requester) if p),
            )
        note = f"destroy withdrawn by {user}"
        told = [tell.updated(job.id, note, by=user)]
        expected = [JobState.DESTROY_REQUESTED]
        if not await self._once(None, job.id, expected, JobState.SUCCEEDED, told, {}):
            raise await self._undecidable(job.id)
        return await self._moved(job.id, user, "withdrawn", note)

    async def expire(self, now: datetime | None = None) -> list[Job]:
        """Destroys nobody approved within `expire_after_s`: the VM stays."""
        now = now or self.clock()
        limit = timedelta(seconds=self.policy.expire_after_s)
        expired = []
        for job in await self.store.jobs.in_states([JobState.DESTROY_REQUESTED]):
            if job.destroy_asked_at is None or job.destroy_asked_at + limit > now:
                continue
            note = "nobody approved the destroy in time; the VM stays"
            told = [tell.updated(job.id, note)]
            if await self._once(None, job.id, [job.state], JobState.SUCCEEDED, told, {}):
                expired.append(await self._moved(job.id, "deploybot", "expired", note))
        return expired

    # --- carrying out -------------------------------------------------------------------

    def start(self, job: Job) -> None:
        """Carry out the destroy of a job this runner holds, in a task kept until done."""
        if job.id in self.tasks:
            return
        task = asyncio.create_task(protected(self.run(job)), name=f"destroy-{job.id}")
        self.tasks[job.id] = task
        task.add_done_callback(lambda _t: self.tasks.pop(job.id, None))

    async def settle(self) -> None:
        """Wait for the destroys under way here (the shell's end, tests, shutdown)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks.values()), return_exceptions=True)

    async def run(self, job: Job) -> Job | None:
        """Stop and destroy the VM, then end the job `destroyed`; a VM that lost its tag
        or that the hypervisor keeps refusing sends the job back to `succeeded`."""
        backend = self.backends.get(job.backend)
        if backend is None or job.vm_id is None:
            return await self._keep(job, unreachable_backend(job))
        try:
            await remove_vm(backend, vm_ref(job), self.settings.timeouts, self._on_move(job))
        except Lost:
            log.warning("job %s: taken over by another runner; its destroy goes on there", job.id)
            return await self.store.jobs.get(job.id)
        except NotOurVM as exc:
            return await self._keep(job, not_ours(job, exc))
        except (BackendError, TimeoutError) as exc:
            return await self._keep(job, failed(job, exc))
        moved, done = await self.store.jobs.move(
            job.id,
            [JobState.DESTROYING],
            JobState.DESTROYED,
            held_by=job.claim(self.ownership.id),
            notices=self._tell(job, tell.finished(job.id, None)),
            destroyed_at=self.clock(),
        )
        if not moved or done is None:
            log.warning("job %s: taken over by another runner before it was destroyed", job.id)
            return await self.store.jobs.get(job.id)
        await self._release_address(done)
        await self._audit(done.destroy_by or "deploybot", done, "destroyed")
        await self.progress.job_finished(done, None)
        return done

    def _on_move(self, job: Job) -> Callable[[str, float | None], Awaitable[None]]:
        async def moved(step: str, took_s: float | None) -> None:
            detail = f"VM {job.vm_id} on {job.backend}"
            if took_s is None:
                await self._still_mine(job)
                event = JobEvent(job_id=job.id, step=step, phase="started", detail=detail)
                notice = tell.step_started(job.id, step, detail)
            else:
                event = JobEvent(
                    job_id=job.id, step=step, phase="finished", duration_s=took_s, detail=detail
                )
                notice = tell.step_finished(job.id, step, took_s, True, detail)
            told = self._tell(job, notice)
            await self.store.jobs.add_event(event, told[0] if told else None)
            if took_s is None:
                await self.progress.step_started(job, step, detail)
            else:
                await self.progress.step_finished(job, step, took_s, True, detail)

        return moved

    async def _still_mine(self, job: Job) -> None:
        """Before each move: a runner whose claim lapsed (the job taken over) stops, so
        two runners do not work one VM at once (their final writes are fenced anyway)."""
        await self.ownership.hold(job.id, job.claim_epoch)  # paused while unproven; Lost
        now = await self.store.jobs.get(job.id)
        if (
            now is None
            or now.state is not JobState.DESTROYING
            or (now.owner, now.claim_epoch) != (self.ownership.id, job.claim_epoch)
        ):
            raise Lost(job.id)

    async def _keep(self, job: Job, why: str) -> Job | None:
        """The VM is still there: back to `succeeded`, saying why and what to do."""
        moved, kept = await self.store.jobs.move(
            job.id,
            [JobState.DESTROYING],
            JobState.SUCCEEDED,
            held_by=job.claim(self.ownership.id),
            notices=self._tell(job, tell.updated(job.id, why)),
            events=[JobEvent(job_id=job.id, step="destroy", phase="failed", detail=why)],
        )
        if not moved or kept is None:  # taken over meanwhile: the new owner decides
            return await self.store.jobs.get(job.id)
        await self._audit(job.destroy_by or "deploybot", kept, "refused", why)
        await self.progress.job_updated(kept, why)
        return kept

    async def _release_address(self, job: Job) -> None:
        try:
            await self.addressing.release(job)
        except BackendError as exc:  # the reconciler gives it back later
            log.warning("job %s: releasing its address failed (%s); retried later", job.id, exc)

    async def _audit(self, actor: str, job: Job, outcome: str, detail: str = "") -> None:
        text = detail or f"{job.name} {job.address} on {job.backend}, VM {job.vm_id}"
        try:
            await self.store.audit.add(
                AuditEvent(actor=actor, action=f"destroy {job.id}", outcome=outcome, detail=text)
            )
        except Exception:
            log.exception("could not write the audit event for the destroy of %s", job.id)

    @staticmethod
    def _tell(job: Job, notice: Notice, always: bool = False) -> list[Notice]:
        """Chat hears of it when it follows the job (its thread), or must approve it."""
        return [notice] if always or tell.followed(job) else []
