"""Leases: every VM gets an end; reminders before it, power-off at it, destroy after.

    succeeded ──end reached: power off──> expired_off ──grace over──> destroying ──> destroyed
        ^  │                                  │
        │  └─extend (new end, reminders anew)  │
        └──────────extend (powered on again)───┘

A request gets a lease length (`[leases]` default, per template or backend; `lease=7d`;
`never` only for approvers and `never_groups`; never over `max`). The end is that long
after the VM was ready (`Job.lease_end`), or what an extension set (`expires_at`).

The timer (`step`, every `check_every_s` in each process that takes work over) reads
the watched jobs and acts by compare-and-set (store/leases.py), so any number of
processes may run it: a reminder is recorded as sent in the transaction of its notice,
once; an expiry powers the VM off (safe to repeat: the backend refuses a VM without the
job's tag and counts a stopped one as done) and then moves succeeded -> expired_off
once; after `grace` one process moves expired_off -> destroying as its owner and hands
the job to `Destroyer.start`, whose ownership and takeover (bot/ownership/claims.py) carry it
to the end. A process killed at any point leaves a state the next step finishes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta

from backends.abilities import InstallsHostCertificates
from backends.base import Backend, NotOurVM
from bot.approvals.decisions import Approvals
from bot.config.settings import Settings
from bot.jobs.progress import Progress
from bot.jobs.waiting import retrying
from bot.kinds.deploy.destroy import Destroyer
from bot.kinds.deploy.runs import vm_ref
from bot.leases.terms import LeaseSettings, show_length
from bot.models import AuditEvent, DeployRequest, HostKeySource, Job, JobState
from bot.models.errors import BackendError, Duplicate, NotAllowed, RequestInvalid, TransitionRefused
from bot.models.notices import Notice, NoticeKind
from bot.ownership.claims import Clock, Ownership
from bot.sshca.authority import HostCA
from bot.sshca.certificates import certify, read_certificate
from store.db import AlreadyDelivered, Store

log = logging.getLogger(__name__)
BOT = "deploybot"
CONCURRENCY = 8  # jobs a timer step works on at once


def notice(job: Job, step: str, when: datetime | None, at: datetime, by: str = BOT) -> Notice:
    """A lease notice: the front end words it (handlers/messages/) in the reader's zone;
    `at` is the (injected) clock's now, from which "in 3 days" is counted."""
    return Notice(job_id=job.id, kind=NoticeKind.LEASE, step=step, when=when, text=by, at=at)


