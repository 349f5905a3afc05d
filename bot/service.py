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
from collections.abc import Mapping
from datetime import datetime

from backends.base import Backend, BackendError
from backends.ipam import open_ipam
from backends.ipam.base import Ipam
from bot import cancel as cancelling
from bot import logfields
from bot.addressing import Addressing
from bot.approvals import Approvals, GroupMembers
from bot.buildrequests import BuildRequests
from bot.builds import Builds, LoggedBuildNotes
from bot.destroy import Destroyer
from bot.errors import ConfigError
from bot.intake import Intake
from bot.kinds import Kind, Kinds, Record, Rows
from bot.kinds.build import BuildKind
from bot.kinds.deploy import DeployKind
from bot.leases import Leases
from bot.metrics import Metrics
from bot.models import Job, utcnow
from bot.ownership import Clock, Ended, Ownership, Runner
from bot.parser import DeployArgs
from bot.personal import Personal
from bot.pipeline import Pipeline
from bot.progress import Fanout, Progress
from bot.queries import JobStatus, VMPage
from bot.queue import JobQueue
from bot.recovery import sweep_wreckage
from bot.settings import Settings
from bot.storewatch import StoreWatch
from store.db import Store

# VMPage and JobStatus moved to bot/queries.py; importers still find them here.
__all__ = ["Deployer", "JobStatus", "VMPage"]

log = logging.getLogger(__name__)


def _configured_ipam(settings: Settings) -> Ipam:
    try:
        return open_ipam(settings.ipam, os.environ)
    except BackendError as exc:  # NetBox's token is not in the environment
        raise ConfigError(f"[ipam]: {exc.message}") from None


