"""One deploy, step by step, with an undo stack.

    check_free -> clone -> identity -> resize -> power_on -> address -> ssh [-> register]

Before each step the job's runner proves it still holds the job (bot/ownership.py:
`hold` pauses while the database does not answer, and stops the job where another
runner took it over); every write names the job's claim (owner and epoch), so a run
that lost its job changes nothing; a write of the job's progress that the database
did not take within `[store] write_retry_s` waits the same way and is made again.
Each step has a timeout; backend calls that fail with a retryable error are retried
with backoff inside it. A step that creates something pushes its undo *before* the
call, so a call that dies after the hypervisor acted (a crash, a lost answer) is still
undone. On failure or cancel the undo stack runs in reverse (stop and wait, then destroy
and wait), shielded from further cancellation; an undo that fails is recorded and
reported, never raised over the original error, and a VM that is still there afterwards
is listed as wreckage with its id.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from backends.base import (
    Backend,
    CloneSpec,
    IdTaken,
    VMRef,
)
from bot import logfields
from bot import progress as tell
from bot.addressing import Addressing, named
from bot.models import Claim, Job, JobState, RollbackReport, utcnow
from bot.ownership import Lost
from bot.progress import Progress
from bot.runs import (
    STEPS,
    Fence,
    Run,
    StepFailed,
    Undo,
    identity_of,
    resume_point,
    run_undo,
    vm_ref,
)
from bot.settings import Settings
from bot.steps import Steps
from bot.waiting import protected
from store.db import Store

log = logging.getLogger(__name__)
T = TypeVar("T")
Moved = tuple[bool, Job | None]  # a move's answer: whether it moved, the job as it is now


class Pipeline(Steps):
    def __init__(
        self,
        settings: Settings,
        backends: Mapping[str, Backend],
        store: Store,
        progress: Progress,
        fence: Fence,
        addressing: Addressing,
    ) -> None:
        """`fence` is this process's runner (bot/ownership.Ownership): every state
        change of a job names its claim, so a runner that lost a job (its lease lapsed)
        can no longer change it, and every step waits until the runner proves it holds
        the job."""
        self.fence = fence
        self.owner = fence.id
        self.addressing = addressing
        self.settings = settings
        self.backends = backends
        self.store = store
        self.progress = progress
        self.timeouts = settings.timeouts

    async def run(self, job_id: str) -> Job | None:
        """Run a queued job to a final state; None if it was no longer queued."""
        run: Run | None = None
        logfields.bind(job=job_id)
        try:
            started, job = await self.store.move(
                job_id,
                [JobState.QUEUED],
                JobState.RUNNING,
                held_by=Claim(runner=self.owner),  # its epoch is read from the answer
                notices=[tell.updated(job_id)],
                started_at=utcnow(),
            )
            if not started or job is None:
                return job if started else await self.store.get_job(job_id)
            await self.progress.job_updated(job)
            logfields.bind(backend=job.backend)
            log.info("job %s: started: %s", job_id, _summary(job))
            run = Run(job, self.backends[job.backend], job.claim(self.owner))
            self._undo_reservation(run)
            first = await self._resume(run) if job.vm_id is not None else 0
            await self._steps(run, first)
        except Lost:
            # Taken over while this runner could not renew: the new owner has the VM.
            log.warning("job %s: another runner holds it now; stopping here untouched", job_id)
            return await self.store.get_job(job_id)
        except asyncio.CancelledError:
            if run is None:
                return await protected(self._cancel_unstarted(job_id))
            return await protected(self._roll_back(run, JobState.CANCELLED, None))
        except StepFailed as failure:
            assert run is not None
            return await protected(self._roll_back(run, JobState.FAILED, failure))
        return await protected(self._succeed(run))

    async def _cancel_unstarted(self, job_id: str) -> Job | None:
        """Cancelled while starting: nothing was created, whichever state the job reached."""
        over = [tell.finished(job_id, RollbackReport())]
        mine = Claim(runner=self.owner)  # started here a moment ago, if at all
        if not await self.store.transition(
            job_id, [JobState.QUEUED], JobState.CANCELLED, notices=over, finished_at=utcnow()
        ):
            await self.store.transition(
                job_id, [JobState.RUNNING], JobState.ROLLING_BACK, held_by=mine
            )
            await self.store.transition(
                job_id,
                [JobState.ROLLING_BACK],
                JobState.CANCELLED,
                held_by=mine,
                notices=over,
                error="cancelled",
                finished_at=utcnow(),
            )
        job = await self.store.get_job(job_id)
        await self.addressing.release_quietly(job)
        if job is not None:
            await self.progress.job_finished(job, RollbackReport())
        return job

    async def _resume(self, run: Run) -> int:
        """Rebuild what a job interrupted by a restart had: its VM and its undo stack."""
        job = run.job
        assert job.vm_id is not None
        ref = vm_ref(job)
        run.ref = ref
        run.resumed = True
        t, backend = self.timeouts, run.backend
        run.undo.append(Undo(f"destroy VM {ref.vm_id}", lambda: backend.destroy(ref), t.destroy_s))
        events = await self.store.events(job.id)
        first = resume_point(events)
        if first is None:  # recovery checks first; if it changed meanwhile, roll back
            raise StepFailed("clone", "interrupted by a restart at a point that cannot be resumed")
        if any(
            e.step == "power_on" and e.phase == "started" for e in events
        ) and first > STEPS.index("power_on"):
            run.undo.append(
                Undo(f"stop VM {ref.vm_id}", lambda: backend.power_off(ref), t.power_off_s)
            )
        await self._run_note(
            run, STEPS[first], f"resuming after a restart of the bot, at {STEPS[first]}"
        )
        return first

    async def _steps(self, run: Run, first: int = 0) -> None:
        """Run STEPS from index `first` (0, or later when resuming after a restart),
        each once the runner proves it still holds the job."""
        for step in (*STEPS[first:], "register"):  # register: only with an IPAM record
            paused_s = await self.fence.hold(run.job.id, run.claim.epoch)
            if paused_s:
                why = "the database did not answer, so the bot could not prove the job"
                text = f"paused {paused_s:.1f} s before {step}: {why} was still its own; it is"
                await self._run_note(run, step, text)
            await self._run_step(run, step)

    async def _run_step(self, run: Run, step: str) -> None:
        req, backend, t = run.job.request, run.backend, self.timeouts
        if step == "check_free":
            await self._step(run, step, t.check_free_s, lambda: self._check_free(run))
        elif step == "clone":
            spec = CloneSpec(
                run.job.id,
                req.name,
                req.template,
                req.placement,
                req.storage,
                req.network,
                identity=identity_of(req),
                installation=run.job.installation,
            )
            mode = await self._call(run, step, t.check_free_s, lambda: backend.clone_mode(spec))
            detail = f"{req.template}, {mode.reason}"
            await self._step(run, step, t.clone_s, lambda: self._clone(run, spec), detail)
        elif step == "identity":
            ref, identity = self._ref(run), identity_of(req)
            detail = f"{req.user}@{req.address}, {req.cores} cores, {req.memory_mib} MiB"
            action = functools.partial(backend.apply_identity, ref, identity)
            await self._step(run, step, t.identity_s, action, detail)
        elif step == "resize" and req.disk_grow_gib:
            ref, grow = self._ref(run), req.disk_grow_gib
            action = functools.partial(backend.grow_disk, ref, grow)
            await self._step(run, step, t.resize_s, action, f"+{grow} GiB")
        elif step == "resize":
            await self._skip(run, step, "no growth asked")
        elif step == "power_on":
            ref = self._ref(run)
            run.undo.append(
                Undo(f"stop VM {ref.vm_id}", lambda: backend.power_off(ref), t.power_off_s)
            )
            await self._step(run, step, t.power_on_s, lambda: self._power_on(run))
        elif step == "address":
            await self._step(run, step, t.address_s, lambda: self._address(run), "guest agent")
        elif step == "ssh":
            detail = f"port {self._ssh_port}"
            await self._step(run, step, t.ssh_s, lambda: self._ssh(run), detail)
        elif step == "register" and run.job.ipam_ref is not None:
            action = functools.partial(self.addressing.activate, run.job)
            await self._step(run, step, t.check_free_s, action, self.addressing.ipam_name)

    def _undo_reservation(self, run: Run) -> None:
        """A job whose address the IPAM records gives it back when it rolls back (the
        first undo pushed, so the last run: after its VM is gone)."""
        if run.job.ipam_ref is None:
            return
        what = f"release {run.job.address} in {self.addressing.ipam_name}"
        release = functools.partial(self.addressing.release, run.job)
        run.undo.append(Undo(what, release, self.timeouts.check_free_s, vm=False))

    @property
    def _ssh_port(self) -> int:
        return self.settings.defaults.ssh_port

    @staticmethod
    def _ref(run: Run) -> VMRef:
        if run.ref is None:
            raise StepFailed("clone", "no VM id was recorded")
        return run.ref

    # --- steps --------------------------------------------------------------------

    async def _check_free(self, run: Run) -> str:
        req = run.job.request
        # One read for the name and, where the backend can, its VMs' addresses.
        taken, known = await named({req.backend: run.backend}, req)
        if taken:
            raise StepFailed(
                "check_free",
                f"a VM named {req.name} already exists on {req.backend} (id {taken[0].vm_id}): "
                "pick another name, or remove that VM first",
            )
        # Our own jobs' names and addresses were checked by the store when this job was
        # recorded (unique indexes over jobs in flight or succeeded); the address is
        # asked again of every hypervisor and the IPAM: a VM built by hand since then.
        who, unasked = await self.addressing.conflict(
            req, run.job.id, required=req.backend, known=known
        )
        if who is not None:
            raise StepFailed("check_free", f"{who}: deploy again with another address")
        free = f"{req.name} and {req.address.ip} are free"
        return f"{free} (not asked: {', '.join(unasked)})" if unasked else free

    async def _clone(self, run: Run, spec: CloneSpec) -> str:
        backend = run.backend
        if run.ref is None:
            ref = await backend.prepare_clone(spec)
            # Write-ahead: the id is stored and its undo pushed before anything exists.
            recorded = functools.partial(
                self.store.update_job,
                run.job.id,
                held_by=run.claim,
                vm_id=ref.vm_id,
                vm_placement=ref.placement,
            )
            if not await self._recorded(run, recorded):
                raise StepFailed("clone", "another process took this job over")
            run.ref = ref
            destroy = Undo(
                f"destroy VM {ref.vm_id}", lambda: backend.destroy(ref), self.timeouts.destroy_s
            )
            run.undo.append(destroy)
        ref = run.ref
        try:
            note = await backend.clone(spec, ref)  # a retry reuses the same id
        except IdTaken:
            # That id names someone else's VM now: never undo it; choose a new one.
            run.undo[:] = [u for u in run.undo if not u.vm]
            run.ref = None
            await self.store.update_job(
                run.job.id, held_by=run.claim, vm_id=None, vm_placement=None
            )
            raise
        where = f"VM {ref.vm_id} on {ref.placement or run.job.backend}"
        return f"{where}; {note}" if note else where

    async def _power_on(self, run: Run) -> str | None:
        """Start the VM. A resumed job's VM may be running already (its start outlived
        the restart): ask first then, and only then."""
        ref = self._ref(run)
        if run.resumed:
            found = await run.backend.find_vm(ref)
            if found is not None and found.running:
                return "already running"
        return await run.backend.power_on(ref)

    async def _address(self, run: Run) -> str:
        req = run.job.request
        found = await run.backend.wait_for_address(self._ref(run), req.address.ip)
        run.address = str(found)
        if found != req.address.ip:
            return f"guest reports {found}, not the requested {req.address.ip}"
        return str(found)

    async def _ssh(self, run: Run) -> str:
        address = ipaddress.IPv4Address(run.address or run.job.address)
        run.host_key = await run.backend.probe_ssh(self._ref(run), address, self._ssh_port)
        answers = f"{address}:{self._ssh_port} answers"
        return f"{answers}, host key {run.host_key}" if run.host_key else answers

    # --- endings ------------------------------------------------------------------

    async def _moved(self, run: Run, move: Callable[[], Awaitable[Moved]]) -> Moved:
        """One of the run's moves to a new state (`_recorded`); not moved when the job
        turned out to be another runner's while the database did not answer."""
        try:
            return await self._recorded(run, move)
        except Lost:
            return False, None

    async def _succeed(self, run: Run) -> Job | None:
        moved, job = await self._moved(
            run,
            functools.partial(
                self.store.move,
                run.job.id,
                [JobState.RUNNING],
                JobState.SUCCEEDED,
                held_by=run.claim,
                notices=self._tell(run.job, tell.finished(run.job.id, None)),
                final_address=run.address,
                host_key=run.host_key,
                finished_at=utcnow(),
            ),
        )
        if not moved:
            log.warning("job %s: taken over by another runner before it succeeded", run.job.id)
            return await self.store.get_job(run.job.id)
        if job is not None:
            log.info("job %s: succeeded in %s: %s", job.id, _took(job), job.ssh_line)
            await self.progress.job_finished(job, None)
        return job

    async def _roll_back(self, run: Run, final: JobState, failure: StepFailed | None) -> Job | None:
        job_id = run.job.id
        moved, rolling = await self._moved(
            run,
            functools.partial(
                self.store.move,
                job_id,
                [JobState.RUNNING],
                JobState.ROLLING_BACK,
                held_by=run.claim,
                notices=self._tell(run.job, tell.updated(job_id)),
            ),
        )
        if not moved:
            # Not ours any more (taken over after our lease lapsed): the new owner
            # decides about the VM; touching it here could destroy what it resumes.
            log.warning("job %s: no longer ours; leaving its VM to the new owner", job_id)
            return await self.store.get_job(job_id)
        if rolling is not None:
            await self.progress.job_updated(rolling)
        report = await self.undo(run.job, run.backend, run.undo, run.ref)
        moved, job = await self._moved(
            run,
            functools.partial(
                self.store.move,
                job_id,
                [JobState.ROLLING_BACK],
                final,
                held_by=run.claim,
                notices=self._tell(run.job, tell.finished(job_id, report)),
                failed_step=failure.step if failure else None,
                error=failure.reason if failure else "cancelled",
                wreckage=", ".join(report.wreckage) or None,
                finished_at=utcnow(),
            ),
        )
        if not moved:
            job = await self.store.get_job(job_id)
        if job is not None:
            left = f"; left: {job.wreckage}" if job.wreckage else "; nothing left"
            why = f" at {failure.step}: {failure.reason}" if failure else ""
            log.info("job %s: %s%s, rolled back%s", job_id, final.value, why, left)
            await self.progress.job_finished(job, report)
        return job

    async def undo(
        self, job: Job, backend: Backend, stack: list[Undo], ref: VMRef | None
    ) -> RollbackReport:
        """Run the undo stack in reverse, then check nothing of ours is left."""
        return await run_undo(
            self.store, self.timeouts, self._waiting_for_backend, job, backend, stack, ref
        )


def _summary(job: Job) -> str:
    """A job's request in one line for the log (no keys: they are not secrets, but long)."""
    req = job.request
    return (
        f"{req.name} {req.address} from {req.template} on {job.backend}"
        f"{'/' + req.placement if req.placement else ''}, {req.cores} cores, "
        f"{req.memory_mib} MiB, +{req.disk_grow_gib} GiB, for {job.requester}"
    )


def _took(job: Job) -> str:
    if job.started_at is None or job.finished_at is None:
        return "?"
    return f"{(job.finished_at - job.started_at).total_seconds():.1f} s"
