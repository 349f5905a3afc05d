"""Cancelling a job: before it starts (one compare-and-set, its approval closed with
it), while this process runs it (the queue cancels its task, which rolls back), or while
another process does (asked through the store; that process acts at its next tick).
`Deployer.cancel` (bot/service.py) calls it inside its audit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bot import progress as tell
from bot.errors import NotAllowed, TransitionRefused
from bot.models import Job, JobState, utcnow

if TYPE_CHECKING:  # the Deployer owns what a cancel touches
    from bot.service import Deployer


async def cancel(deployer: Deployer, job_id: str, user: str) -> Job:
    job = await deployer._job(job_id)
    if job.state is JobState.DESTROY_REQUESTED:  # withdraw the destroy, keep the VM
        return await deployer.destroyer.cancel(job, user)
    if user != job.requester and not await deployer.is_approver(user):
        raise NotAllowed(
            f"Only {job.requester} or an approver can cancel job {job_id}.",
            people=(job.requester,),
        )
    if job.state in (JobState.QUEUED, JobState.AWAITING_APPROVAL):
        if await _unstarted(deployer, job, user):
            deployer.queue.cancel(job_id)
            cancelled = await deployer._job(job_id)
            await deployer.progress.job_updated(cancelled, f"cancelled by {user}")
            await deployer.addressing.release_quietly(cancelled)
            return cancelled
        job = await deployer._job(job_id)
    working = job.state in (JobState.RUNNING, JobState.ROLLING_BACK)
    if working and deployer.queue.cancel(job_id):
        return job
    # Another process runs it: ask it, through the store (bot/ownership.py).
    if working and await deployer.store.request_cancel(job_id, user):
        return job
    raise TransitionRefused(f"Job {job_id} is {job.state.value}: there is nothing to cancel.")


async def _unstarted(deployer: Deployer, job: Job, user: str) -> bool:
    """A job awaiting approval has its approval closed in the same transaction, so
    nobody can approve it afterwards."""
    told = [tell.updated(job.id, f"cancelled by {user}", by=user)]
    if job.state is JobState.AWAITING_APPROVAL:
        return await deployer.store.cancel_awaiting(job.id, by=user, notices=told)
    return await deployer.store.transition(
        job.id,
        [job.state],
        JobState.CANCELLED,
        notices=told,
        error="cancelled",
        finished_at=utcnow(),
    )
