"""One deploy, step by step, with an undo stack.

    check_free -> clone -> identity -> resize -> power_on -> address -> ssh
        [-> certify] [-> forget_key] [-> register]

The steps are declared as data at the end of this module (`STEPS`: one `Step` record
each, with its action, undo, timeout and what a restart may do after it); the engine in
bot/jobs/steps.py runs them, the same way for every step.
Before each step the job's runner proves it still holds the job (bot/ownership/claims.py:
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

The SSH check confirms the host key the address presents (issue 28): it must be one the
hypervisor read inside the guest (`ReadsHostKeys`: Proxmox's guest agent) or the one
deploybot chose and the hypervisor installed (`ChoosesHostKeys`: the identity step makes
the pair, `forget_key` then removes the private key from the hypervisor before the job
succeeds; in a rollback a destroy that fails removes it first); another key fails the deploy
(an address conflict or an interceptor). Neither possible: the key is only seen over
SSH, and the job says so.

With a host CA (`[ssh] host_ca_env`, bot/sshca/) the confirmed key is certified: a key
deploybot chooses gets its certificate at the identity step (the hypervisor installs
both), a key read through the guest agent gets it at `certify`, installed through the
same channel (`InstallsHostCertificates`). A key only seen over SSH is never certified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping

from backends.abilities import ChoosesHostKeys, InstallsHostCertificates, ReadsHostKeys
from backends.base import (
    Backend,
    CloneSpec,
    IdTaken,
    PermanentError,
    RetryableError,
    Segment,
    VMRef,
)
from backends.sshcheck import fingerprint, new_host_key
from bot.addresses.allocation import Addressing, named
from bot.addresses.macs import mac_conflict
from bot.addresses.subnets import request_segment
from bot.config.settings import Settings
from bot.jobs import logfields
from bot.jobs import progress as tell
from bot.jobs.progress import Progress
from bot.jobs.steps import Engine, Step, UndoFrom, notices_for
from bot.jobs.waiting import protected
from bot.kinds.deploy.preflight import Preflight
from bot.kinds.deploy.runs import Fence, Run, StepFailed, Undo, identity_of, run_undo, vm_ref
from bot.models import Claim, HostKeySource, Job, JobState, RollbackReport, utcnow
from bot.ownership.claims import Lost
from bot.sshca.authority import HostCA
from bot.sshca.certificates import certify, read_certificate
from store.db import Store

log = logging.getLogger(__name__)
Moved = tuple[bool, Job | None]  # a move's answer: whether it moved, the job as it is now


class Pipeline:
    """The deploy: its steps (`STEPS`, below), run by an `Engine`, and its endings."""

    def __init__(
        self,
        settings: Settings,
        backends: Mapping[str, Backend],
        store: Store,
        progress: Progress,
        fence: Fence,
        addressing: Addressing,
        host_ca: HostCA | None = None,
        preflight: Preflight | None = None,
    ) -> None:
        """`fence` is this process's runner (bot/ownership/claims.Ownership): every state
        change of a job names its claim, so a runner that lost a job (its claim lapsed)
        can no longer change it, and every step waits until the runner proves it holds
        the job. `host_ca`: the CA that certifies confirmed host keys (None: none)."""
        self.fence = fence
        self.host_ca = host_ca
        self.owner = fence.id
        self.addressing = addressing
        self.settings = settings
        self.backends = backends
        self.store = store
        self.progress = progress
        self.timeouts = settings.timeouts
        self.engine = Engine(self, STEPS, store, progress, settings.timeouts, fence)
        self.preflight = preflight or Preflight()  # the privilege check of check_free

    async def run(self, job_id: str) -> Job | None:
        """Run a queued job to a final state; None if it was no longer queued."""
        run: Run | None = None
        logfields.bind(job=job_id)
        try:
            started, job = await self.store.jobs.move(
                job_id,
                [JobState.QUEUED],
                JobState.RUNNING,
                held_by=Claim(runner=self.owner),  # its epoch is read from the answer
                notices=[tell.updated(job_id)],
                started_at=utcnow(),
            )
            if not started or job is None:
                return job if started else await self.store.jobs.get(job_id)
            await self.progress.job_updated(job)
            logfields.bind(backend=job.backend)
            log.info("job %s: started: %s", job_id, _summary(job))
            run = Run(job, self.backends[job.backend], job.claim(self.owner))
            self.engine.arm(run)
            first = await self._resume(run) if job.vm_id is not None else 0
            await self.engine.run(run, first)
        except Lost:
            # Taken over while this runner could not renew: the new owner has the VM.
            log.warning("job %s: another runner holds it now; stopping here untouched", job_id)
            return await self.store.jobs.get(job_id)
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
        if not await self.store.jobs.transition(
            job_id, [JobState.QUEUED], JobState.CANCELLED, notices=over, finished_at=utcnow()
        ):
            await self.store.jobs.transition(
                job_id, [JobState.RUNNING], JobState.ROLLING_BACK, held_by=mine
            )
            await self.store.jobs.transition(
                job_id,
                [JobState.ROLLING_BACK],
                JobState.CANCELLED,
                held_by=mine,
                notices=over,
                error="cancelled",
                finished_at=utcnow(),
            )
        job = await self.store.jobs.get(job_id)
        await self.addressing.release_quietly(job)
        if job is not None:
            await self.progress.job_finished(job, RollbackReport())
        return job

    async def _resume(self, run: Run) -> int:
        """Rebuild what a job interrupted by a restart had: its VM and its undo stack."""
        job = run.job
        run.ref = vm_ref(job)
        run.resumed = True
        events = await self.store.jobs.events(job.id)
        first = self.engine.resume_point(events)
        # The undo of every step it will not run again (of all that began when it cannot
        # carry on: the rollback then needs them).
        self.engine.rearm(run, {e.step for e in events if e.phase == "started"}, first)
        if first is None:  # recovery checks first; if it changed meanwhile, roll back
            raise StepFailed("clone", "interrupted by a restart at a point that cannot be resumed")
        at = STEPS[first].name
        await self.engine.run_note(run, at, f"resuming after a restart of the bot, at {at}")
        return first

    @property
    def _ssh_port(self) -> int:
        return self.settings.defaults.ssh_port

    @staticmethod
    def _ref(run: Run) -> VMRef:
        if run.ref is None:
            raise StepFailed("clone", "no VM id was recorded")
        return run.ref

    # --- the steps' actions, undos and details (declared in STEPS below) -------------

    async def _check_free(self, run: Run) -> str:
        req = run.job.request
        # The privileges the steps need, before anything exists (kept a while when all there).
        segment = self._segment(run.job, "check_free")
        nics = (segment,) if segment is not None else ()
        unchecked = await self.preflight.check(
            req.backend, run.backend, req.template, nics, certificates=self.host_ca is not None
        )
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
        mac = await mac_conflict(run.backend, req)
        if mac is not None:
            raise StepFailed("check_free", f"{mac}: deploy again with another MAC")
        free = f"{req.name} and {', '.join(str(a.ip) for a in req.addresses)} are free"
        free = f"{free} (not asked: {', '.join(unasked)})" if unasked else free
        return f"{free}; {unchecked}" if unchecked else free

    async def _clone_detail(self, run: Run) -> str:
        spec, backend = self._clone_spec(run.job), run.backend
        t = self.timeouts.check_free_s
        mode = await self.engine.call(run, "clone", t, lambda: backend.clone_mode(spec))
        nic = f", NIC on {spec.segment}" if spec.segment is not None else ""
        return f"{run.job.request.template}, {mode.reason}{nic}"

    async def _clone(self, run: Run) -> str:
        spec, backend = self._clone_spec(run.job), run.backend
        if run.ref is None:
            ref = await backend.prepare_clone(spec)
            # Write-ahead: the id is stored and its undo pushed before anything exists.
            recorded = functools.partial(
                self.store.jobs.update,
                run.job.id,
                held_by=run.claim,
                vm_id=ref.vm_id,
                vm_placement=ref.placement,
            )
            if not await self.engine.recorded(run, recorded):
                raise StepFailed("clone", "another process took this job over")
            run.ref = ref
            run.undo.append(self._destroy(run))
        ref = run.ref
        try:
            note = await backend.clone(spec, ref)  # a retry reuses the same id
        except IdTaken:
            # That id names someone else's VM now: never undo it; choose a new one.
            run.undo[:] = [u for u in run.undo if not u.vm]
            run.ref = None
            await self.store.jobs.update(
                run.job.id, held_by=run.claim, vm_id=None, vm_placement=None
            )
            raise
        where = f"VM {ref.vm_id} on {ref.placement or run.job.backend}"
        return f"{where}; {note}" if note else where

    def _segment(self, job: Job, step: str) -> Segment | None:
        """Where its subnet puts the job's NIC on its backend, as the configuration says
        now (None: the backend's own network); refused as at the request when the subnet
        lost its segment there since (bot/addresses/subnets.segment_on)."""
        req = job.request
        found = request_segment(
            self.settings.subnets, req.subnet, req.address.ip, job.backend, req.network
        )
        if isinstance(found, str):
            raise StepFailed(step, found)
        return found

    def _more_segments(self, job: Job, step: str) -> tuple[Segment | None, ...]:
        """Each further NIC's segment (`req.nics`), from its own subnet as the first
        NIC's is; None where the backend has no segments (its own network)."""
        found: list[Segment | None] = []
        for nic in job.request.nics:
            segment = request_segment(
                self.settings.subnets, nic.subnet, nic.address.ip, job.backend, None
            )
            if isinstance(segment, str):
                raise StepFailed(step, segment)
            found.append(segment)
        return tuple(found)

    def _clone_spec(self, job: Job) -> CloneSpec:
        return _clone_spec(job, self._segment(job, "clone"), self._more_segments(job, "clone"))

    def _destroy(self, run: Run) -> Undo:
        ref, backend = self._ref(run), run.backend
        if not isinstance(backend, ChoosesHostKeys):
            return Undo(
                f"destroy VM {ref.vm_id}", lambda: backend.destroy(ref), self.timeouts.destroy_s
            )

        async def destroy() -> None:
            try:
                await backend.destroy(ref)
            except Exception:
                # The VM stays for now: the private host key deploybot chose must not stay
                # readable in its settings meanwhile (gc reports any that still hold one).
                try:
                    await backend.forget_host_key(ref)
                except Exception as exc:
                    log.warning("VM %s: could not remove its host key yet: %s", ref.vm_id, exc)
                raise

        return Undo(f"destroy VM {ref.vm_id}", destroy, self.timeouts.destroy_s)

    async def _identity_detail(self, run: Run) -> str:
        req = run.job.request
        return f"{req.user}@{req.address}, {req.cores} cores, {req.memory_mib} MiB"

    async def _identity(self, run: Run) -> str | None:
        req = run.job.request
        identity = identity_of(
            req,
            self._segment(run.job, "identity"),
            self._more_segments(run.job, "identity"),
        )
        if isinstance(run.backend, ChoosesHostKeys):
            # Its public half is recorded before the hypervisor gets the pair (the SSH
            # check of a job resumed after a restart requires it); the private half is
            # never stored or logged.
            pair = new_host_key()
            source = HostKeySource.CHOSEN
            # Its certificate goes in with it (None without a CA): public, kept with it.
            certificate = self._certificate(run, pair.public, str(req.address.ip))
            recorded = functools.partial(
                self.store.jobs.update,
                run.job.id,
                held_by=run.claim,
                host_key=pair.public,
                host_key_source=source,
                host_certificate=certificate,
            )
            if not await self.engine.recorded(run, recorded):
                raise StepFailed("identity", "another process took this job over")
            run.job = run.job.model_copy(
                update={
                    "host_key": pair.public,
                    "host_key_source": source,
                    "host_certificate": certificate,
                }
            )
            identity = dataclasses.replace(identity, host_key=pair, host_certificate=certificate)
        return await run.backend.apply_identity(self._ref(run), identity)

    def _certificate(self, run: Run, public_line: str, address: str) -> str | None:
        """The host CA's certificate of the VM's key `public_line` (None: no CA)."""
        if self.host_ca is None:
            return None
        return certify(self.host_ca, run.job, public_line, address, self.fence.clock())

    def _no_certificate(self, run: Run) -> str | None:
        """Why `certify` does not apply to this run, or None when it does."""
        backend = run.backend
        if self.host_ca is None:
            return "no host CA configured ([ssh] host_ca_env)"
        if run.host_key_source is HostKeySource.CHOSEN:
            if run.host_certificate is not None:
                return "installed with the host key deploybot chose, at the identity step"
            return "the host key deploybot chose went in without one"
        if run.host_key is None or run.host_key_source is not HostKeySource.AGENT:
            return (
                "the host key was only seen over SSH: deploybot certifies only a key the "
                "hypervisor confirmed"
            )
        if not isinstance(backend, InstallsHostCertificates):
            return f"{run.job.backend} cannot install a certificate into a running guest"
        return None

    async def _certify(self, run: Run) -> str:
        """Sign the host key the guest agent confirmed and install the certificate through
        the same channel. Safe to run again: a new certificate replaces the old one."""
        backend, key = run.backend, run.host_key
        if not isinstance(backend, InstallsHostCertificates) or key is None:
            raise StepFailed("certify", "nothing to certify")  # _no_certificate said so
        address = run.address or run.job.address
        certificate = self._certificate(run, key, address)
        if certificate is None:
            raise StepFailed("certify", "no host CA configured")
        note = await backend.install_host_certificate(self._ref(run), certificate)
        run.host_certificate = certificate
        info = read_certificate(certificate)
        held = (
            f" for {', '.join(info.principals)} until {info.valid_before:%Y-%m-%d}" if info else ""
        )
        done = f"signed{held}, installed through {backend.certificates_through}"
        return f"{done}; {note}" if note else done

    async def _forget_key(self, run: Run) -> str:
        backend = run.backend
        if not isinstance(backend, ChoosesHostKeys):  # a job resumed on a changed config
            return "nothing to remove"
        ref = self._ref(run)
        await backend.forget_host_key(ref)
        if await backend.holds_host_key(ref):  # a hypervisor that did not take the change
            raise RetryableError(f"VM {ref.vm_id} still keeps its private host key")
        return f"removed from VM {ref.vm_id}'s settings on {run.job.backend}"

    async def _resize_detail(self, run: Run) -> str:
        return f"+{run.job.request.disk_grow_gib} GiB"

    async def _resize(self, run: Run) -> str | None:
        return await run.backend.grow_disk(self._ref(run), run.job.request.disk_grow_gib)

    def _stop(self, run: Run) -> Undo:
        ref, backend = self._ref(run), run.backend
        return Undo(
            f"stop VM {ref.vm_id}", lambda: backend.power_off(ref), self.timeouts.power_off_s
        )

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

    async def _ssh_detail(self, run: Run) -> str:
        return f"port {self._ssh_port}"

    async def _ssh(self, run: Run) -> str:
        """Prove the address answers on SSH with the new VM's host key."""
        address = ipaddress.IPv4Address(run.address or run.job.address)
        ref, backend = self._ref(run), run.backend
        expected, source, how = await self._expected_keys(run, ref)
        presented = await backend.probe_ssh(ref, address, self._ssh_port)
        answers = f"{address}:{self._ssh_port} answers"
        if presented is None:
            if expected:  # an sshd still starting; a listener that is no sshd never ends
                raise RetryableError(f"{answers} but has not shown its host key yet")
            run.host_key, run.host_key_source, run.host_certificate = None, None, None
            return answers
        if expected and not _among(presented, expected) and source is HostKeySource.AGENT:
            # Keys the guest replaced (cloud-init) after they were read: sshd runs only once
            # its final keys exist, so a read after the probe is the truth.
            expected, source, how = await self._expected_keys(run, ref)
        if expected and not _among(presented, expected):
            theirs = ", ".join(fingerprint(k) for k in expected)
            raise PermanentError(
                f"{address} answered with host key {fingerprint(presented)}, which is not "
                f"the new VM's ({theirs}, {how}): possible address conflict or "
                f"interception. Find what else answers on {address} (a stale VM or another "
                "host with that address, a wrong VLAN) before deploying to it again",
                vm_id=ref.vm_id,
            )
        run.host_key, run.host_key_source = _key_of(presented), source
        # A chosen key's certificate went in with it; a key read through the agent gets
        # its own at `certify`.
        chosen = source is HostKeySource.CHOSEN
        run.host_certificate = run.job.host_certificate if chosen else None
        return f"{answers}, host key {fingerprint(presented)} ({how})"

    async def _expected_keys(self, run: Run, ref: VMRef) -> tuple[list[str], HostKeySource, str]:
        """The keys the address must present, how they are known, and that said for
        people; none: the key can only be seen over SSH."""
        backend = run.backend
        if run.job.host_key_source is HostKeySource.CHOSEN and run.job.host_key:
            return [run.job.host_key], HostKeySource.CHOSEN, "chosen by deploybot"
        if isinstance(backend, ReadsHostKeys):
            keys = await backend.host_keys(ref)
            if keys:
                return keys, HostKeySource.AGENT, f"confirmed through {backend.host_keys_through}"
            # No key files yet: cloud-init writes them after the network is up, and a key
            # that answers meanwhile must not be believed (it may be an interceptor's).
            raise RetryableError(
                f"{backend.host_keys_through} finds no SSH host key files in the guest yet"
            )
        return [], HostKeySource.SSH, f"only seen over SSH: {run.job.backend} cannot read it"

    async def _register_detail(self, run: Run) -> str:
        return self.addressing.ipam_name

    async def _register(self, run: Run) -> str | None:
        return await self.addressing.activate(run.job)

    def _release(self, run: Run) -> Undo:
        """A job whose address the IPAM records gives it back when it rolls back (pushed
        at the start, so run last: after its VM is gone)."""
        shown = ", ".join(str(a.ip) for a in run.job.request.addresses)  # every NIC's
        what = f"release {shown} in {self.addressing.ipam_name}"
        release = functools.partial(self.addressing.release, run.job)
        return Undo(what, release, self.timeouts.check_free_s, vm=False)

    def _ipam(self, job: Job) -> str:
        return self.addressing.ipam_name

    # --- endings ------------------------------------------------------------------

    async def _moved(self, run: Run, move: Callable[[], Awaitable[Moved]]) -> Moved:
        """One of the run's moves to a new state (`Engine.recorded`); not moved when the job
        turned out to be another runner's while the database did not answer."""
        try:
            return await self.engine.recorded(run, move)
        except Lost:
            return False, None

    async def _succeed(self, run: Run) -> Job | None:
        moved, job = await self._moved(
            run,
            functools.partial(
                self.store.jobs.move,
                run.job.id,
                [JobState.RUNNING],
                JobState.SUCCEEDED,
                held_by=run.claim,
                notices=notices_for(run.job, tell.finished(run.job.id, None)),
                final_address=run.address,
                host_key=run.host_key,
                host_key_source=run.host_key_source,
                host_certificate=run.host_certificate,
                finished_at=utcnow(),
            ),
        )
        if not moved:
            log.warning("job %s: taken over by another runner before it succeeded", run.job.id)
            return await self.store.jobs.get(run.job.id)
        if job is not None:
            log.info("job %s: succeeded in %s: %s", job.id, _took(job), job.ssh_line)
            await self.progress.job_finished(job, None)
        return job

    async def _roll_back(self, run: Run, final: JobState, failure: StepFailed | None) -> Job | None:
        job_id = run.job.id
        moved, rolling = await self._moved(
            run,
            functools.partial(
                self.store.jobs.move,
                job_id,
                [JobState.RUNNING],
                JobState.ROLLING_BACK,
                held_by=run.claim,
                notices=notices_for(run.job, tell.updated(job_id)),
            ),
        )
        if not moved:
            # Not ours any more (taken over after our claim lapsed): the new owner
            # decides about the VM; touching it here could destroy what it resumes.
            log.warning("job %s: no longer ours; leaving its VM to the new owner", job_id)
            return await self.store.jobs.get(job_id)
        if rolling is not None:
            await self.progress.job_updated(rolling)
        report = await self.undo(run.job, run.backend, run.undo, run.ref)
        moved, job = await self._moved(
            run,
            functools.partial(
                self.store.jobs.move,
                job_id,
                [JobState.ROLLING_BACK],
                final,
                held_by=run.claim,
                notices=notices_for(run.job, tell.finished(job_id, report)),
                failed_step=failure.step if failure else None,
                error=failure.reason if failure else "cancelled",
                wreckage=", ".join(report.wreckage) or None,
                finished_at=utcnow(),
            ),
        )
        if not moved:
            job = await self.store.jobs.get(job_id)
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
            self.store, self.timeouts, self.engine.waiting, job, backend, stack, ref
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


def _clone_spec(
    job: Job, segment: Segment | None, more_segments: tuple[Segment | None, ...] = ()
) -> CloneSpec:
    req = job.request
    identity = identity_of(req, segment, more_segments)
    return CloneSpec(
        job.id,
        req.name,
        req.template,
        req.placement,
        req.storage,
        req.network,
        segment=segment,
        identity=identity,
        installation=job.installation,
        more_nics=identity.more_nics,
        mac=req.mac,
    )


def _grows(job: Job) -> bool:
    return bool(job.request.disk_grow_gib)


def _has_ipam_record(job: Job) -> bool:
    return job.ipam_ref is not None


def _chose_host_key(job: Job) -> bool:
    return job.host_key_source is HostKeySource.CHOSEN


def _among(presented: str, keys: list[str]) -> bool:
    return _key_of(presented) in {_key_of(k) for k in keys}


def _key_of(line: str) -> str:
    """An OpenSSH public key line as compared: its algorithm and key, no comment."""
    return " ".join(line.split()[:2])


# The deploy, one record per step, in order. After a restart a job may carry on once
# its clone has finished: every later step is safe to run again (the identity is one
# config change, a disk growth aims at a size the backend marked on the VM, a start
# finds the VM running, the address and SSH check only look, a certificate is signed
# and installed anew over the old one, the IPAM record is activated again). Before
# that, only a rollback is safe: the clone may be half made.
# The address is read again rather than remembered: it is cheap and the SSH check needs it.
STEPS: tuple[Step[Pipeline], ...] = (
    Step("check_free", Pipeline._check_free, "check_free_s"),
    Step(
        "clone",
        Pipeline._clone,
        "clone_s",
        detail=Pipeline._clone_detail,
        undo=Pipeline._destroy,
        undo_from=UndoFrom.ACTION,  # write-ahead: once the VM's id is recorded
        resumable=True,
    ),
    Step(
        "identity",
        Pipeline._identity,
        "identity_s",
        detail=Pipeline._identity_detail,
        resumable=True,
    ),
    Step(
        "resize",
        Pipeline._resize,
        "resize_s",
        detail=Pipeline._resize_detail,
        when=_grows,
        skipped="no growth asked",
        resumable=True,
    ),
    Step("power_on", Pipeline._power_on, "power_on_s", undo=Pipeline._stop, resumable=True),
    Step(
        "address",
        Pipeline._address,
        "address_s",
        detail="guest agent",
        resumable=True,
        read_again=True,
    ),
    Step(
        "ssh",
        Pipeline._ssh,
        "ssh_s",
        detail=Pipeline._ssh_detail,
        polled=True,  # a refused port right after the agent answered: sshd still starting
        resumable=True,
        read_again=True,
    ),
    Step(
        "certify",
        Pipeline._certify,
        "identity_s",  # a file written and sshd reloaded, through the guest agent
        detail="by deploybot's host CA",
        skip=Pipeline._no_certificate,
        resumable=True,
    ),
    Step(
        "forget_key",
        Pipeline._forget_key,
        "identity_s",  # one config change, as the identity
        detail="the private host key, from the hypervisor",
        when=_chose_host_key,
        resumable=True,
    ),
    Step(
        "register",
        Pipeline._register,
        "check_free_s",
        detail=Pipeline._register_detail,
        undo=Pipeline._release,
        undo_from=UndoFrom.START,  # the address was reserved when the job was recorded
        when=_has_ipam_record,
        resumable=True,
        waits_for=Pipeline._ipam,
    ),
)
