"""How the core tells front ends what a job is doing.

The pipeline and the service call a `Progress`; a front end implements it (the terminal
thread in handlers/terminal.py, Slack threads later). A front end that fails must never
fail a deploy, so every call goes through `Fanout`, which logs and carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from bot.models import Job, RollbackReport
from bot.models.notices import Notice, NoticeKind

log = logging.getLogger(__name__)


class Progress(Protocol):
    async def job_updated(self, job: Job, note: str = "") -> None:
        """The job was created or changed state (queued, approved, rejected, running...)."""
        ...

    async def step_started(self, job: Job, step: str, detail: str) -> None: ...

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None: ...

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        """The job reached a final state after running (succeeded, failed, cancelled)."""
        ...

    async def job_note(self, job: Job, text: str) -> None:
        """A remark on a job between steps: waiting for an unreachable hypervisor, it is
        back, leftover wreckage finally removed."""
        ...


class Fanout:
    """Sends every update to each listener; a listener's exception is logged, not raised."""

    def __init__(self, *listeners: Progress) -> None:
        self.listeners = list(listeners)

    async def _each(self, what: str, call: Callable[[Progress], Awaitable[None]]) -> None:
        for listener in self.listeners:
            try:
                await call(listener)
            except Exception:
                log.exception("progress listener %r failed on %s", listener, what)

    async def job_updated(self, job: Job, note: str = "") -> None:
        await self._each("job_updated", lambda p: p.job_updated(job, note))

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        await self._each("step_started", lambda p: p.step_started(job, step, detail))

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        await self._each(
            "step_finished", lambda p: p.step_finished(job, step, duration_s, ok, detail)
        )

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        await self._each("job_finished", lambda p: p.job_finished(job, rollback))

    async def job_note(self, job: Job, text: str) -> None:
        await self._each("job_note", lambda p: p.job_note(job, text))


# --- notices: the same news, kept in the store for the chat front ends ------------------
# Each is written in the transaction of the change it reports (bot.models.Notice).


def followed(job: Job) -> bool:
    """Whether anyone follows this job in chat: asked for in a channel (an origin) or
    waiting for approvers (a card). Only such jobs get notices (store/outbox.py)."""
    return job.origin is not None or job.approval_reason is not None


def updated(job_id: str, note: str = "", by: str | None = None) -> Notice:
    """`by`: the person `note` names as who acted (the note names them before anything
    typed, such as a reason)."""
    return Notice(job_id=job_id, kind=NoticeKind.UPDATED, text=note, by=by)


def step_started(job_id: str, step: str, detail: str) -> Notice:
    return Notice(job_id=job_id, kind=NoticeKind.STEP_STARTED, step=step, text=detail)


def step_finished(job_id: str, step: str, duration_s: float, ok: bool, detail: str) -> Notice:
    return Notice(
        job_id=job_id,
        kind=NoticeKind.STEP_FINISHED,
        step=step,
        duration_s=duration_s,
        ok=ok,
        text=detail,
    )


def noted(job_id: str, text: str) -> Notice:
    return Notice(job_id=job_id, kind=NoticeKind.NOTE, text=text)


def finished(job_id: str, rollback: RollbackReport | None) -> Notice:
    return Notice(job_id=job_id, kind=NoticeKind.FINISHED, rollback=rollback)
