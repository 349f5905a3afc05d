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
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from backends.base import Backend, BackendError, Template
from backends.ipam import open_ipam
from backends.ipam.base import AddressTaken, Ipam, PoolExhausted, Reservation
from bot import jobrefs, logfields
from bot import prefs as user_prefs
from bot import progress as tell
from bot.addressing import Addressing
from bot.admission import check_free, check_login, check_on_backend
from bot.approvals import Approvals, GroupMembers, approval_reason
from bot.destroy import Destroyer
from bot.errors import (
    ConfigError,
    Conflict,
    DeployBotError,
    Duplicate,
    NotAllowed,
    RequestInvalid,
    TransitionRefused,
)
from bot.metrics import Metrics
from bot.models import (
    Approval,
    ApprovalState,
    AuditEvent,
    DeployRequest,
    IpamState,
    Job,
    JobEvent,
    JobState,
    UserPrefs,
    new_job_id,
    utcnow,
)
from bot.ownership import Clock, Ownership, Runner
from bot.parser import DeployArgs
from bot.pipeline import Pipeline
from bot.progress import Fanout, Progress
from bot.queue import JobQueue
from bot.recovery import recover_interrupted, sweep_wreckage
from bot.requests import build_request
from bot.runs import vm_ref
from bot.settings import Settings
from bot.waiting import protected
from store.db import AlreadyDelivered, DuplicateActive, Store

log = logging.getLogger(__name__)


def _configured_ipam(settings: Settings) -> Ipam:
    try:
        return open_ipam(settings.ipam, os.environ)
    except BackendError as exc:  # NetBox's token is not in the environment
        raise ConfigError(f"[ipam]: {exc.message}") from None


_PICKS = 5  # tries at recording a next free address that other processes also picked


class _LostRace(Exception):
    """The next free address was recorded by another job first."""


def addressing_lost_race(request: DeployRequest) -> str:
    return (
        f"Other deploys kept taking the next free address of {request.subnet}: give an "
        "address, or ask again."
    )


@dataclass(frozen=True)
class VMPage:
    """A page of `/deploy list`: `requester` None lists everyone's."""

    jobs: list[Job]
    page: int
    pages: int
    total: int
    requester: str | None


@dataclass(frozen=True)
class JobStatus:
    job: Job
    events: list[JobEvent]
    approval: Approval | None


