"""The core's front door: what every front end (shell, Slack) calls.

`Deployer` holds the core's services, built and wired once by the composition root
(bot/app/compose.py `compose`). Each action a front end asks for runs here inside the audit of
refusals (bot/approvals/audit.py) and is done by the service that owns it: deploys by the
intake, decisions and cancels by the job's kind (bot/kinds/), destroys, leases, builds,
the read-only questions (bot/app/queries.py) and per-user settings (bot/people/personal.py). Every
refusal is a `UserError` whose message says what to do instead; nothing here
formats chat text (that is handlers/messages/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import datetime

from backends.base import Backend, Template
from backends.building import TemplateVersion
from backends.migrating import Scope
from bot.addresses.allocation import Addressing
from bot.app.queries import JobStatus, Queries, VMPage
from bot.approvals.audit import Audit
from bot.approvals.decisions import Approvals, Groups
from bot.chat.inbox import Inbox
from bot.chat.outbox import ChatOutbox
from bot.config.settings import Settings
from bot.jobs.progress import Fanout
from bot.jobs.queue import JobQueue
from bot.kinds import Kind, Kinds, Record, Rows
from bot.kinds.build.service import Builds
from bot.kinds.deploy.destroy import Destroyer
from bot.kinds.deploy.pipeline import Pipeline
from bot.leases.enforce import Leases
from bot.migration.apply import Applied, Outcome
from bot.migration.plan import Plan
from bot.migration.service import Migrations
from bot.models import Job, UserPrefs, utcnow
from bot.models.builds import Build
from bot.models.errors import BackendError, JobNotFound
from bot.models.plans import KeptPlan
from bot.operations.metrics import Metrics
from bot.ownership.claims import Clock, Ownership, Runner
from bot.ownership.recovery import sweep_wreckage
from bot.ownership.storewatch import StoreWatch
from bot.people.personal import Personal
from bot.requests.intake import Intake
from bot.requests.parsed import DeployArgs
from bot.requests.quotas import Standing
from bot.sshca.authority import HostCA
from bot.sshca.revocation import RevokedKey, revoked_keys
from store.db import Store

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Deployer:
    """The services, each built once by `bot.app.compose.compose`; front ends read the ones
    they show (settings, backends, metrics, storewatch, the queue) and ask the rest
    through the methods below."""

    settings: Settings
    store: Store
    backends: dict[str, Backend]
    progress: Fanout
    clock: Clock
    runner: Runner
    storewatch: StoreWatch
    metrics: Metrics  # /metrics (bot/operations/metrics.py)
    kinds: Kinds
    queue: JobQueue
    ownership: Ownership
    addressing: Addressing
    pipeline: Pipeline
    groups: Groups  # a chat front end that can list user groups sets `groups.members`
    approvals: Approvals
    destroyer: Destroyer
    leases: Leases
    intake: Intake
    builds: Builds
    migrations: Migrations  # `migrate plan|apply` (bot/migration/)
    audit_log: Audit
    queries: Queries
    personal: Personal
    inbox: Inbox  # commands from chat, kept until answered (bot/chat/inbox.py)
    chat_outbox: ChatOutbox  # notices chat must still be told (bot/chat/outbox.py)
    host_ca: HostCA | None = None  # certifies VMs' host keys (bot/sshca/); None: no CA
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set once started
    _leasing: asyncio.Task[None] | None = None
    _expiry: asyncio.Task[None] | None = None
    _sweeper: asyncio.Task[None] | None = None
    _closed: bool = False

    async def kind_of(self, ref: str) -> Kind:
        """The kind of the job or build `ref` (an id or a prefix) names; the deploy kind
        when it names none (its lookup then says so)."""
        return self.kinds.named(await self.store.jobs.kind_of(ref))

    async def rows_of(self, ref: str) -> Rows:
        """Which record the job `ref` names is: a `Job` or a `Build` (its kind's rows)."""
        return (await self.kind_of(ref)).rows

    async def _sweep_kinds(self) -> None:
        """Recover what the kinds keep outside `jobs` whose runner died (builds)."""
        for kind in self.kinds:
            work = kind.sweep()
            if work is not None:
                await work

    # --- life cycle ---------------------------------------------------------------

    async def start(self, *, expire_every_s: float = 30.0, settle: bool = True) -> None:
        """Become a runner: claim the queued jobs nobody holds and recover the ones whose
        runner died (bot/ownership/claims.py), then keep doing so in the background. With
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

    async def close(self, grace_s: float = 30.0, rollback_s: float | None = None) -> None:
        """Stop taking work, let running jobs finish within `grace_s` (renewing their
        claims meanwhile), then hand queued jobs back to the other runners. Closing
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
        """Give back IPAM records no job holds (bot/addresses/allocation.py); never raises: an IPAM
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
        """Validate, record and queue (or send for approval) one deploy (bot/requests/intake.py).

        A front end where nobody can approve (the one-shot CLI) passes
        `can_wait_for_approval=False`: such a request is refused before it is recorded.
        Keys and template the request does not name come from the requester's saved
        settings. `origin` is kept on the job for the front end; a second request with the
        same `dedupe_key` (a redelivery) raises `Duplicate` and records nothing.
        `check_free_first` asks the hypervisor whether the name and address are free
        before recording, so a chat user hears of a clash at once instead of from a
        failed job (the pipeline checks again when the job starts).
        """
        async with self.audit_log.audited(requester, "deploy"):
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
        async with self.audit_log.audited(approver, f"{verb} {ref[:40]}"):
            kind = await self.kind_of(ref)
            return await kind.decide(ref, approver, approved, reason, dedupe_key)

    async def may_decide_any(self, ref: str, approver: str) -> Record:
        """Refuse now what a decision on `ref`, whatever its kind, would refuse."""
        async with self.audit_log.audited(approver, f"decide {ref[:40]}"):
            return await (await self.kind_of(ref)).may_decide(ref, approver)

    async def _job_kind(self, ref: str) -> Kind:
        """The kind of the job `ref` names, for what answers with a `Job`: one whose
        rows are not `jobs` rows is looked up as a deploy (which says there is no job)."""
        kind = await self.kind_of(ref)
        return kind if kind.rows == "jobs" else self.kinds.named(None)

    async def approve(self, job_id: str, approver: str, *, dedupe_key: str | None = None) -> Job:
        async with self.audit_log.audited(approver, f"approve {job_id}"):
            kind = await self._job_kind(job_id)
            return _job(await kind.decide(job_id, approver, True, None, dedupe_key))

    async def reject(
        self, job_id: str, approver: str, reason: str, *, dedupe_key: str | None = None
    ) -> Job:
        async with self.audit_log.audited(approver, f"reject {job_id}"):
            kind = await self._job_kind(job_id)
            return _job(await kind.decide(job_id, approver, False, reason, dedupe_key))

    async def is_approver(self, user: str) -> bool:
        return await self.approvals.is_approver(user)

    async def may_decide(self, job_id: str, approver: str) -> Job:
        """Refuse now what a decision would refuse (before asking a reason, say)."""
        async with self.audit_log.audited(approver, f"decide {job_id}"):
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
        async with self.audit_log.audited(user, f"cancel {job_id}"):
            return _job(await (await self._job_kind(job_id)).cancel(job_id, user))

    # --- destroy and leases (bot/kinds/deploy/destroy.py, bot/leases/enforce.py) ---------

    async def request_destroy(
        self,
        target: str,
        user: str,
        *,
        can_wait_for_approval: bool = True,
        dedupe_key: str | None = None,
    ) -> Job:
        """Destroy the VM `target` names (its name or job id) now, or once approved."""
        async with self.audit_log.audited(user, f"destroy {target[:64]}"):
            return await self.destroyer.request(
                target, user, can_wait_for_approval=can_wait_for_approval, dedupe_key=dedupe_key
            )

    async def extend_lease(
        self, target: str, user: str, length_s: int | None = None, *, dedupe_key: str | None = None
    ) -> Job:
        """Move the lease end of the VM `target` names later (bot/leases/enforce.py)."""
        async with self.audit_log.audited(user, f"extend {target[:64]}"):
            return await self.leases.extend(target, user, length_s, dedupe_key=dedupe_key)

    async def vm_job(self, target: str) -> Job:
        """The job of the VM `target` names (its name, or a job id): `known-hosts`. A name
        no VM holds is its newest job's, if it has one (a deploy that failed, a VM
        destroyed since): the answer then says it is not ready, not that it is unknown."""
        try:
            return await self.destroyer.find(target)
        except JobNotFound:
            name = target.strip().lower() if target.isascii() else target
            newest = await self.store.jobs.history(name=name, limit=1)
            if not newest:
                raise
            return newest[0]

    # --- template builds (bot/kinds/build/) --------------------------------------------------

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
        async with self.audit_log.audited(user, f"template build {profile[:64]}"):
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
        async with self.audit_log.audited(approver, f"{verb} {build_id[:40]}"):
            return await self.builds.decide(build_id, approver, approved, note, dedupe_key)

    async def cancel_build(self, build_id: str, user: str) -> Build:
        """Cancel a template build (bot/kinds/build/cancel.py); a running one rolls back."""
        async with self.audit_log.audited(user, f"cancel {build_id[:40]}"):
            return await self.builds.cancel(build_id, user)

    # --- migrations (bot/migration/): from chat, approvers only ----------------------------

    async def migrate_plan(
        self, source: str, target: str, scope: Scope, user: str
    ) -> tuple[KeptPlan, Plan]:
        """A read-only plan of `source`'s templates against `target`, kept by id."""
        async with self.audit_log.audited(user, f"migrate plan {source[:40]} {target[:40]}"):
            await self.migrations.check_approver(user)
            return await self.migrations.plan(source, target, scope, user)

    async def migrate_apply(
        self,
        plan_id: str,
        user: str,
        *,
        origin: str | None = None,
        dedupe_key: str | None = None,
    ) -> Outcome:
        """Apply a kept plan: its templates' builds asked for (or found), and where
        the target stands now (`dedupe_key`: the chat command's inbox key)."""
        async with self.audit_log.audited(user, f"migrate apply {plan_id[:40]}"):
            await self.migrations.check_approver(user)
            plan = await self.migrations.load(plan_id)
            applied: Applied = await self.migrations.apply(
                plan, user, origin=origin, plan_id=plan_id, dedupe_key=dedupe_key
            )
            return await self.migrations.outcome(applied)

    # --- per-user settings and front-end references (bot/people/personal.py) -----------------

    async def prefs(self, user: str) -> UserPrefs:
        return await self.personal.prefs(user)

    async def save_ssh_key(self, user: str, text: str) -> UserPrefs:
        async with self.audit_log.audited(user, "save key"):
            return await self.personal.add_key(user, text)

    async def save_prefs(
        self, user: str, ssh_keys: tuple[str, ...], default_template: str | None
    ) -> UserPrefs:
        async with self.audit_log.audited(user, "save settings"):
            return await self.personal.replace(user, ssh_keys, default_template)

    async def audit(self, actor: str, action: str, detail: str, outcome: str = "refused") -> None:
        """Keep a refusal a front end decided itself (a command that does not parse)."""
        await self.audit_log.record(actor, action, detail, outcome)

    # --- read-only questions (bot/app/queries.py) ----------------------------------------

    async def status(self, job_id: str) -> JobStatus:
        return await self.queries.status(job_id)

    async def history(self, limit: int = 10, requester: str | None = None) -> list[Job]:
        return await self.queries.history(limit, requester)

    async def list_vms(self, requester: str | None, page: int, per_page: int) -> VMPage:
        return await self.queries.list_vms(requester, page, per_page)

    async def templates(self) -> dict[str, list[Template] | str]:
        return await self.queries.templates()

    async def template_builds(self) -> dict[str, dict[str, TemplateVersion]]:
        return await self.queries.template_builds()

    async def pending_approvals(self) -> list[Job]:
        return await self.queries.pending_approvals()

    async def quota_standing(self, user: str) -> list[Standing]:
        return await self.queries.quota_standing(user)

    async def revoked_host_keys(self) -> list[RevokedKey]:
        """Keys of VMs that are gone whose certificates hold still (bot/sshca/revocation.py)."""
        return await revoked_keys(self.store, utcnow())


def _job(record: Record) -> Job:
    """What a `jobs` kind answered (a `Job`, by `Kind.rows`)."""
    assert isinstance(record, Job), f"{record.id}: a jobs kind answered a {type(record).__name__}"
    return record