class Leases:
    """Grants, extends and runs the leases of one runner's view of the store."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        progress: Progress,
        ownership: Ownership,
        approvals: Approvals,
        destroyer: Destroyer,
        clock: Clock,
        host_ca: HostCA | None = None,
    ) -> None:
        """`host_ca`: an extension signs the VM's host certificate again, to the new end."""
        self.settings = settings
        self.host_ca = host_ca
        self.policy: LeaseSettings = settings.leases
        self.store = store
        self.backends = backends
        self.progress = progress
        self.ownership = ownership
        self.approvals = approvals
        self.destroyer = destroyer
        self.clock = clock
        self._busy: set[str] = set()  # jobs a step of this process is working on

    # --- granting ---------------------------------------------------------------------

    async def grant(
        self, asked: int | None, never: bool, request: DeployRequest, requester: str
    ) -> int | None:
        """The lease a request gets: asked for (checked), else the configured default."""
        if never:
            await self._check_never(requester)
            return None
        if asked is None:
            return self.policy.default_for(request.template, request.backend)
        if asked > self.policy.max:
            most = show_length(self.policy.max)
            raise RequestInvalid(
                [
                    f"lease={show_length(asked)} is longer than the maximum here ({most}): "
                    f"ask for lease={most} or less, and extend it later with "
                    f"`/deploy lease extend {request.name} 7d`."
                ]
            )
        if asked <= 0:
            raise RequestInvalid([f"lease={show_length(asked)}: give a length, like lease=7d."])
        return asked

    async def may_never(self, user: str) -> bool:
        """Approvers, and members of `[leases] never_groups`, may keep a VM forever."""
        if await self.approvals.is_approver(user):
            return True
        return await self.approvals.in_groups(user, self.policy.never_groups, "lease")

    async def _check_never(self, user: str) -> None:
        if not await self.may_never(user):
            most = show_length(self.policy.max)
            raise NotAllowed(
                f"lease=never (no end) is only for approvers and their groups; ask for up to "
                f"lease={most}, extend it before it ends, or ask an approver "
                f"({self.approvals.approvers_text()}) to deploy it without an end.",
                people=self.approvals.policy.approvers,
            )

    # --- extending --------------------------------------------------------------------

    async def extend(
        self, target: str, user: str, length: int | None, *, dedupe_key: str | None = None
    ) -> Job:
        """Move the end `length` later (None: the configured `step`, cut at `max` from
        now); a powered-off VM is powered on again. Refusals say what to ask instead."""
        job = await self._find(target)
        if not await self.destroyer.may_destroy(user, job):
            raise NotAllowed(  # the people first: a VM's name could look like an id
                f"Only {job.requester} (who deployed it) or an approver may extend the lease "
                f"of {job.name}; ask one of them ({self.approvals.approvers_text()}).",
                people=(job.requester, *self.approvals.policy.approvers),
            )
        for _ in range(3):  # another extension or the timer may move it meanwhile
            end = self._new_end(job, length)
            told = [notice(job, "extended", end, self.clock(), user)]
            audit = self._audit(user, job, "extended", f"to {end:%Y-%m-%d %H:%M} UTC")
            try:
                done = await self.store.leases.write_step(
                    "extend", job, end, told, audit, dedupe_key
                )
            except AlreadyDelivered:
                raise Duplicate(
                    f"This extension of job {job.id} was already made.", job.id
                ) from None
            if done is not None:
                await self.progress.job_updated(done, f"lease extended by {user}")
                if job.state is JobState.EXPIRED_OFF:
                    await self._power_on(done)
                    return done  # its guest is booting: its certificate keeps its end
                return await self._recertify(done)
            job = await self._find(job.id)
        raise TransitionRefused(
            f"The lease of {job.name} kept changing while I extended it; look at it with "
            f"`/deploy status {job.id}` and extend it again."
        )

    async def _find(self, target: str) -> Job:
        job = await self.destroyer.find(target)
        if job.state not in (JobState.SUCCEEDED, JobState.EXPIRED_OFF):
            raise TransitionRefused(
                f"{job.name} (job {job.id}) is {job.state.value}: only a ready VM's lease can "
                f"be extended. See `/deploy status {job.id}`."
            )
        if job.lease_end is None:
            raise TransitionRefused(
                f"{job.name} has no lease end (lease=never, or deployed before leases): it "
                "stays until someone destroys it, so there is nothing to extend."
            )
        return job

    def _new_end(self, job: Job, length: int | None) -> datetime:
        now = self.clock()
        cap = now + timedelta(seconds=self.policy.max)
        start = max(now, job.lease_end or now)
        if length is None:  # the button: one step, up to the maximum
            end = min(start + timedelta(seconds=self.policy.step), cap)
            if end <= start:
                raise TransitionRefused(
                    f"{job.name}'s lease already reaches the maximum of "
                    f"{show_length(self.policy.max)} from now: extend it again later."
                )
            return end
        end = start + timedelta(seconds=length)
        if end > cap:
            room = int((cap - start).total_seconds()) // 3600 * 3600
            more = f"at most {show_length(room)}" if room > 0 else "nothing more now"
            raise RequestInvalid(
                [
                    f"Extending {job.name} by {show_length(length)} would pass the maximum "
                    f"lease of {show_length(self.policy.max)} from now: ask for {more}."
                ]
            )
        return end

    async def _recertify(self, job: Job, *, tell: bool = True) -> Job:
        """The job with its VM's host certificate signed again to the lease's new end and
        installed, where it can be: a CA, a certificate already, a key the guest agent
        confirmed, a backend that installs certificates, and the VM still this job's (its
        tag). Otherwise, or when that fails, the old certificate stays (the answer names
        its end); a failure is told in the job's thread (`tell`: an extension; the timer,
        which tries again at its next step, only logs it)."""
        ca, backend, key = self.host_ca, self.backends.get(job.backend), job.host_key
        agent = job.host_key_source is HostKeySource.AGENT
        if ca is None or key is None or job.host_certificate is None or not agent:
            return job
        if not isinstance(backend, InstallsHostCertificates):
            return job
        ref = vm_ref(job)
        certificate = certify(ca, job, key, job.final_address or job.address, self.clock())

        async def install() -> None:
            found = await backend.find_vm(ref)  # never into a VM that is not this job's
            if found is None or ref.tag not in found.tags:
                raise NotOurVM(f"VM {ref.vm_id} does not carry tag {ref.tag}", vm_id=ref.vm_id)
            await backend.install_host_certificate(ref, certificate)

        timeouts = self.settings.timeouts
        try:
            async with asyncio.timeout(timeouts.identity_s):
                await retrying(install, timeouts)
        except (BackendError, TimeoutError) as exc:
            text = exc.message if isinstance(exc, BackendError) else "it took too long"
            log.warning("job %s: host certificate not renewed: %s", job.id, text)
            if tell:
                await self.progress.job_note(job, f"its host certificate was not renewed: {text}")
            return job
        await self.store.jobs.update(job.id, host_certificate=certificate)
        return job.model_copy(update={"host_certificate": certificate})

    async def _power_on(self, job: Job) -> None:
        backend = self.backends.get(job.backend)
        if backend is None:
            return
        try:
            async with asyncio.timeout(self.settings.timeouts.power_on_s):
                await backend.power_on(vm_ref(job))
        except (BackendError, TimeoutError) as exc:
            text = exc.message if isinstance(exc, BackendError) else "it took too long"
            await self.progress.job_note(job, f"powering {job.name} on again failed: {text}")

    # --- the timer --------------------------------------------------------------------

    async def loop(self, *, at_once: bool = False) -> None:
        """The timer: a step every `check_every_s` (`at_once`: the first one now)."""
        while True:
            if not at_once:
                await asyncio.sleep(self.policy.check_every_s)
            at_once = False
            try:
                await self.step()
            except Exception:
                log.exception("the lease timer's step failed; it runs again shortly")

    async def step(self, now: datetime | None = None) -> None:
        """Send due reminders, power off what ended, destroy what passed its grace;
        `CONCURRENCY` jobs at a time (power-offs wait for the hypervisor)."""
        now = now or self.clock()
        room = asyncio.Semaphore(CONCURRENCY)

        async def one(job: Job) -> None:
            async with room:
                try:
                    await self._step_one(job, now)
                except Exception:
                    log.exception("job %s: the lease step failed; it is tried again", job.id)
                finally:
                    self._busy.discard(job.id)

        todo = [j for j in await self.store.leases.watched() if j.id not in self._busy]
        self._busy.update(j.id for j in todo)
        await asyncio.gather(*(one(job) for job in todo))

    async def _step_one(self, job: Job, now: datetime) -> None:
        end = job.lease_end
        if job.state is JobState.EXPIRED_OFF:
            off = job.powered_off_at or now
            if off + timedelta(seconds=self.policy.grace) <= now:
                await self._destroy(job, now)
        elif end is not None and end <= now:
            await self._expire(job, end, now)
        elif end is not None:
            await self._remind(job, end, now)
            if _certificate_behind(job, end):
                # Its extension re-signed nothing (the process died right after it, the
                # VM was off, the install failed): the timer catches up until it works.
                await self._recertify(job, tell=False)

    async def _remind(self, job: Job, end: datetime, now: datetime) -> None:
        sent = {int(o) for o in (job.reminders_sent or "").split(",") if o.isdigit()}
        due = {o for o in self.policy.reminders if end - timedelta(seconds=o) <= now}
        if not due - sent:
            return
        # Every reminder due is recorded at once: a process that was down for days sends
        # the latest one, not a burst of stale ones.
        record = ",".join(str(o) for o in sorted(sent | due, reverse=True))
        audit = self._audit(BOT, job, "reminded", f"ends {end:%Y-%m-%d %H:%M} UTC")
        done = await self.store.leases.write_step(
            "remind", job, record, [notice(job, "remind", end, now)], audit
        )
        if done is not None:
            left = show_length(int((end - now).total_seconds()) // 60 * 60)
            await self.progress.job_note(done, f"lease ends in {left}; a reminder was sent")

    async def _expire(self, job: Job, end: datetime, now: datetime) -> None:
        backend = self.backends.get(job.backend)
        if backend is None or job.vm_id is None:
            log.warning("job %s: its lease ended but backend %s is not here", job.id, job.backend)
            return
        step = "expired"
        try:
            async with asyncio.timeout(self.settings.timeouts.power_off_s):
                await backend.power_off(vm_ref(job))
        except NotOurVM as exc:  # changed by hand: left running, and the thread says so
            log.warning("job %s: lease ended; not powered off: %s", job.id, exc.message)
            step = "untouched"
        except (BackendError, TimeoutError) as exc:
            log.warning("job %s: lease ended; powering off failed (%s); tried again", job.id, exc)
            return
        destroy_at = now + timedelta(seconds=self.policy.grace)
        audit = self._audit(BOT, job, "expired", f"powered off; destroyed after {destroy_at}")
        told = [notice(job, step, destroy_at, now)]
        done = await self.store.leases.write_step("expire", job, now, told, audit)
        if done is not None:
            said = (
                "VM powered off, not destroyed" if step == "expired" else "VM not ours, untouched"
            )
            await self.progress.job_updated(done, f"lease ended: {said}")
            return
        # Not recorded: extended (or destroyed) while it was being powered off. A VM
        # whose lease goes on must run again.
        again = await self.store.jobs.get(job.id)
        if again is not None and again.state is JobState.SUCCEEDED:
            await self._power_on(again)

    async def _destroy(self, job: Job, now: datetime) -> None:
        moved, doomed = await self.store.jobs.move(
            job.id,
            [JobState.EXPIRED_OFF],
            JobState.DESTROYING,
            notices=[notice(job, "destroying", job.lease_end, now)],
            owner=self.ownership.id,
            lease_until=self.ownership.claim_until(),
            destroy_by=BOT,
            destroy_asked_at=now,
            destroy_approver=None,
        )
        if not moved or doomed is None:
            return  # extended, or another process began the destroy
        await self.store.audit.add(self._audit(BOT, doomed, "destroying", "grace period over"))
        await self.progress.job_updated(doomed, "lease ended and its grace period is over")
        self.destroyer.start(doomed)

    def _audit(self, actor: str, job: Job, outcome: str, detail: str) -> AuditEvent:
        return AuditEvent(
            at=self.clock(),
            actor=actor,
            action=f"lease {job.id}",
            outcome=outcome,
            detail=f"{job.name}: {detail}",
        )


# A certificate signed at the deploy ends a little before the lease (signed before the VM
# was ready): only one that ends well before it was left behind by an extension.
RENEW_BEFORE = timedelta(hours=1)


def _certificate_behind(job: Job, end: datetime) -> bool:
    """Whether the job's host certificate ends well before its lease: an extension whose
    re-signing did not happen (or failed) and that the timer makes good."""
    if job.host_certificate is None or job.host_key_source is not HostKeySource.AGENT:
        return False
    info = read_certificate(job.host_certificate)
    return info is not None and info.valid_before < end - RENEW_BEFORE
