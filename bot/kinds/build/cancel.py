"""Cancelling a template build, as a deploy is cancelled (bot/jobs/cancel.py): before it
starts, one compare-and-set (awaiting approval or queued -> cancelled, so nobody can
approve it afterwards); while this process runs it, the queue cancels its task, whose
rollback removes what it made; while another process does, asked through the store
(`builds.cancel_requested`), which that process acts on at its next tick."""

from __future__ import annotations

from bot.jobs.queue import JobQueue
from bot.kinds.build.parts import build_notice
from bot.models import utcnow
from bot.models.builds import Build, BuildState
from bot.models.errors import NotAllowed, TransitionRefused
from bot.models.notices import BUILD_FINISHED
from store.db import Store


async def cancel_build(
    store: Store, queue: JobQueue, build: Build, user: str, approver: bool
) -> Build:
    """Cancel `build` for `user` (`approver`: whether they approve builds)."""
    if user != build.requester and not approver:
        raise NotAllowed(
            f"Only {build.requester} or an approver can cancel build {build.id}.",
            people=(build.requester,),
        )
    unstarted = [BuildState.AWAITING_APPROVAL, BuildState.QUEUED]
    if build.state in unstarted:
        moved = await store.builds.move(
            build.id,
            [build.state],
            BuildState.CANCELLED,
            None,
            [build_notice(build.id, BUILD_FINISHED)],
            finished_at=utcnow(),
            error=f"cancelled by {user}",
        )
        if moved is not None:
            queue.cancel(build.id)
            return moved
        build = await store.builds.get(build.id) or build  # it moved on meanwhile
    working = build.state in (BuildState.RUNNING, BuildState.ROLLING_BACK)
    # Here: the queue cancels its task. Elsewhere: its runner reads the ask at its tick.
    if working and (queue.cancel(build.id) or await store.builds.request_cancel(build.id, user)):
        return build
    raise TransitionRefused(
        f"Build {build.short_id} is {build.state.value}: there is nothing to cancel."
    )
