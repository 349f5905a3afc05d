"""The parts of one deploy's run that are plain data and functions: the run, its undo
stack and how it is run (bot/kinds/deploy/pipeline.py declares the steps,
bot/jobs/steps.py runs them).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from backends.base import Backend, Identity, Nic, Segment, VMRef
from bot.config.sections import Timeouts
from bot.jobs.waiting import retrying
from bot.models import Claim, DeployRequest, HostKeySource, Job, JobEvent, RollbackReport
from bot.models.errors import BackendError, JobError
from store.db import Store
from store.engine import is_database_error

log = logging.getLogger(__name__)

# Runs one backend call of `job`'s step, retrying what is retryable (the step engine's
# `waiting`, which also tells chat while it waits); `seen` collects the
# errors met on the way.
Waiting = Callable[[Job, str, Callable[[], Awaitable[None]], list[str]], Awaitable[None]]


def vm_ref(job: Job) -> VMRef:
    """The handle of a job's VM, from what the store recorded before the clone."""
    if job.vm_id is None:
        raise ValueError(f"job {job.id} has no VM id")
    return VMRef(job.vm_id, job.id, job.vm_placement, job.installation)


def identity_of(
    req: DeployRequest,
    segment: Segment | None = None,
    more_segments: tuple[Segment | None, ...] = (),
) -> Identity:
    """What the guest is given, from the request; `segment` is the first NIC's,
    `more_segments` those of `req.nics` in order (each from its subnet). DNS servers and
    search domains of every NIC are merged, the first NIC's first, none twice."""
    dns = tuple(dict.fromkeys((*req.dns, *(ip for n in req.nics for ip in n.dns))))
    searches = [n.search_domain for n in req.nics if n.search_domain]
    more = tuple(dict.fromkeys(d for d in searches if d != req.search_domain))
    return Identity(
        hostname=req.name,
        user=req.user,
        ssh_keys=req.ssh_keys,
        address=req.address,
        gateway=req.gateway,
        dns=dns,
        search_domain=req.search_domain or (more[0] if more else ""),
        upgrade=req.upgrade,
        cores=req.cores,
        memory_mib=req.memory_mib,
        network=req.network,
        segment=segment,
        more_nics=tuple(
            Nic(n.address, n.gateway, s, n.mac)
            for n, s in zip(req.nics, _padded(more_segments, len(req.nics)), strict=True)
        ),
        mac=req.mac,
        search_domains=more[1:] if not req.search_domain else more,
    )


def _padded(segments: tuple[Segment | None, ...], count: int) -> tuple[Segment | None, ...]:
    return (*segments[:count], *((None,) * (count - len(segments))))


class StepFailed(JobError):
    """A step of a deploy's or a build's run failed: the run rolls back and records
    `step` and `reason` (the job's or the build's error)."""

    def __init__(self, step: str, reason: str) -> None:
        super().__init__(f"{step}: {reason}")
        self.step = step
        self.reason = reason


@dataclass
class Undo:
    what: str
    action: Callable[[], Awaitable[None]]
    timeout_s: float
    vm: bool = True  # undoes a move on the VM (False: the IPAM's record of its address)


class Fence(Protocol):
    """What a job's task asks its runner (bot/ownership/claims.Ownership) before each step."""

    @property
    def id(self) -> str:
        """The runner's id: the owner every claim of this process names."""
        ...

    clock: Callable[[], datetime]

    async def hold(self, job_id: str, epoch: int | None, after: datetime | None = None) -> float:
        """Return once the runner proves it still holds the job under `epoch` (a renewal
        begun after `after`, if given), pausing meanwhile; raise `Lost` when it does not;
        how long it paused (s)."""
        ...


@dataclass
class Run:
    job: Job
    backend: Backend
    claim: Claim  # what every write of this run names (the job's owner and epoch)
    ref: VMRef | None = None
    undo: list[Undo] = field(default_factory=list)
    address: str | None = None
    host_key: str | None = None  # the public key line the SSH check confirmed
    host_key_source: HostKeySource | None = None  # how it was confirmed
    host_certificate: str | None = None  # that key's certificate, signed by the host CA
    resumed: bool = False


async def run_undo(
    store: Store,
    timeouts: Timeouts,
    waiting: Waiting,
    job: Job,
    backend: Backend,
    stack: list[Undo],
    ref: VMRef | None,
) -> RollbackReport:
    """Run the undo stack in reverse, then check nothing of ours is left. The moves on
    the VM run even when it was not there to begin with (a clone that failed before
    creating it; one still being created is caught that way), but only a VM that was
    there is reported as rolled back."""
    report = RollbackReport()
    existed = ref is None or not any(u.vm for u in stack) or await _existed(backend, ref, timeouts)
    for undo in reversed(stack):
        await store.jobs.add_event(
            JobEvent(job_id=job.id, step="rollback", phase="undo", detail=undo.what)
        )
        seen: list[str] = []  # each undo retries retryable errors within its timeout
        try:
            async with asyncio.timeout(undo.timeout_s):
                await waiting(job, "rollback", undo.action, seen)
        except Exception as exc:  # every failure is reported, none replaces the original
            reason = exc.message if isinstance(exc, BackendError) else describe(exc)
            if isinstance(exc, TimeoutError):
                last = f" (last: {seen[-1]})" if seen else ""
                reason = f"timed out after {undo.timeout_s:g} s{last}"
            if not isinstance(exc, (BackendError, TimeoutError)):
                log.exception("job %s: undo %r failed", job.id, undo.what)
            report.failed.append(f"{undo.what}: {reason}")
            await store.jobs.add_event(
                JobEvent(
                    job_id=job.id,
                    step="rollback",
                    phase="undo_failed",
                    detail=f"{undo.what}: {reason}",
                )
            )
        else:
            if existed or not undo.vm:
                report.undone.append(undo.what)
    if ref is not None:
        try:  # a read, retried like the undo moves: one 500 must not make it "unverified"
            async with asyncio.timeout(timeouts.check_free_s):
                left = await retrying(functools.partial(backend.find_vm, ref), timeouts)
        except (BackendError, TimeoutError) as exc:
            reason = exc.message if isinstance(exc, BackendError) else describe(exc)
            report.failed.append(f"check that VM {ref.vm_id} is gone: {reason}")
            left = None
            report.wreckage.append(f"VM {ref.vm_id} (unverified)")
        if left is not None:
            report.wreckage.append(f"VM {ref.vm_id} ({left.name}) on {job.backend}")
    return report


async def _existed(backend: Backend, ref: VMRef, timeouts: Timeouts) -> bool:
    """Whether the VM was there before the rollback; unsure counts as there."""
    try:
        async with asyncio.timeout(timeouts.check_free_s):
            return await retrying(functools.partial(backend.find_vm, ref), timeouts) is not None
    except (BackendError, TimeoutError) as exc:
        reason = exc.message if isinstance(exc, BackendError) else describe(exc)
        log.info("job %s: cannot tell whether VM %s exists (%s)", ref.job_id, ref.vm_id, reason)
        return True


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if is_database_error(exc):
        return f"the database stopped answering ({type(exc).__name__}; details in the bot's log)"
    return f"internal error ({type(exc).__name__}; details in the bot's log)"
