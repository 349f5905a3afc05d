"""What the bot does about work it could not finish: after a restart, and after outages.

* `recover_interrupted`: a job left `running` or `rolling_back` by a dead process has
  its VM (found by the id written before the clone) stopped and destroyed, and ends
  `failed`. When that VM does not exist the job simply fails, with nothing to clean.
  With `recovery.interrupted = "resume"`, a running job whose clone had finished and
  whose VM is there goes back in the queue and carries on instead (every step after
  the clone is safe to repeat: the `resumable` steps of bot/kinds/deploy/pipeline.STEPS).
* `sweep_wreckage`: a rollback that could not reach the hypervisor leaves its VM listed
  as wreckage on the job; a background task retries the removal until the VM is gone
  and then clears the listing, telling the job's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from backends.base import Backend, VMRef
from bot.jobs import progress as tell
from bot.jobs.progress import Progress
from bot.jobs.waiting import remove_vm
from bot.kinds.deploy.pipeline import Pipeline
from bot.kinds.deploy.runs import Run, vm_ref
from bot.models import FINAL_STATES, Job, JobEvent, JobState, RollbackReport, utcnow
from bot.models.errors import BackendError
from store.db import Store
from store.engine import is_database_error

log = logging.getLogger(__name__)
INTERRUPTED = "interrupted by a restart of the bot"


def interrupted_by(error: Exception | None) -> str:
    """Why a job its own runner handed back (its task ended without a final state)
    failed: the job's error, shown in its thread and its status."""
    if error is None:
        return "interrupted: the bot's run of it ended before the job did"
    if is_database_error(error):
        return (
            "interrupted: the database stopped answering while it ran "
            f"({type(error).__name__}); what it had made was removed"
        )
    return (
        f"interrupted by an internal error ({type(error).__name__}; details in the bot's "
        "log); what it had made was removed"
    )


async def recover_interrupted(
    pipeline: Pipeline, backends: Mapping[str, Backend], job: Job, why: str = INTERRUPTED
) -> RollbackReport | None:
    """Roll back (or, by policy, put back in the queue to resume) an interrupted job;
    None when it was requeued."""
    store, progress = pipeline.store, pipeline.progress
    if await _requeue_to_resume(pipeline, backends, job):
        return None
    me = job.claim(pipeline.owner)  # the claim its taking over made
    if job.state is JobState.RUNNING and not await store.jobs.transition(
        job.id, [JobState.RUNNING], JobState.ROLLING_BACK, held_by=me
    ):
        return RollbackReport()  # taken over by another runner meanwhile: its job now
    backend = backends.get(job.backend)
    report = RollbackReport()
    if backend is not None and job.vm_id is not None:
        ref = vm_ref(job)
        if await _may_exist(backend, ref):
            # The undo of every step that acts on the VM (destroy, stop), as declared.
            run = Run(job, backend, me, ref=ref)
            pipeline.engine.rearm(run, {step.name for step in pipeline.engine.steps})
            stack = [undo for undo in run.undo if undo.vm]
            report = await pipeline.undo(job, backend, stack, ref)
    elif backend is None and job.vm_id is not None:
        report.wreckage.append(f"VM {job.vm_id} on {job.backend} (backend not configured)")
    await store.jobs.transition(
        job.id,
        [JobState.ROLLING_BACK],
        JobState.FAILED,
        held_by=me,
        notices=[tell.finished(job.id, report)],
        error=why,
        wreckage=", ".join(report.wreckage) or None,
        finished_at=utcnow(),
    )
    final = await store.jobs.get(job.id)
    await pipeline.addressing.release_quietly(final)  # else the reconciler does
    if final is not None:
        await progress.job_finished(final, report)
    return report


async def _requeue_to_resume(pipeline: Pipeline, backends: Mapping[str, Backend], job: Job) -> bool:
    if pipeline.settings.recovery.interrupted != "resume" or job.state is not JobState.RUNNING:
        return False
    backend = backends.get(job.backend)
    if backend is None or job.vm_id is None:
        return False
    if pipeline.engine.resume_point(await pipeline.store.jobs.events(job.id)) is None:
        return False
    try:
        found = await backend.find_vm(vm_ref(job))
    except BackendError:
        return False  # cannot see the VM: rolling back is the safe choice
    if found is None or vm_ref(job).tag not in found.tags:
        return False
    return await pipeline.store.jobs.transition(
        job.id, [JobState.RUNNING], JobState.QUEUED, held_by=job.claim(pipeline.owner)
    )


async def _may_exist(backend: Backend, ref: VMRef) -> bool:
    """False only when the hypervisor says the VM is not there; unsure counts as there."""
    try:
        return await backend.find_vm(ref) is not None
    except BackendError as exc:
        log.warning("cannot tell whether VM %s exists (%s); rolling back anyway", ref.vm_id, exc)
        return True


async def sweep_wreckage(
    store: Store, backends: Mapping[str, Backend], pipeline: Pipeline, progress: Progress
) -> list[str]:
    """Try once more to remove every VM a finished job left behind; ids of jobs cleaned."""
    cleaned = []
    for job in await store.jobs.with_wreckage():
        backend = backends.get(job.backend)
        if backend is None or job.vm_id is None or job.state not in FINAL_STATES:
            continue
        ref = vm_ref(job)
        try:
            await remove_vm(backend, ref, pipeline.timeouts)
            gone = await backend.find_vm(ref) is None
        except (BackendError, TimeoutError) as exc:
            log.info("job %s: wreckage VM %s still there (%s)", job.id, ref.vm_id, exc)
            continue
        if gone:
            text = f"the VM left behind ({ref.vm_id}) has now been removed."
            await store.jobs.update(  # the note and the change land together, or neither
                job.id,
                wreckage=None,
                events=[JobEvent(job_id=job.id, step="rollback", phase="note", detail=text)],
                notices=[tell.noted(job.id, text)],
            )
            await progress.job_note(job, text)
            cleaned.append(job.id)
    return cleaned
