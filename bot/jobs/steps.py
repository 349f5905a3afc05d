"""A job's steps declared as data, and the engine that runs them.

A `Step` says once what a step is (the arq `Function` idea): its name, its action, the
`[timeouts]` setting it runs under, the undo it pushes and when, whether it applies to
a job, whether a retryable answer means "not yet", and what a restart may do after it.
`Engine` runs a list of them the same way for every step: the fence's `hold` before it,
its events and notices (started, finished, failed, skipped), its timeout, the retries
of a hypervisor that does not answer (said once in the thread, and once more when it
is back), every failure mapped to `StepFailed`, and every write of the job's progress
made again when the database did not take it (`recorded`). Where a job interrupted by
a restart carries on is read from the records too (`resume_point`).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Awaitable, Callable, Container, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from backends.base import Unreachable
from bot.config.sections import Timeouts
from bot.jobs import logfields
from bot.jobs import progress as tell
from bot.jobs.progress import Progress
from bot.jobs.waiting import retrying
from bot.kinds.deploy.runs import Fence, Run, StepFailed, Undo
from bot.models import Job, JobEvent, utcnow
from bot.models.errors import BackendError
from bot.models.notices import Notice
from bot.ownership.claims import Lost
from store.db import Store
from store.retry import Unavailable

log = logging.getLogger("bot.kinds.deploy.pipeline")
T = TypeVar("T")
C = TypeVar("C")  # what the steps' functions are given first: the kind's service


class UndoFrom(enum.Enum):
    """When a step's undo is pushed on the run's undo stack."""

    START = "start"  # at the run's start: what it undoes exists before (an IPAM reservation)
    CALL = "call"  # before the step's call: a call that dies after the hypervisor acted
    ACTION = "action"  # by the action, once what it undoes has an id (the write-ahead)


@dataclass(frozen=True)
class Step(Generic[C]):
    """One step of a job. Every function is given the kind's service (`C`) and the run."""

    name: str  # as events, notices, metrics and the thread name it
    action: Callable[[C, Run], Awaitable[str | None]]  # what it did, shown when it ends
    timeout: str  # the `[timeouts]` setting it runs under, e.g. "clone_s"
    # Shown when it starts; a function is asked before the started event (it may ask
    # the backend: through `Engine.call`, under the step's name).
    detail: str | Callable[[C, Run], Awaitable[str]] = ""
    # None from it: nothing to undo for this run (the backend has no such move).
    undo: Callable[[C, Run], Undo | None] | None = None
    undo_from: UndoFrom = UndoFrom.CALL
    when: Callable[[Job], bool] | None = None  # whether it applies to the job
    skipped: str | None = None  # why, recorded when `when` says no (None: no trace at all)
    # Asked just before it would start, when whether it applies depends on what the run
    # found (the SSH check's key): why not, recorded as its skip; None: it runs.
    skip: Callable[[C, Run], str | None] | None = None
    polled: bool = False  # a retryable answer means "not yet" (sshd still starting)
    # A job interrupted after this step finished may carry on after a restart: every
    # later step is safe to run again.
    resumable: bool = False
    # What it finds lives only in the run's memory: a resumed job runs it again.
    read_again: bool = False
    waits_for: Callable[[C, Job], str] | None = None  # who it asks (default: the backend)

    def __post_init__(self) -> None:
        if self.timeout not in Timeouts.model_fields:
            raise ValueError(f"step {self.name}: no [timeouts] setting {self.timeout}")


def resume_point(steps: Sequence[Step[C]], events: list[JobEvent]) -> int | None:
    """Where a job interrupted by a restart can carry on (an index into `steps`), or None
    when only a rollback is safe."""
    index = {step.name: i for i, step in enumerate(steps)}
    done = [index[e.step] for e in events if e.step in index and e.phase in ("finished", "skipped")]
    if not done or not steps[max(done)].resumable:
        return None
    last = max(done)
    again = [i for i in range(last + 1) if steps[i].read_again]
    return min([last + 1, *again])


