"""How a pipeline step runs and is recorded (split from bot/pipeline.py): its events and
notices, its timeout, the retries of a hypervisor that does not answer (said once in the
thread, and once more when it is back), every failure mapped to `StepFailed`."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TypeVar

from backends.base import BackendError, Unreachable
from bot import logfields
from bot import progress as tell
from bot.addressing import Addressing
from bot.models import Job, JobEvent, utcnow
from bot.models.notices import Notice
from bot.ownership import Lost
from bot.progress import Progress
from bot.runs import Fence, Run, StepFailed
from bot.settings import Timeouts
from bot.waiting import retrying
from store.db import Store
from store.retry import Unavailable

log = logging.getLogger("bot.pipeline")
T = TypeVar("T")

# Steps whose retryable answer means "not yet" rather than "something went wrong": a
# refused SSH port right after the agent answered is sshd still starting.
_POLLED_STEPS = frozenset({"ssh"})


class Steps:
    """Mixed into `Pipeline`: the attributes below are the pipeline's."""

    store: Store
    progress: Progress
    timeouts: Timeouts
    addressing: Addressing
    fence: Fence

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
        await self._event(run, started, tell.step_started(job.id, step, detail))
        await self.progress.step_started(job, step, detail)
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            result = await self._call(run, step, timeout_s, action)
        except StepFailed as failure:
            elapsed = loop.time() - began
            # The operator's record; the person is told through the thread.
            log.warning("job %s: %s failed after %.1f s: %s", job.id, step, elapsed, failure.reason)
            event = JobEvent(
                job_id=job.id, step=step, phase="failed", duration_s=elapsed, detail=failure.reason
            )
            told = tell.step_finished(job.id, step, elapsed, False, failure.reason)
            await self._event(run, event, told)
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
        await self._event(run, event, tell.step_finished(job.id, step, elapsed, True, done))
        await self.progress.step_finished(job, step, elapsed, True, done)

    async def _event(self, run: Run, event: JobEvent, notice: Notice) -> None:
        """Record one of the run's events (and its notice, if anyone follows the job),
        only under the run's claim: `Lost` when another claim holds the job now."""
        told = self._told(run.job, notice)
        write = functools.partial(self.store.add_event, event, told, run.claim)
        if not await self._recorded(run, write):
            raise Lost(run.job.id)

    async def _run_note(self, run: Run, step: str, text: str) -> None:
        """A note in the run's thread and history, written as its events are."""
        event = JobEvent(job_id=run.job.id, step=step, phase="note", detail=text)
        await self._event(run, event, tell.noted(run.job.id, text))
        await self.progress.job_note(run.job, text)

    async def _recorded(self, run: Run, write: Callable[[], Awaitable[T]]) -> T:
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

    async def _call(
        self, run: Run, step: str, timeout_s: float, action: Callable[[], Awaitable[T]]
    ) -> T:
        """Run one action under the step's timeout, mapping every failure to StepFailed."""
        seen: list[str] = []
        try:
            async with asyncio.timeout(timeout_s):
                return await self._waiting_for_backend(run.job, step, action, seen)
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

    async def _waiting_for_backend(
        self, job: Job, step: str, action: Callable[[], Awaitable[T]], seen: list[str]
    ) -> T:
        """Retry, telling the thread once when the hypervisor stops answering and once
        when it is back, instead of failing the job at the first refused connection."""
        since: list[datetime] = []

        async def on_retry(exc: BackendError) -> None:
            if isinstance(exc, Unreachable) and not since:
                since.append(utcnow())
                await self._note(
                    job,
                    step,
                    f"waiting for {who} (unreachable since {since[0]:%H:%M:%S} UTC: {exc.message})",
                )

        polling = step in _POLLED_STEPS
        who = self.addressing.ipam_name if step == "register" else job.backend
        result = await retrying(action, self.timeouts, seen, on_retry, polling=polling)
        if since:
            await self._note(job, step, f"{who} answers again; carrying on.")
        return result

    async def _note(self, job: Job, step: str, text: str) -> None:
        """A note from a wait (a hypervisor that does not answer, also in a rollback):
        told, and kept when the database takes it; one it does not is only logged (it
        changes nothing the job's state depends on)."""
        try:
            await self.store.add_event(
                JobEvent(job_id=job.id, step=step, phase="note", detail=text),
                self._told(job, tell.noted(job.id, text)),
            )
        except Unavailable as exc:
            log.warning("job %s: note not recorded (%s): %s", job.id, exc, text)
        await self.progress.job_note(job, text)

    @staticmethod
    def _told(job: Job, notice: Notice) -> Notice | None:
        """The notice, if anyone follows this job in chat; a job asked for in the shell
        or the CLI (no origin, no approval) needs none, so none is written."""
        return notice if tell.followed(job) else None

    @staticmethod
    def _tell(job: Job, notice: Notice) -> list[Notice]:
        return [notice] if tell.followed(job) else []

    async def _skip(self, run: Run, step: str, why: str) -> None:
        event = JobEvent(job_id=run.job.id, step=step, phase="skipped", detail=why)
        write = functools.partial(self.store.add_event, event, None, run.claim)
        if not await self._recorded(run, write):
            raise Lost(run.job.id)
