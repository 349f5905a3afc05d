"""Many processes, one database: which process runs which job.

Every process that runs jobs is a *runner* (store/owners.py): a row with its id, host
and pid, and a claim it renews each tick. A job is run only by the runner that claimed it (one
compare-and-set that writes the owner and the claim's expiry); every later write of that
job's state names the owner it expects (`held_by`), so a runner whose claim lapsed can
no longer change a job that another took over.

`Ownership.tick` is the whole protocol, run every `ownership.tick_s`:

1. renew this runner's claim and the claims of the jobs and builds a task of this
   process runs now (named in the renewal: one transaction);
2. a job it runs locally but no longer owns is dropped without touching its VM (the new
   owner deals with it); a cancel another process asked for is carried out here;
   a job or build it holds that no local task runs (its task ended on an exception,
   say a write the database refused, without a final state) is handed back: its claim
   ends now, and it is taken over and recovered like a dead runner's, here in the same
   tick (roll back, or resume by `[recovery] interrupted`) or by another runner. One
   seen held without a task whose task did not end on an exception (a deploy recorded
   a moment ago, its task about to start) is handed back only if still so at the
   next tick;
3. (long-lived runners only) runners on this host whose process is gone are declared
   dead at once, so a restart need not wait for their claims to lapse; jobs whose
   claim has passed are taken over (another compare-and-set) and recovered;
4. (long-lived runners only) queued jobs nobody holds are claimed, as many as there is
   room for, and started here; the lease is renewed again at once, so the renewal
   lists them and their steps need not ask the store (`hold`).

A one-shot `deploybot deploy` runs only its own job: it renews, it never takes over.

Fencing, for when the database goes away (a failover, a restart, a network cut):

* every write a task makes to its job names its claim (`bot.models.Claim`: the owner
  and the job's claim epoch, one more at every claim), so a task of a claim that has
  been superseded changes nothing;
* before each step a task asks `hold`: while this runner's last renewal succeeded and
  its claim has not run out, it goes on at once; otherwise it pauses (touches no
  hypervisor) until a renewal succeeds, and then goes on only if that renewal shows the
  job still held under the same epoch; if not, `Lost`: it stops without touching the
  VM or the job (the new owner deals with both). A step already under way when the
  claim runs out runs to its end: a hypervisor task cannot be taken back half-way;
* a claim that merely ran out is taken over only by a runner that has itself renewed
  without a break for a whole `lease_s` (`watched_a_claim`): after an outage every
  runner's claims have run out together, and a live owner renews within a tick of the
  database coming back, so it keeps its work; a runner that was cut off alone is then
  the one whose jobs are taken over, after it has paused them. Claims ended on purpose
  (a runner seen dead on this host, a job handed back) and those of a runner whose row
  is gone or says it stopped are taken at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any

from bot.config.sections import OwnershipSettings
from bot.jobs.queue import JobQueue
from bot.jobs.waiting import woken
from bot.models import Job, JobState, utcnow
from bot.models.errors import JobError
from bot.models.ids import new_runner_id
from store.db import Store
from store.engine import is_database_error
from store.owners import Owned, RunnerRow

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]
# Being worked on by its owner: taken over (and recovered) once the owner's claim lapses.
WORKING = (JobState.RUNNING, JobState.ROLLING_BACK, JobState.DESTROYING)
WAKE_DEBOUNCE_S = 0.05


def host_identity() -> str:
    """Where a pid means one process: this host, this boot, this pid namespace."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip() if "boot" in path else os.readlink(path))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or
    "" where there is no /proc: with the pid, it names one process even after reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def process_alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process with that pid: cannot tell, assume alive
    return not started or process_start(pid) in ("", started)


# The recovery slots of the sweeps that recover a kind's rows kept outside `jobs` (a
# build's: bot/kinds/build/kind.py, which keeps the ids it works on itself): keys among
# `recovering` ("sweep:" and the kind's name), not jobs' ids.
SWEEP = "sweep:"