class Deployer(Personal, BuildRequests):
    """The mixins hold the read-only queries (bot/queries.py), per-user settings and
    front-end references (bot/personal.py), template-build requests
    (bot/buildrequests.py) and the audit of refusals (bot/auditing.py)."""

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
        # Whether the store answers (bot/storewatch.py): read by /readyz, /metrics, chat.
        self.storewatch = StoreWatch(store, settings.ownership.tick_s)
        self.metrics = Metrics(self)  # /metrics (bot/metrics.py); it listens like a front end
        self.progress.listeners.append(self.metrics)
        self.runner = Runner.here(runner_kind)
        logfields.set_runner(self.runner.id)
        self.clock = clock
        ipam = ipam if ipam is not None else _configured_ipam(settings)
        self.addressing = Addressing(settings, store, self.backends, ipam, clock)
        # The job kinds (bot/kinds/): what runs, recovers and decides each job.
        self.kinds = Kinds()
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
            sweep=self.kinds.sweep,
            clock=clock,
        )
        self.pipeline = Pipeline(
            settings, self.backends, store, self.progress, self.ownership, self.addressing
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
        # What runs here besides the queue: a renewal names it (bot/ownership.py).
        self.ownership.local_work += [self.destroyer.tasks.keys, self.builds.recovering.copy]
        self.kinds.register(
            DeployKind(
                self.pipeline, self.backends, self.approvals, self.destroyer, self.addressing,
                self._resolve, self._job, self._cancel_job,
            )
        )  # fmt: skip
        self.kinds.register(BuildKind(self.builds))
        self._leasing: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # set once start() has recovered and claimed
        self._closed = False

    async def _run_queued(self, job_id: str) -> object:
        """The queue's runner: the job's kind runs it (looked up in the store)."""
        return await self.kinds.named(await self.store.kind_of(job_id)).run(job_id)

    async def _cancel_job(self, job_id: str, user: str) -> Job:
        return await cancelling.cancel(self, job_id, user)

    async def kind_of(self, ref: str) -> Kind:
        """The kind of the job or build `ref` (an id or a prefix) names; the deploy kind
        when it names none (its lookup then says so)."""
        return self.kinds.named(await self.store.kind_of(ref))

    async def rows_of(self, ref: str) -> Rows:
        """Which record the job `ref` names is: a `Job` or a `Build` (its kind's rows)."""
        return (await self.kind_of(ref)).rows

    async def _sweep_kinds(self) -> None:
        """Recover what the kinds keep outside `jobs` whose runner died (builds)."""
        for kind in self.kinds:
            work = kind.sweep()
            if work is not None:
                await work

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
            await self._sweep_kinds()
            await self.reconcile_addresses()
            self._expiry = asyncio.create_task(self._expire_loop(expire_every_s))
            if settle:  # what came due while no process ran, before the shell reads input
                await self.leases.step()
            self._leasing = asyncio.create_task(self.leases.loop(at_once=not settle))
            self._sweeper = asyncio.create_task(
                self._sweep_loop(self.settings.timeouts.wreckage_retry_s)
            )
        self.ready.set()

    async def _recover(self, job: Job, ended: Ended | None) -> bool:
        """Recover a job this runner took over (`ended`: handed back by this runner,
        whose task ended without a final state); True when it goes back in the queue.
        Its kind does it (bot/kinds/)."""
        return await self.kinds[job.kind].recover(job, ended)

    async def close(self, grace_s: float = 30.0, rollback_s: float | None = None) -> None:
        """Stop taking work, let running jobs finish within `grace_s` (renewing their
        leases meanwhile), then hand queued jobs back to the other runners. Closing
        twice does nothing more. With `rollback_s` (a stopping server), rollbacks,
        destroys and recoveries still going that long after the cancel are left to the
        runner that takes their jobs over; without it they are waited for."""
        if self._closed:
            return
        self._closed = True
        self.ownership.closing = True
        for task in (self._expiry, self._sweeper, self._leasing):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        loop = asyncio.get_running_loop()
        # With `rollback_s`, one budget for all that is left after the grace: the queue's
        # rollbacks, destroys and recoveries share it rather than each taking it anew.
        ends = None if rollback_s is None else loop.time() + grace_s + rollback_s
        await self.queue.shutdown(grace_s, rollback_s)
        left = None if ends is None else max(0.0, ends - loop.time())
        with contextlib.suppress(TimeoutError):  # one left unfinished is taken over
            async with asyncio.timeout(grace_s if left is None else left):
                await self.destroyer.settle()
        await self.ownership.close(None if ends is None else max(0.0, ends - loop.time()))
        await self.addressing.ipam.close()

    async def sweep_wreckage(self) -> list[str]:
        """Retry removing what failed rollbacks left; returns the jobs now clean."""
        return await sweep_wreckage(self.store, self.backends, self.pipeline, self.progress)

    async def _sweep_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep_wreckage()
                await self._sweep_kinds()  # builds whose runner died since (a CLI killed)
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

    async def decide(
        self,
        ref: str,
        approver: str,
        approved: bool,
        reason: str | None = None,
        *,
        dedupe_key: str | None = None,
    ) -> Record:
        """Approve or reject what `ref` names, whatever its kind (its approval hook)."""
        verb = "approve" if approved else "reject"
        async with self._audited(approver, f"{verb} {ref[:40]}"):
            kind = await self.kind_of(ref)
            return await kind.decide(ref, approver, approved, reason, dedupe_key)

    async def may_decide_any(self, ref: str, approver: str) -> Record:
        """Refuse now what a decision on `ref`, whatever its kind, would refuse."""
        async with self._audited(approver, f"decide {ref[:40]}"):
            return await (await self.kind_of(ref)).may_decide(ref, approver)

    async def _job_kind(self, ref: str) -> Kind:
        """The kind of the job `ref` names, for what answers with a `Job`: one whose
        rows are not `jobs` rows is looked up as a deploy (which says there is no job)."""
        kind = await self.kind_of(ref)
        return kind if kind.rows == "jobs" else self.kinds.named(None)

    async def approve(self, job_id: str, approver: str, *, dedupe_key: str | None = None) -> Job:
        async with self._audited(approver, f"approve {job_id}"):
            kind = await self._job_kind(job_id)
            return _job(await kind.decide(job_id, approver, True, None, dedupe_key))

    async def reject(
        self, job_id: str, approver: str, reason: str, *, dedupe_key: str | None = None
    ) -> Job:
        async with self._audited(approver, f"reject {job_id}"):
            kind = await self._job_kind(job_id)
            return _job(await kind.decide(job_id, approver, False, reason, dedupe_key))

    async def is_approver(self, user: str) -> bool:
        return await self.approvals.is_approver(user)

    def approvers_text(self) -> str:
        return self.approvals.approvers_text()

    async def may_decide(self, job_id: str, approver: str) -> Job:
        """Refuse now what a decision would refuse (before asking a reason, say)."""
        async with self._audited(approver, f"decide {job_id}"):
            return _job(await (await self._job_kind(job_id)).may_decide(job_id, approver))

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

    # --- other commands -----------------------------------------------------------

    async def cancel(self, job_id: str, user: str) -> Job:
        async with self._audited(user, f"cancel {job_id}"):
            return _job(await (await self._job_kind(job_id)).cancel(job_id, user))

    # --- destroy and leases (bot/destroy.py, bot/leases.py) ------------------------------

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


def _job(record: Record) -> Job:
    """What a `jobs` kind answered (a `Job`, by `Kind.rows`)."""
    assert isinstance(record, Job), f"{record.id}: a jobs kind answered a {type(record).__name__}"
    return record