class Deployer:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        progress: Progress | None = None,
        *,
        runner_kind: str = "shell",
        takes_over: bool = True,
        clock: Clock = utcnow,
        ipam: Ipam | None = None,
    ) -> None:
        """`takes_over=False` is a short-lived process (the one-shot `deploy`): it runs
        only the jobs it records, and never recovers or claims other runners' work.
        `ipam` defaults to the configured one (`[ipam]`)."""
        self.settings = settings
        self.store = store
        self.backends = dict(backends)
        self.progress = Fanout(*([progress] if progress else []))
        self.metrics = Metrics(self)  # /metrics (bot/metrics.py); it listens like a front end
        self.progress.listeners.append(self.metrics)
        self.runner = Runner.here(runner_kind)
        logfields.set_runner(self.runner.id)
        self.clock = clock
        ipam = ipam if ipam is not None else _configured_ipam(settings)
        self.addressing = Addressing(settings, store, self.backends, ipam, clock)
        self.pipeline = Pipeline(
            settings, self.backends, store, self.progress, self.runner.id, self.addressing
        )
        self.queue = JobQueue(
            self.pipeline.run,
            max_running=settings.limits.max_running,
            max_per_backend=settings.limits.max_running_per_backend,
        )
        self.ownership = Ownership(
            store,
            self.queue,
            settings.ownership,
            self.runner,
            takes_over=takes_over,
            recover=self._recover,
            clock=clock,
        )
        self.approvals = Approvals(settings, store, self.progress, self.ownership.take, self._job)
        self.destroyer = Destroyer(
            settings,
            store,
            self.backends,
            self.progress,
            self.ownership,
            self.addressing,
            self.approvals,
            clock,
        )
        self._expiry: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # set once start() has recovered and claimed
        self._picking = asyncio.Lock()
        self._closed = False

    @property
    def group_members(self) -> GroupMembers | None:
        return self.approvals.group_members

    @group_members.setter
    def group_members(self, lookup: GroupMembers | None) -> None:
        """A front end that knows chat user groups sets how to list a group's members."""
        self.approvals.group_members = lookup

    # --- life cycle ---------------------------------------------------------------

    async def start(self, *, expire_every_s: float = 30.0, settle: bool = True) -> None:
        """Become a runner: claim the queued jobs nobody holds and recover the ones whose
        runner died (bot/ownership.py), then keep doing so in the background. With
        `settle` (the shell, the CLI) those first recoveries end before this returns; a
        server passes False and reports readiness (`ready`) once they have."""
        await self.ownership.start()
        if settle:
            await self.ownership.settle()
        if self.ownership.takes_over:
            await self.reconcile_addresses()
            self._expiry = asyncio.create_task(self._expire_loop(expire_every_s))
            self._sweeper = asyncio.create_task(
                self._sweep_loop(self.settings.timeouts.wreckage_retry_s)
            )
        self.ready.set()

    async def _recover(self, job: Job) -> bool:
        """Recover a job this runner took over; True when it goes back in the queue."""
        if job.state is JobState.DESTROYING:  # a destroy: finish it (bot/destroy.py)
            await protected(self.destroyer.run(job))
            return False
        report = await protected(recover_interrupted(self.pipeline, self.backends, job))
        return report is None

    async def close(self, grace_s: float = 30.0) -> None:
        """Stop taking work, let running jobs finish within `grace_s` (renewing their
        leases meanwhile), then hand queued jobs back to the other runners. Closing
        twice does nothing more."""
        if self._closed:
            return
        self._closed = True
        self.ownership.closing = True
        for task in (self._expiry, self._sweeper):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.queue.shutdown(grace_s)
        with contextlib.suppress(TimeoutError):  # one left unfinished is taken over
            async with asyncio.timeout(grace_s):
                await self.destroyer.settle()
        await self.ownership.close()
        await self.addressing.ipam.close()

    async def sweep_wreckage(self) -> list[str]:
        """Retry removing what failed rollbacks left; returns the jobs now clean."""
        return await sweep_wreckage(self.store, self.backends, self.pipeline, self.progress)

    async def _sweep_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep_wreckage()
            except Exception:
                log.exception("retrying wreckage removal failed")
            await self.reconcile_addresses()

    async def reconcile_addresses(self) -> list[str]:
        """Give back IPAM records no job holds (bot/addressing.py); never raises: an IPAM
        that does not answer is asked again at the next sweep."""
        try:
            return await self.addressing.reconcile()
        except BackendError as exc:  # said plainly: it is the IPAM's answer, not a bug
            log.warning("releasing addresses no job holds: %s", exc.message)
        except Exception:
            log.exception("releasing addresses no job holds failed")
        return []

    async def drain(self) -> None:
        """Wait until this process has nothing left to run or recover, and no queued
        job that nobody holds is left for it to claim."""
        while True:
            await self.ownership.settle()
            await self.queue.drain()
            await self.destroyer.settle()
            if not self.ownership.recovering and not await self.ownership.claim_queued():
                return

    # --- deploy -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _audited(self, actor: str, action: str) -> AsyncIterator[None]:
        """Record a refusal (the only store change a refused action makes), then re-raise."""
        try:
            yield
        except Duplicate as dup:
            await self.audit(actor, action, dup.message, outcome="duplicate")
            raise
        except DeployBotError as exc:
            await self.audit(actor, action, exc.message)
            raise

    async def audit(self, actor: str, action: str, detail: str, outcome: str = "refused") -> None:
        """Keep a refused or repeated action in the audit log (front ends call it for
        refusals they decide themselves, such as a command that does not parse)."""
        try:
            await self.store.add_audit(
                AuditEvent(actor=actor, action=action, outcome=outcome, detail=detail[:2000])
            )
        except Exception:
            log.exception("could not write the audit event for %s by %s", action, actor)

    async def request_deploy(
        self,
        args: DeployArgs,
        requester: str,
        *,
        ssh_keys: tuple[str, ...] = (),
        can_wait_for_approval: bool = True,
        origin: str | None = None,
        dedupe_key: str | None = None,
        check_free_first: bool = False,
    ) -> Job:
        """Validate, record and queue (or send for approval) one deploy.

        A front end where nobody can approve (the one-shot CLI) passes
        `can_wait_for_approval=False`: such a request is refused before it is recorded.
        Keys and template the request does not name come from the requester's saved
        settings. `origin` is kept on the job for the front end; a second request with the
        same `dedupe_key` (a redelivery) raises `Duplicate` and records nothing.
        `check_free_first` asks the hypervisor whether the name and address are free
        before recording, so a chat user hears of a clash at once instead of from a
        failed job (the pipeline checks again when the job starts).
        """
        async with self._audited(requester, "deploy"):
            await self._refuse_redelivery(dedupe_key)
            request = await self._validated(args, requester, ssh_keys)
            if check_free_first:
                await check_free(self.backends, request)
            # Picks of the next free address in this process go one at a time (each
            # sees the last one recorded); another process's pick may still win the
            # insert, and then this one picks again.
            picking = self._picking if request.picked else contextlib.nullcontext()
            for attempt in range(_PICKS):
                job_id = new_job_id()
                async with picking:
                    reserved, reservation = await self._reserve(request, job_id)
                    recorded = None
                    try:
                        recorded = await self._record(
                            reserved, can_wait_for_approval, origin, dedupe_key, job_id, reservation
                        )
                        return recorded
                    except _LostRace:
                        if attempt == _PICKS - 1:
                            raise Conflict(addressing_lost_race(reserved)) from None
                    finally:
                        if recorded is None:  # not recorded: give it back now
                            await protected(self._unreserve(reservation, job_id, reserved))
            raise AssertionError("unreachable")

    async def _reserve(
        self, request: DeployRequest, job_id: str
    ) -> tuple[DeployRequest, Reservation]:
        """The request's address reserved for `job_id` (the next free one when none was
        asked), or a refusal that says who holds it."""
        try:
            return await self.addressing.reserve(request, job_id)
        except AddressTaken as taken:
            raise Conflict(
                f"{taken.message}: pick another address, or leave it out to get the next free one."
            ) from None
        except PoolExhausted as exc:
            raise Conflict(
                f"No free address is left in {request.subnet} ({exc.message}): ask an "
                "operator to widen its pool, or give another subnet=."
            ) from None
        except BackendError as exc:
            where = self.addressing.ipam_name
            if exc.retryable:
                raise RequestInvalid(
                    [f"{where} did not answer ({exc.message}); try again in a minute."]
                ) from None
            raise RequestInvalid([f"{where} refused: {exc.message}"]) from None

    async def _unreserve(
        self, reservation: Reservation, job_id: str, request: DeployRequest
    ) -> None:
        try:
            await self.addressing.release_ref(reservation, self.addressing.claim(job_id, request))
        except BackendError as exc:  # the reconciler gives it back later
            log.warning("could not release %s reserved for %s: %s", request.address, job_id, exc)

    async def _refuse_redelivery(self, dedupe_key: str | None) -> None:
        """Answer a redelivery before validating again (by then its own job holds the name).

        Only an early answer: the insert's claim on the key is what enforces it.
        """
        if dedupe_key is None:
            return
        job_id = await self.store.delivered(dedupe_key)
        if job_id is not None:
            raise Duplicate(_already_have(job_id), job_id)

    async def _validated(
        self, args: DeployArgs, requester: str, ssh_keys: tuple[str, ...]
    ) -> DeployRequest:
        policy = self.settings.approval
        if policy.deployers and requester not in policy.deployers:
            raise NotAllowed(
                f"{requester} is not on the list of people who may deploy; ask one of "
                f"{', '.join(policy.approvers) or 'the operators'} to add you."
            )
        prefs = await self._saved_prefs(requester)
        request = build_request(
            args,
            self.settings,
            requester,
            user_keys=ssh_keys or prefs.ssh_keys,
            user_template=prefs.default_template,
        )
        check_login(request)
        template = await check_on_backend(self.backends, request)
        if args.user is None and template.default_user not in (None, request.user):
            # The image's own login user beats the site default: the SSH line must work.
            request = DeployRequest.model_validate(
                {**request.model_dump(), "user": template.default_user}
            )
        return request

    async def _record(
        self,
        request: DeployRequest,
        can_wait_for_approval: bool,
        origin: str | None,
        dedupe_key: str | None,
        job_id: str,
        reservation: Reservation,
    ) -> Job:
        policy = self.settings.approval
        reason = approval_reason(policy, request)
        if reason and not can_wait_for_approval:
            raise NotAllowed(
                f"This request needs approval ({reason}). Ask in Slack or in `deploybot shell`, "
                "where an approver can approve it."
            )
        state = JobState.AWAITING_APPROVAL if reason else JobState.QUEUED
        update: dict[str, object] = {
            "id": job_id,
            "approval_reason": reason,
            "origin": origin,
            "installation": self.store.installation_id,
            "ipam_ref": reservation.ref,
            "ipam_state": IpamState.RESERVED if reservation.ref else None,
        }
        if state is JobState.QUEUED:  # reserved for this runner: it starts it here
            update.update(owner=self.runner.id, lease_until=self.ownership.lease_until())
        job = Job.for_request(request, state).model_copy(update=update)
        approval = None
        if reason:
            expires = job.created_at + timedelta(seconds=policy.expire_after_s)
            approval = Approval(job_id=job.id, reason_required=reason, expires_at=expires)
        for attempt in range(3):
            try:
                job = await self.store.insert_job(
                    job, approval, dedupe_key=dedupe_key, announce=True
                )
                break
            except AlreadyDelivered as seen:
                raise Duplicate(_already_have(seen.job_id), seen.job_id) from None
            except DuplicateActive as dup:
                if dup.what == "address" and request.picked:
                    raise _LostRace from None  # another request took it meanwhile: pick again
                if attempt == 2 or not await self._release_if_gone(request):
                    raise Conflict(await self._conflict_message(request, dup.what)) from None
        await self.progress.job_updated(job)
        if state is JobState.QUEUED:
            self.queue.submit(job.id, job.backend)
        return job

    async def _release_if_gone(self, request: DeployRequest) -> bool:
        """A succeeded job holds the name or address: if its VM has gone since (deleted
        by hand), release the job so the name and address can be used again."""
        held = await self.store.holder(
            backend=request.backend, name=request.name, address=str(request.address.ip)
        )
        if held is None:
            return True  # released meanwhile: try again
        backend = self.backends.get(held.backend)
        if held.state is not JobState.SUCCEEDED or held.vm_id is None or backend is None:
            return False
        try:
            gone = await backend.find_vm(vm_ref(held)) is None
        except BackendError:
            return False
        if gone and await self.store.transition(held.id, [JobState.SUCCEEDED], JobState.RELEASED):
            detail = f"VM {held.vm_id} no longer exists; its name and address are free again"
            await self.store.add_event(
                JobEvent(job_id=held.id, step="release", phase="note", detail=detail)
            )
        return gone

    async def _conflict_message(self, request: DeployRequest, what: str) -> str:
        ip = str(request.address.ip)
        held = await self.store.holder(backend=request.backend, name=request.name, address=ip)
        if held is not None and held.state is JobState.SUCCEEDED:
            if what == "name":
                return (
                    f"{request.name} already exists on {request.backend} (job {held.id}, VM "
                    f"{held.vm_id}): pick another name, or remove that VM first."
                )
            return (
                f"{ip} belongs to {held.name} (job {held.id}), which still exists: "
                "pick another address."
            )
        by = f" by job {held.id} ({held.name}, {held.state.value})" if held else ""
        if what == "name":
            return f"{request.name} is already being deployed{by}: pick another name or wait."
        return f"{ip} is already taken{by}: pick another address or wait."

    # --- approvals ----------------------------------------------------------------

    async def approve(self, job_id: str, approver: str, *, dedupe_key: str | None = None) -> Job:
        async with self._audited(approver, f"approve {job_id}"):
            job_id = await self._resolve(job_id)
            if await self._destroy_waits(job_id):
                return await self.destroyer.decide(job_id, approver, True, None, dedupe_key)
            return await self.approvals.decide(
                job_id, approver, ApprovalState.APPROVED, None, dedupe_key
            )

    async def reject(
        self, job_id: str, approver: str, reason: str, *, dedupe_key: str | None = None
    ) -> Job:
        async with self._audited(approver, f"reject {job_id}"):
            job_id = await self._resolve(job_id)
            if await self._destroy_waits(job_id):
                return await self.destroyer.decide(job_id, approver, False, reason, dedupe_key)
            job = await self.approvals.decide(
                job_id, approver, ApprovalState.REJECTED, reason, dedupe_key
            )
        await self.addressing.release_quietly(job)
        return job

    async def is_approver(self, user: str) -> bool:
        return await self.approvals.is_approver(user)

    def approvers_text(self) -> str:
        return self.approvals.approvers_text()

    async def may_decide(self, job_id: str, approver: str) -> Job:
        """Refuse now what a decision would refuse (before asking a reason, say)."""
        async with self._audited(approver, f"decide {job_id}"):
            job_id = await self._resolve(job_id)
            if await self._destroy_waits(job_id):
                return await self.destroyer.check_decider(job_id, approver)
            return await self.approvals.check_decider(job_id, approver)

    async def _destroy_waits(self, job_id: str) -> bool:
        """Whether approve/reject of this job is about its destroy, not its deploy."""
        return (await self._job(job_id)).state is JobState.DESTROY_REQUESTED

    async def expire_approvals(self, now: datetime | None = None) -> list[Job]:
        expired = await self.approvals.expire(now)
        for job in expired:
            await self.addressing.release_quietly(job)
        return expired + await self.destroyer.expire(now)

    async def _expire_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.expire_approvals()
            except Exception:
                log.exception("expiring approvals failed")

    # --- other commands -----------------------------------------------------------

    async def cancel(self, job_id: str, user: str) -> Job:
        async with self._audited(user, f"cancel {job_id}"):
            return await self._cancel(await self._resolve(job_id), user)

    async def _cancel(self, job_id: str, user: str) -> Job:
        job = await self._job(job_id)
        if job.state is JobState.DESTROY_REQUESTED:  # withdraw the destroy, keep the VM
            return await self.destroyer.cancel(job, user)
        if user != job.requester and not await self.is_approver(user):
            raise NotAllowed(f"Only {job.requester} or an approver can cancel job {job_id}.")
        if job.state in (JobState.QUEUED, JobState.AWAITING_APPROVAL):
            if await self._cancel_unstarted(job, user):
                self.queue.cancel(job_id)
                cancelled = await self._job(job_id)
                await self.progress.job_updated(cancelled, f"cancelled by {user}")
                await self.addressing.release_quietly(cancelled)
                return cancelled
            job = await self._job(job_id)
        working = job.state in (JobState.RUNNING, JobState.ROLLING_BACK)
        if working and self.queue.cancel(job_id):
            return job
        # Another process runs it: ask it, through the store (bot/ownership.py).
        if working and await self.store.request_cancel(job_id, user):
            return job
        raise TransitionRefused(f"Job {job_id} is {job.state.value}: there is nothing to cancel.")

    async def _cancel_unstarted(self, job: Job, user: str) -> bool:
        """A job awaiting approval has its approval closed in the same transaction, so
        nobody can approve it afterwards."""
        told = [tell.updated(job.id, f"cancelled by {user}")]
        if job.state is JobState.AWAITING_APPROVAL:
            return await self.store.cancel_awaiting(job.id, by=user, notices=told)
        return await self.store.transition(
            job.id,
            [job.state],
            JobState.CANCELLED,
            notices=told,
            error="cancelled",
            finished_at=utcnow(),
        )

    # --- destroy and list (bot/destroy.py) ----------------------------------------------

    async def request_destroy(
        self,
        target: str,
        user: str,
        *,
        can_wait_for_approval: bool = True,
        dedupe_key: str | None = None,
    ) -> Job:
        """Destroy the VM `target` names (its name or job id) now, or once approved."""
        async with self._audited(user, f"destroy {target[:64]}"):
            return await self.destroyer.request(
                target, user, can_wait_for_approval=can_wait_for_approval, dedupe_key=dedupe_key
            )

    async def list_vms(self, requester: str | None, page: int, per_page: int) -> VMPage:
        """One page of the VMs deploybot holds (one requester's, or everyone's)."""
        total = await self.store.count_live(requester)
        pages = max(1, -(-total // per_page))
        page = min(max(1, page), pages)
        jobs = await self.store.live_jobs(requester, per_page, (page - 1) * per_page)
        return VMPage(jobs, page, pages, total, requester)

    async def status(self, job_id: str) -> JobStatus:
        job_id = await self._resolve(job_id)
        # The approval first: one that does not validate sets its job aside, which
        # reading the job then says.
        approval = await self.store.get_approval(job_id)
        events = await self.store.events(job_id)
        return JobStatus(await self._job(job_id), events, approval)

    async def history(self, limit: int = 10, requester: str | None = None) -> list[Job]:
        return await self.store.history(requester=requester, limit=limit)

    async def templates(self) -> dict[str, list[Template] | str]:
        """Templates per backend; a backend that fails gets its error text, which says
        "try again" only when waiting may help (a wrong password will not go away)."""
        found: dict[str, list[Template] | str] = {}
        for name, backend in self.backends.items():
            try:
                found[name] = await backend.templates()
            except BackendError as exc:
                found[name] = f"{exc.message}; try again shortly" if exc.retryable else exc.message
        return found

    # --- per-user settings and front-end references ----------------------------------

    async def prefs(self, user: str) -> UserPrefs:
        """Saved settings to show or prefill a form with (bot/prefs.py)."""
        return await user_prefs.shown(self.store, user)

    async def _saved_prefs(self, user: str) -> UserPrefs:
        return await user_prefs.for_deploy(self.store, user)

    async def save_ssh_key(self, user: str, text: str) -> UserPrefs:
        """Validate one public key and add it to the user's saved keys."""
        async with self._audited(user, "save key"):
            return await user_prefs.add_key(self.store, user, text)

    async def save_prefs(
        self, user: str, ssh_keys: tuple[str, ...], default_template: str | None
    ) -> UserPrefs:
        """Replace the user's keys and default template, after checking both."""
        async with self._audited(user, "save settings"):
            keys = user_prefs.check_keys(ssh_keys)
            if default_template is not None:
                await self._check_template_somewhere(default_template)
            prefs = UserPrefs(user=user, ssh_keys=keys, default_template=default_template)
            await self.store.put_prefs(prefs)
            return prefs

    async def _check_template_somewhere(self, name: str) -> None:
        found = await self.templates()
        names = {t.name for items in found.values() if not isinstance(items, str) for t in items}
        if name not in names:
            raise RequestInvalid(
                [f"template: {name!r} is not a template on any backend; see `/deploy templates`."]
            )

    async def set_refs(
        self,
        job_id: str,
        *,
        thread_ref: str | None = None,
        approval_ref: str | None = None,
        destroy_ref: str | None = None,
    ) -> None:
        """Remember where a front end shows this job (kept so a restart can find it)."""
        fields = {
            "thread_ref": thread_ref,
            "approval_ref": approval_ref,
            "destroy_ref": destroy_ref,
        }
        await self.store.update_job(job_id, **{k: v for k, v in fields.items() if v})

    async def _resolve(self, text: str) -> str:
        """The id of the job a person named by its id or a prefix of it."""
        return await jobrefs.resolve(self.store, text)

    async def _job(self, job_id: str) -> Job:
        return await jobrefs.load(self.store, job_id)


def _already_have(job_id: str) -> str:
    return f"I already have this request as job {job_id}; follow it with `/deploy status {job_id}`."