@dataclass(frozen=True)
class Ended:
    """A job this runner handed back (`Ownership.tick`): the exception its task ended
    on, or None when it had none (it ended, or never started, without a final state)."""

    error: Exception | None


@dataclass(frozen=True)
class Runner:
    id: str
    kind: str
    host: str
    pid: int

    @classmethod
    def here(cls, kind: str) -> Runner:
        return cls(new_runner_id(), kind, host_identity(), os.getpid())


class Proof(Enum):
    """What this runner can show about its claim on a job (`Ownership.proven`)."""

    HELD = "held"
    LOST = "lost"
    ABSENT = "absent"
    UNPROVEN = "unproven"


class Lost(JobError):
    """This runner no longer holds the job (another took it over while this one could
    not renew): its task stops without touching the VM or the job."""


class Ownership:
    """This process's runner: its claim on its jobs (renewed each tick), and what it
    takes over."""

    def __init__(
        self,
        store: Store,
        queue: JobQueue,
        settings: OwnershipSettings,
        runner: Runner,
        *,
        takes_over: bool,
        recover: Callable[[Job, Ended | None], Awaitable[bool]],
        sweep: Callable[[str], Coroutine[Any, Any, object] | None] = lambda _kind: None,
        local_work: Callable[[], Iterable[str]] = tuple,
        clock: Clock = utcnow,
    ) -> None:
        """`recover`: a `jobs` row taken over; `sweep`: given a kind's name, the work
        that recovers what that kind keeps outside `jobs` (bot/kinds/ `Kind.sweep`);
        `local_work`: the ids of what else runs jobs or builds here besides the queue and
        the recoveries (the destroys, the builds' recoveries), asked at each renewal."""
        self.store = store
        self.queue = queue
        self.settings = settings
        self.runner = runner
        self.takes_over = takes_over
        self._recover = recover
        self._sweep = sweep
        self.clock = clock
        self.recovering: dict[str, asyncio.Task[None]] = {}
        self._local_work = local_work
        self._unrun: set[str] = set()  # held, no local task, at the last tick
        # Fencing (see the module's docstring). Until when the last renewal proves this
        # runner's claims (None: none succeeded yet, or the last one failed); the jobs
        # that renewal found held, with their claim epochs; since when renewals have
        # succeeded without a break; each successful renewal sets (and replaces) the event.
        self.proven_until: datetime | None = None
        self.renewed_at: datetime | None = None
        self.held: dict[str, int] = {}
        self.watching_since: datetime | None = None
        self._renewed_mono: float | None = None  # loop time the last renewal began
        self._renewed = asyncio.Event()
        self.paused: set[str] = set()  # jobs waiting in `hold` now (tests, operators' log)
        self.on_pause = asyncio.Event()  # set when a job pauses (tests wait for it)
        self.closing = False
        self._loop: asyncio.Task[None] | None = None
        # A finished job frees a slot: look for queued work soon, not at the next tick
        # (the loop debounces: fifty jobs ending together make one extra look, not fifty).
        self._wake = asyncio.Event()
        queue.on_room = self._wake.set

    @property
    def id(self) -> str:
        return self.runner.id

    def claim_until(self, now: datetime | None = None) -> datetime:
        return (now or self.clock()) + timedelta(seconds=self.settings.lease_s)

    async def start(self) -> None:
        """Register, act once (so a restarted shell recovers before it reads input),
        then keep acting every `tick_s`."""
        now = self.clock()
        r = self.runner
        await self.store.runners.register(
            RunnerRow(r.id, r.kind, r.host, r.pid, process_start(r.pid), now, self.claim_until(now))
        )
        log.info("runner %s (%s, pid %d) started", r.id, r.kind, r.pid)
        await self.tick()
        self._loop = asyncio.create_task(self._every_tick(), name=f"runner-{r.id}")

    async def _every_tick(self) -> None:
        loop = asyncio.get_running_loop()
        renewed_at = loop.time()
        failing = False
        while True:
            nudged = await woken(self._wake, self.settings.tick_s)
            await asyncio.sleep(WAKE_DEBOUNCE_S if nudged else 0)  # pacing, not sync
            self._wake.clear()
            try:
                if nudged and loop.time() - renewed_at < self.settings.tick_s:
                    await self.claim_queued()  # a slot freed: only look for work
                    continue
                renewed_at = loop.time()
                await self.tick()
                if failing:
                    log.warning("runner %s: renewing again", self.id)
                failing = False
            except Exception as exc:
                if not is_database_error(exc):
                    log.exception("runner %s: a tick failed; trying again", self.id)
                elif not failing:  # once per outage, not every tick_s while it lasts
                    log.warning("runner %s: cannot renew (%s); jobs pause", self.id, exc)
                    failing = True

    def local_ids(self) -> set[str]:
        """The jobs and builds a task of this process runs (or will, queued here) now."""
        recovering = (key for key in self.recovering if not key.startswith(SWEEP))  # ids only
        return {
            *self.queue.running_ids(),
            *self.queue.waiting_ids(),
            *recovering,
            *self._local_work(),
        }

    async def tick(self) -> None:
        now = self.clock()
        local = self.local_ids()
        held = await self._renew(now, local)
        owned = {o.job_id: o for o in held}
        await self._drop_lost(set(owned))
        for held_job in held:
            if held_job.cancel_requested and self.queue.is_running(held_job.job_id):
                log.info("job %s: cancel asked by %s", held_job.job_id, held_job.cancel_requested)
                self.queue.cancel(held_job.job_id)
        ended = await self._hand_back_unrun({o.job_id for o in held if not o.local})
        if self.takes_over and not self.closing:
            await self._reap_dead_neighbours(now)
            await self._take_over(now, ended)
            await self._claim_queued(now)
            # Rows handed back that are not `jobs` rows (a build's): their kind's sweep
            # recovers them now rather than at the next sweep.
            for kind in sorted({o.kind for o in held if o.job_id in ended}):
                work = self._sweep(kind)
                if work is not None:
                    self._start_recovery(SWEEP + kind, work)

    async def _renew(self, now: datetime, local: set[str]) -> list[Owned]:
        """Renew, and record what the renewal proves (see `hold`)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            held = await self.store.runners.renew_claims(
                self.id, now, self.claim_until(now), local, self._unrun
            )
        except Exception:
            self.proven_until = self.watching_since = None
            raise
        gap = began - self._renewed_mono if self._renewed_mono is not None else 0.0
        if loop.time() - began > self.settings.tick_s or gap > 3 * self.settings.tick_s:
            # As slow as a tick, or long since the last renewal (this process stalled,
            # or a tick hung on another call): a live owner elsewhere may have missed
            # its renewals meanwhile unseen, so this runner has not watched the
            # database without a break.
            self.watching_since = None
        self._renewed_mono = began
        self.proven_until, self.renewed_at = self.claim_until(now), now
        self.held = {o.job_id: o.epoch for o in held}
        if self.watching_since is None:
            self.watching_since = self.clock()
        self._renewed.set()
        self._renewed = asyncio.Event()
        return held

    def watched_a_claim(self, now: datetime) -> bool:
        """Whether this runner has renewed without a break for a whole claim length
        (`lease_s`): only then may it judge another runner's lapsed claim to mean that
        runner is gone."""
        since = self.watching_since
        return since is not None and now - since >= timedelta(seconds=self.settings.lease_s)

    def proven(self, job_id: str, epoch: int | None, after: datetime | None = None) -> Proof:
        """What the last renewal (one begun after `after`, if given) proves about this
        runner's claim on the job: HELD (its claim has at least a tick left and the
        renewal found the job under `epoch`), LOST (found under a later epoch: claimed
        again since), ABSENT (its claim holds, but the renewal did not list the job, or
        listed an earlier claim: claimed since, or taken over; `hold` asks the store
        which) or UNPROVEN (no renewal, or its claim has run out or is about to)."""
        now, until, at = self.clock(), self.proven_until, self.renewed_at
        margin = timedelta(seconds=self.settings.tick_s)  # a tick's room for the step
        if until is None or at is None or now >= until - margin:
            return Proof.UNPROVEN
        if after is not None and at <= after:
            return Proof.UNPROVEN
        found = self.held.get(job_id)
        if found is None or (epoch is not None and found < epoch):
            # Not listed, or listed under an older claim of this runner's (a deploy it
            # ran, destroyed now under a new claim): the renewal predates the claim.
            return Proof.ABSENT
        return Proof.HELD if epoch is None or found == epoch else Proof.LOST

    async def _still_mine(self, job_id: str, epoch: int | None) -> Proof:
        """Ask the store about a job the last renewal did not list: HELD or LOST, or
        UNPROVEN when the store does not answer."""
        try:
            claim = await self.store.runners.claim_of(job_id)  # two columns, not the whole job
        except Exception as exc:
            if not is_database_error(exc):
                raise
            return Proof.UNPROVEN
        if claim is None or claim[0] != self.id:
            return Proof.LOST
        return Proof.HELD if epoch is None or claim[1] == epoch else Proof.LOST

    async def _proof(self, job_id: str, epoch: int | None, after: datetime | None) -> Proof:
        proof = self.proven(job_id, epoch, after)
        return await self._still_mine(job_id, epoch) if proof is Proof.ABSENT else proof

    async def hold(self, job_id: str, epoch: int | None, after: datetime | None = None) -> float:
        """Return once this runner can prove it holds the job under `epoch` (before a
        step, or before writing again after the database did not answer: `after`, when
        that was); meanwhile pause: touch nothing. Raises `Lost` once it is another
        claim's. Returns how long it paused (s)."""
        proof = await self._proof(job_id, epoch, after)
        if proof is Proof.HELD:
            return 0.0
        loop = asyncio.get_running_loop()
        began = loop.time()
        if proof is Proof.UNPROVEN:
            log.warning(
                "job %s: paused: this runner cannot prove it still holds the job (its claim "
                "is not renewed: the database is not answering)",
                job_id,
            )
        self.paused.add(job_id)
        self.on_pause.set()
        try:
            while proof is Proof.UNPROVEN:
                await self._renewed.wait()
                proof = await self._proof(job_id, epoch, after)
        finally:
            self.paused.discard(job_id)
        if proof is Proof.LOST:
            log.warning("job %s: another runner holds it now; this runner stops", job_id)
            raise Lost(job_id)
        paused_s = loop.time() - began
        log.warning("job %s: held again after a pause of %.1f s; going on", job_id, paused_s)
        return paused_s

    async def _hand_back_unrun(self, unrun: set[str]) -> dict[str, Ended]:
        """Hand back what this runner holds and no local task runs (see the module's
        docstring); what was handed back, with the exception its task ended on."""
        unrun -= self.local_ids()  # again: a task started during the renewal counts
        crashed = self.queue.crashed
        sure = {i for i in unrun if i in self._unrun or i in crashed}
        self._unrun = unrun - sure
        ended = {i: Ended(crashed.pop(i, None)) for i in sure}
        for stale in set(crashed) - unrun:  # ended on an exception after a final state
            crashed.pop(stale)
        if not sure:
            return ended
        for job_id, end in ended.items():
            exc = end.error
            why = f"its task ended on {type(exc).__name__}" if exc else "no task runs it"
            log.warning("job %s: held by this runner but %s; handing it back", job_id, why)
        await self.store.runners.hand_back(self.id, sure)
        return ended

    async def _drop_lost(self, owned: set[str]) -> None:
        """Stop local work on jobs another runner now owns (our claim had lapsed)."""
        for job_id in self.queue.running_ids():
            if job_id in owned:
                continue
            job = await self.store.jobs.get(job_id)
            if job is not None and job.state in WORKING and job.owner != self.id:
                log.warning("job %s: taken over by runner %s; stopping here", job_id, job.owner)
                self.queue.cancel(job_id)  # its rollback is fenced: it cannot touch the VM

    async def _reap_dead_neighbours(self, now: datetime) -> None:
        for runner_id, pid, started in await self.store.runners.live_on_host(self.runner.host):
            if runner_id != self.id and not process_alive(pid, started):
                log.info("runner %s (pid %d) is gone; its jobs are free now", runner_id, pid)
                await self.store.runners.declare_dead(runner_id, now)

    async def _take_over(self, now: datetime, ended: Mapping[str, Ended]) -> None:
        """Recover the jobs whose claim passed; `ended`: those this runner just handed
        back, with the exception their task ended on (it says why in the job)."""
        local, found = self.local_ids(), await self.store.runners.abandoned(now)
        alive: set[str] = set()  # owners that may be alive, paused by an outage
        if not self.watched_a_claim(now):
            lapsed = {j.owner for j in found if j.lease_until is not None and j.owner}
            alive = await self.store.runners.registered(lapsed) if lapsed else set()
        for job in found:
            if job.id in local or job.owner in alive:
                continue
            epoch = await self.store.runners.claim(
                job.id, self.id, now, self.claim_until(now), WORKING
            )
            if epoch is None:
                continue  # another runner took it first
            log.info("job %s: taking over from runner %s", job.id, job.owner)
            job = job.model_copy(update={"owner": self.id, "claim_epoch": epoch})
            self._start_recovery(job.id, self._recovered(job, ended.get(job.id)))

    def _start_recovery(self, key: str, work: Coroutine[Any, Any, object]) -> None:
        if key in self.recovering:
            work.close()
            return
        task = asyncio.create_task(self._guarded(key, work), name=f"recover-{key}")
        self.recovering[key] = task

    async def _guarded(self, key: str, work: Coroutine[Any, Any, object]) -> None:
        try:
            await work
        except Exception:
            log.exception("recovering %s failed; it is retried once its claim lapses", key)
        finally:
            self.recovering.pop(key, None)

    async def _recovered(self, job: Job, ended: Ended | None) -> None:
        if await self._recover(job, ended):  # True: put back in the queue to resume
            self.queue.submit(job.id, job.backend)

    async def _claim_queued(self, now: datetime) -> int:
        room = self.queue.room()
        if room <= 0:
            return 0
        claimed = await self.store.runners.claim_queued(self.id, now, self.claim_until(now), room)
        for job_id, backend in claimed:
            self.queue.submit(job_id, backend)
        if claimed:
            # Renewed again now, so the renewal lists them: else each step of each of them
            # asks the store (`hold`: ABSENT) until the next tick's renewal.
            await self._renew(self.clock(), self.local_ids())
        return len(claimed)

    async def claim_queued(self) -> int:
        """Claim what queued work there is room for now; how many jobs were claimed."""
        if not self.takes_over or self.closing:
            return 0
        return await self._claim_queued(self.clock())

    async def take(self, job: Job) -> bool:
        """Claim a queued job this process just made runnable (approved it) and start it
        here; False when another runner was faster."""
        now = self.clock()
        if await self.store.runners.claim(job.id, self.id, now, self.claim_until(now)) is None:
            return False
        self.queue.submit(job.id, job.backend)
        return True

    async def settle(self) -> None:
        """Wait for the recoveries started so far (tests, shutdown)."""
        while self.recovering:
            await asyncio.gather(*list(self.recovering.values()), return_exceptions=True)

    async def close(self, within_s: float | None = None) -> None:
        """Hand queued jobs back and say this runner stopped. Called once the queue has
        shut down; the caller keeps renewing (`closing`) until then. Recoveries still
        going after `within_s` are left: their jobs' claims lapse and another runner
        takes them over, as it would from a process that died."""
        try:  # still renewing: a recovery under way stays this runner's while it runs
            async with asyncio.timeout(within_s):
                await self.settle()
        except TimeoutError:
            left = len(self.recovering)
            log.warning("runner %s: leaving %d recoveries unfinished", self.id, left)
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        handed = await self.store.runners.release(self.id, self.clock())
        if handed:
            log.info("runner %s: handed %d queued job(s) back", self.id, handed)