class Engine(Generic[C]):
    """Runs one kind's steps for its runs; `service` is what the steps' functions get."""

    def __init__(
        self,
        service: C,
        steps: Sequence[Step[C]],
        store: Store,
        progress: Progress,
        timeouts: Timeouts,
        fence: Fence,
    ) -> None:
        self.service = service
        self.steps = tuple(steps)
        self.store = store
        self.progress = progress
        self.timeouts = timeouts
        self.fence = fence
        self._by_name = {step.name: step for step in self.steps}

    async def run(self, run: Run, first: int = 0) -> None:
        """Run the steps from index `first` (0, or later when resuming after a restart),
        each once the runner proves it still holds the job."""
        for step in self.steps[first:]:
            paused_s = await self.fence.hold(run.job.id, run.claim.epoch)
            if paused_s:
                why = "the database did not answer, so the bot could not prove the job"
                text = f"paused {paused_s:.1f} s before {step.name}: {why} was still its own; it is"
                await self.run_note(run, step.name, text)
            await self._run_step(run, step)

    async def _run_step(self, run: Run, step: Step[C]) -> None:
        if step.when is not None and not step.when(run.job):
            if step.skipped is not None:
                event = JobEvent(
                    job_id=run.job.id, step=step.name, phase="skipped", detail=step.skipped
                )
                await self.event(run, event, None)
            return
        reason = step.skip(self.service, run) if step.skip is not None else None
        if reason is not None:
            event = JobEvent(job_id=run.job.id, step=step.name, phase="skipped", detail=reason)
            await self.event(run, event, None)
            return
        if step.undo is not None and step.undo_from is UndoFrom.CALL:
            _push(run, step.undo(self.service, run))
        shown = step.detail
        detail = shown if isinstance(shown, str) else await shown(self.service, run)
        timeout_s: float = getattr(self.timeouts, step.timeout)
        action = functools.partial(step.action, self.service, run)
        await self._step(run, step.name, timeout_s, action, detail)

    def arm(self, run: Run) -> None:
        """Push the undo of every step that applies to the job whose undo counts from the
        run's start (the first pushed, so the last run)."""
        for step in self.steps:
            if step.undo is None or step.undo_from is not UndoFrom.START:
                continue
            if step.when is None or step.when(run.job):
                _push(run, step.undo(self.service, run))

    def rearm(self, run: Run, began: Container[str], before: int | None = None) -> None:
        """Push again, in order, the undo of each step (before index `before`) that
        `began`: what a job resumed after a restart, or recovered, had on its stack."""
        for step in self.steps[:before]:
            if step.undo is None or step.undo_from is UndoFrom.START:
                continue
            if step.name in began:
                _push(run, step.undo(self.service, run))

    def resume_point(self, events: list[JobEvent]) -> int | None:
        return resume_point(self.steps, events)

    async def _step(
        self,
        run: Run,
        step: str,
        timeout_s: float,
        action: Callable[[], Awaitable[object]],
        detail: str = "",
    ) -> None:
        job = run.job
        logfields.bind(step=step)
        started = JobEvent(job_id=job.id, step=step, phase="started", detail=detail)
        await self.event(run, started, tell.step_started(job.id, step, detail))
        await self.progress.step_started(job, step, detail)
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            result = await self.call(run, step, timeout_s, action)
        except StepFailed as failure:
            elapsed = loop.time() - began
            # The operator's record; the person is told through the thread.
            log.warning("job %s: %s failed after %.1f s: %s", job.id, step, elapsed, failure.reason)
            event = JobEvent(
                job_id=job.id, step=step, phase="failed", duration_s=elapsed, detail=failure.reason
            )
            told = tell.step_finished(job.id, step, elapsed, False, failure.reason)
            await self.event(run, event, told)
            await self.progress.step_finished(job, step, elapsed, False, failure.reason)
            raise
        elapsed = loop.time() - began
        done = result if isinstance(result, str) else ""
        log.info(
            "job %s: %s finished in %.1f s%s", job.id, step, elapsed, f": {done}" if done else ""
        )
        # Awaited before the line is shown: recovery reads these events to know which
        # steps are done (a resumed job must not redo or lose a finished clone).
        event = JobEvent(
            job_id=job.id, step=step, phase="finished", duration_s=elapsed, detail=done
        )
        await self.event(run, event, tell.step_finished(job.id, step, elapsed, True, done))
        await self.progress.step_finished(job, step, elapsed, True, done)

    async def event(self, run: Run, event: JobEvent, notice: Notice | None) -> None:
        """Record one of the run's events (and its notice, if anyone follows the job),
        only under the run's claim: `Lost` when another claim holds the job now (its
        late event must not land in the new owner's history and thread)."""
        told = notice_for(run.job, notice) if notice is not None else None
        write = functools.partial(self.store.jobs.add_event, event, told, run.claim)
        if not await self.recorded(run, write):
            raise Lost(run.job.id)

    async def run_note(self, run: Run, step: str, text: str) -> None:
        """A note in the run's thread and history, written as its events are."""
        event = JobEvent(job_id=run.job.id, step=step, phase="note", detail=text)
        await self.event(run, event, tell.noted(run.job.id, text))
        await self.progress.job_note(run.job, text)

    async def recorded(self, run: Run, write: Callable[[], Awaitable[T]]) -> T:
        """A write of this run's progress. When the database does not take it within
        `[store] write_retry_s`, wait as at a step boundary (paused, touching nothing)
        until the runner proves it still holds the job, then write it again: an outage
        of any length costs the job nothing; `Lost` if the job was taken over."""
        while True:
            failed_at = self.fence.clock()
            try:
                return await write()
            except Unavailable as exc:
                log.warning(
                    "job %s: not recorded yet (%s); waiting for the database", run.job.id, exc
                )
                await self.fence.hold(run.job.id, run.claim.epoch, after=failed_at)

    async def call(
        self, run: Run, step: str, timeout_s: float, action: Callable[[], Awaitable[T]]
    ) -> T:
        """Run one action under the step's timeout, mapping every failure to StepFailed."""
        seen: list[str] = []
        try:
            async with asyncio.timeout(timeout_s):
                return await self.waiting(run.job, step, action, seen)
        except StepFailed:
            raise
        except TimeoutError:
            last = f" (last: {seen[-1]})" if seen else ""
            raise StepFailed(step, f"timed out after {timeout_s:g} s{last}") from None
        except BackendError as exc:
            raise StepFailed(step, exc.message) from None
        except (asyncio.CancelledError, Lost):
            raise
        except Exception:
            log.exception("job %s: unexpected error in step %s", run.job.id, step)
            raise StepFailed(step, "internal error (the details are in the bot's log)") from None

    async def waiting(
        self, job: Job, step: str, action: Callable[[], Awaitable[T]], seen: list[str]
    ) -> T:
        """Retry, telling the thread once when the hypervisor stops answering and once
        when it is back, instead of failing the job at the first refused connection.
        `step` may name no step of the list (the rollback's undo moves)."""
        since: list[datetime] = []

        async def on_retry(exc: BackendError) -> None:
            if isinstance(exc, Unreachable) and not since:
                since.append(utcnow())
                await self.note(
                    job,
                    step,
                    f"waiting for {who} (unreachable since {since[0]:%H:%M:%S} UTC: {exc.message})",
                )

        record = self._by_name.get(step)
        polling = record is not None and record.polled
        asks = record.waits_for if record is not None else None
        who = asks(self.service, job) if asks is not None else job.backend
        result = await retrying(action, self.timeouts, seen, on_retry, polling=polling)
        if since:
            await self.note(job, step, f"{who} answers again; carrying on.")
        return result

    async def note(self, job: Job, step: str, text: str) -> None:
        """A note from a wait (a hypervisor that does not answer, also in a rollback):
        told, and kept when the database takes it; one it does not is only logged (it
        changes nothing the job's state depends on)."""
        try:
            await self.store.jobs.add_event(
                JobEvent(job_id=job.id, step=step, phase="note", detail=text),
                notice_for(job, tell.noted(job.id, text)),
            )
        except Unavailable as exc:
            log.warning("job %s: note not recorded (%s): %s", job.id, exc, text)
        await self.progress.job_note(job, text)


def _push(run: Run, undo: Undo | None) -> None:
    if undo is not None:
        run.undo.append(undo)


def notice_for(job: Job, notice: Notice) -> Notice | None:
    """The notice, if anyone follows this job in chat; a job asked for in the shell or
    the CLI (no origin, no approval) needs none, so none is written."""
    return notice if tell.followed(job) else None


def notices_for(job: Job, notice: Notice) -> list[Notice]:
    return [notice] if tell.followed(job) else []
