"""Cancelling a job: before it starts (one compare-and-set, its approval closed with
it), while this process runs it (the queue cancels its task, which rolls back), or while
another process does (asked through the store; that process acts at its next tick).
The deploy kind (bot/kinds/deploy/kind.py) calls it; `Deployer.cancel` runs that inside its
audit.
"""

from __future__ import annotations

from bot.addresses.allocation import Addressing
from bot.approvals.decisions import Approvals
from bot.jobs import progress as tell
from bot.jobs import refs as jobrefs
from bot.jobs.progress import Progress
from bot.jobs.queue import JobQueue
from bot.kinds.deploy.destroy import Destroyer
from bot.models import Job, JobState, utcnow
from bot.models.errors import NotAllowed, TransitionRefused
from store.db import Store


class Cancels:
    """What a cancel touches: the job's row, this process's queue, the destroy it may
    withdraw, and the address it held."""

    def __init__(
        self,
        store: Store,
        queue: JobQueue,
        progress: Progress,
        addressing: Addressing,
        approvals: Approvals,
        destroyer: Destroyer,
    ) -> None:
        self.store, self.queue, self.progress = store, queue, progress
        self.addressing, self.approvals, self.destroyer = addressing, approvals, destroyer

    async def cancel(self, job_id: str, user: str) -> Job:
        job = await jobrefs.load(self.store, job_id)
        if job.state is JobState.DESTROY_REQUESTED:  # withdraw the destroy, keep the VM
            return await self.destroyer.cancel(job, user)
        if user != job.requester and not await self.approvals.is_approver(user):
            raise NotAllowed(
                f"Only {job.requester} or an approver can cancel job {job_id}.",
                people=(job.requester,),
            )
        if job.state in (JobState.QUEUED, JobState.AWAITING_APPROVAL):
            if await self._unstarted(job, user):
                self.queue.cancel(job_id)
                cancelled = await jobrefs.load(self.store, job_id)
                await self.progress.job_updated(cancelled, f"cancelled by {user}")
                await self.addressing.release_quietly(cancelled)
                return cancelled
            job = await jobrefs.load(self.store, job_id)
        working = job.state in (JobState.RUNNING, JobState.ROLLING_BACK)
        if working and self.queue.cancel(job_id):
            return job
        # Another process runs it: ask it, through the store (bot/ownership/claims.py).
        if working and await self.store.jobs.request_cancel(job_id, user):
            return job
        raise TransitionRefused(f"Job {job_id} is {job.state.value}: there is nothing to cancel.")

    async def _unstarted(self, job: Job, user: str) -> bool:
        """A job awaiting approval has its approval closed in the same transaction, so
        nobody can approve it afterwards."""
        told = [tell.updated(job.id, f"cancelled by {user}", by=user)]
        if job.state is JobState.AWAITING_APPROVAL:
            return await self.store.approvals.cancel_awaiting(job.id, by=user, notices=told)
        return await self.store.jobs.transition(
            job.id,
            [job.state],
            JobState.CANCELLED,
            notices=told,
            error="cancelled",
            finished_at=utcnow(),
        )
