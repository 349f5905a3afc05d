"""Cancelling a template build, as a deploy is cancelled (bot/cancel.py): before it
starts, one compare-and-set (awaiting approval or queued -> cancelled, so nobody can
approve it afterwards); while this process runs it, the queue cancels its task, whose
rollback removes what it made; while another process does, asked through the store
(`builds.cancel_requested`), which that process acts on at its next tick."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bot.errors import NotAllowed, TransitionRefused
from bot.models import BUILD_FINISHED, utcnow
from bot.models.builds import Build, BuildState

if TYPE_CHECKING:
    from bot.builds.service import Builds


async def cancel_build(builds: Builds, build_id: str, user: str, approver: bool) -> Build:
    from bot.builds.runner import build_notice  # the runner's notices, one definition

    build = await builds.get(build_id)
    if user != build.requester and not approver:
        raise NotAllowed(
            f"Only {build.requester} or an approver can cancel build {build.id}.",
            people=(build.requester,),
        )
    unstarted = [BuildState.AWAITING_APPROVAL, BuildState.QUEUED]
    if build.state in unstarted:
        moved = await builds.store.builds.move(
            build.id,
            [build.state],
            BuildState.CANCELLED,
            None,
            [build_notice(build.id, BUILD_FINISHED)],
            finished_at=utcnow(),
            error=f"cancelled by {user}",
        )
        if moved is not None:
            builds.queue.cancel(build.id)
            return moved
        build = await builds.get(build.id)
    working = build.state in (BuildState.RUNNING, BuildState.ROLLING_BACK)
    # Here: the queue cancels its task. Elsewhere: its runner reads the ask at its tick.
    if working and (
        builds.queue.cancel(build.id) or await builds.store.builds.request_cancel(build.id, user)
    ):
        return build
    raise TransitionRefused(
        f"Build {build.short_id} is {build.state.value}: there is nothing to cancel."
    )
