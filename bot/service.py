"""The core's front door: what every front end (shell, Slack) calls.

`Deployer` owns the store, the backends, the queue and the pipeline. It turns parsed
commands into jobs, applies the approval policy, and answers status and history. Every
refusal is a `DeployBotError` whose message says what to do instead; nothing here
formats chat text (that is handlers/messages/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime

from backends.base import Backend, BackendError, Template
from backends.building import BuildsTemplates, TemplateVersion
from backends.ipam import open_ipam
from backends.ipam.base import Ipam
from bot import cancel as cancelling
from bot import jobrefs, logfields
from bot import prefs as user_prefs
from bot.addressing import Addressing
from bot.approvals import Approvals, GroupMembers
from bot.builds import Builds, LoggedBuildNotes
from bot.destroy import Destroyer
from bot.errors import (
    ConfigError,
    DeployBotError,
    Duplicate,
)
from bot.intake import Intake
from bot.leases import Leases
from bot.metrics import Metrics
from bot.models import (
    Approval,
    ApprovalState,
    AuditEvent,
    Job,
    JobEvent,
    JobState,
    UserPrefs,
    utcnow,
)
from bot.models.builds import Build
from bot.ownership import Clock, Ownership, Runner
from bot.parser import DeployArgs
from bot.pipeline import Pipeline
from bot.progress import Fanout, Progress
from bot.queue import JobQueue
from bot.quotas import Standing
from bot.recovery import recover_interrupted, sweep_wreckage
from bot.settings import Settings
from bot.waiting import protected
from store.db import Store

log = logging.getLogger(__name__)


def _configured_ipam(settings: Settings) -> Ipam:
    try:
        return open_ipam(settings.ipam, os.environ)
    except BackendError as exc:  # NetBox's token is not in the environment
        raise ConfigError(f"[ipam]: {exc.message}") from None


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
            self._run_queued,
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
        self.intake = Intake(
            settings,
            store,
            self.backends,
            self.addressing,
            self.queue,
            self.progress,
            self.runner.id,
            self.ownership.lease_until,
        )
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
        self.leases = Leases(
            settings, store, self.backends, self.progress, self.ownership, self.approvals,
            self.destroyer, clock,
        )  # fmt: skip
        self.intake.grant = self.leases.grant
        # Template builds share the queue, the store's ownership and the deploy parts
        # their smoke test uses (bot/builds/).
        self.builds = Builds(
            settings, store, self.backends, self.queue, self.runner.id,
            self.ownership.lease_until, LoggedBuildNotes(), approvals=self.approvals,
        )  # fmt: skip
        self.builds.wire(self.intake, self.pipeline, self.destroyer)
        self._leasing: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # set once start() has recovered and claimed
        self._closed = False

    async def _run_queued(self, job_id: str) -> object:
        """The queue's runner: a build id (`b...`) is a template build, else a deploy."""
        if job_id.startswith("b"):
            return await self.builds.run(job_id)
        return await self.pipeline.run(job_id)

    @property
    def group_members(self) -> GroupMembers | None:
        return self.approvals.group_members

    @group_members.setter
    def group_members(self, lookup: GroupMembers | None) -> None:
        """A front end that knows chat user groups sets how to list a group's members."""
        self.approvals.group_members = lookup
        self.intake.group_members = lookup  # quota groups (bot/quotas.py)

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
            await self.builds.recover()
            await self.reconcile_addresses()
            self._expiry = asyncio.create_task(self._expire_loop(expire_every_s))
            if settle:  # what came due while no process ran, before the shell reads input
                await self.leases.step()
            self._leasing = asyncio.create_task(self.leases.loop(at_once=not settle))
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
        for task in (self._expiry, self._sweeper, self._leasing):
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
                await self.builds.recover()  # builds whose runner died since (a CLI killed)
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
        """Validate, record and queue (or send for approval) one deploy (bot/intake.py).

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
            return await self.intake.request(
                args,
                requester,
                ssh_keys=ssh_keys,
                can_wait_for_approval=can_wait_for_approval,
                origin=origin,
                dedupe_key=dedupe_key,
                check_free_first=check_free_first,
            )

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
        """Expire what waited for an approver too long: deploys, destroys (returned) and
        template builds (their notices tell chat)."""
        await self.builds.expire(now)
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

    # --- template builds (bot/builds/) --------------------------------------------------

    async def request_build(
        self,
        profile: str,
        backend: str | None,
        user: str,
        *,
        placement: str | None = None,
        storage: str | None = None,
        name: str | None = None,
        origin: str | None = None,
        can_wait_for_approval: bool = True,
    ) -> Build:
        """Build a template from a profile (on the default backend unless `backend`):
        queued here, or awaiting an approver (`[approval] builds`)."""
        async with self._audited(user, f"template build {profile[:64]}"):
            return await self.builds.request(
                profile,
                backend or self.settings.default_backend,
                user,
                placement=placement,
                storage=storage,
                name=name,
                origin=origin,
                can_wait_for_approval=can_wait_for_approval,
            )

    async def decide_build(
        self,
        build_id: str,
        approver: str,
        approved: bool,
        note: str | None = None,
        *,
        dedupe_key: str | None = None,
    ) -> Build:
        """Approve or reject a template build awaiting approval (its card's buttons)."""
        verb = "approve" if approved else "reject"
        async with self._audited(approver, f"{verb} {build_id[:40]}"):
            return await self.builds.decide(build_id, approver, approved, note, dedupe_key)

    async def may_decide_build(self, build_id: str, approver: str) -> Build:
        async with self._audited(approver, f"decide {build_id[:40]}"):
            return await self.builds.check_decider(build_id, approver)

    async def template_builds(self) -> dict[str, dict[str, TemplateVersion]]:
        """For each backend that builds templates, the current version of each template
        deploybot built there, by name (a backend that cannot answer is left out)."""
        found: dict[str, dict[str, TemplateVersion]] = {}
        for name, backend in self.backends.items():
            if not isinstance(backend, BuildsTemplates):
                continue
            try:
                versions = await backend.template_versions()
            except BackendError as exc:
                log.warning("%s: could not list built templates: %s", name, exc.message)
                continue
            found[name] = {v.name: v for v in versions}
        return found

    async def set_build_refs(
        self, build_id: str, *, thread_ref: str | None = None, approval_ref: str | None = None
    ) -> None:
        """Remember where a front end shows this build (kept so a restart can find it)."""
        fields = {"thread_ref": thread_ref, "approval_ref": approval_ref}
        await self.store.builds.update(build_id, None, (), **{k: v for k, v in fields.items() if v})

    # --- other commands -----------------------------------------------------------

    async def cancel(self, job_id: str, user: str) -> Job:
        async with self._audited(user, f"cancel {job_id}"):
            return await cancelling.cancel(self, await self._resolve(job_id), user)

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

    async def extend_lease(
        self, target: str, user: str, length_s: int | None = None, *, dedupe_key: str | None = None
    ) -> Job:
        """Move the lease end of the VM `target` names later (bot/leases.py)."""
        async with self._audited(user, f"extend {target[:64]}"):
            return await self.leases.extend(target, user, length_s, dedupe_key=dedupe_key)

    async def list_vms(self, requester: str | None, page: int, per_page: int) -> VMPage:
        """One page of the VMs deploybot holds (one requester's, or everyone's)."""
        total = await self.store.count_live(requester)
        pages = max(1, -(-total // per_page))
        page = min(max(1, page), pages)
        jobs = await self.store.live_jobs(requester, per_page, (page - 1) * per_page)
        return VMPage(jobs, page, pages, total, requester)

    async def pending_approvals(self) -> list[Job]:
        """Deploys and destroys waiting for an approver (the App Home)."""
        return await self.store.jobs_in([JobState.AWAITING_APPROVAL, JobState.DESTROY_REQUESTED])

    async def quota_standing(self, user: str) -> list[Standing]:
        """Each quota of `user` with what is used now (bot/quotas.py)."""
        return await self.intake.quotas.standing(user)

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
            return await user_prefs.replace(
                self.store, user, ssh_keys, default_template, self.templates
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
