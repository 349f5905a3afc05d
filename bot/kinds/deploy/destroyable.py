"""Which jobs can be destroyed, and the words for a destroy that cannot go on.

Each refusal says what was wrong and what to do; a permanent one never says "try
again". Used by bot/kinds/deploy/destroy.py.
"""

from __future__ import annotations

from backends.base import NotOurVM
from bot.models import HOLDING_STATES, Job, JobState
from bot.models.errors import BackendError, TransitionRefused


def check_destroyable(job: Job) -> None:
    """Only a ready VM (or one powered off at the end of its lease) can be destroyed;
    anything else says why and what to do."""
    if job.state in (JobState.SUCCEEDED, JobState.EXPIRED_OFF):
        return
    what = {
        JobState.DESTROY_REQUESTED: "its destroy already waits for an approver",
        JobState.DESTROYING: "it is being destroyed already",
        JobState.DESTROYED: "it was destroyed already",
        JobState.RELEASED: "its VM was found gone, so there is nothing to destroy",
    }.get(job.state)
    if what is None and job.state in HOLDING_STATES:
        what = (
            f"it is still {job.state.value}: wait until it is ready, or stop it with "
            f"`/deploy cancel {job.id}`"
        )
    what = what or f"it {job.state.value}, so it has no VM to destroy"
    raise TransitionRefused(f"Job {job.id} ({job.name}) cannot be destroyed: {what}.")


def not_ours(job: Job, exc: NotOurVM) -> str:
    return (
        f"destroy refused: {exc.message}. Someone changed the VM by hand, so deploybot left "
        f"it alone (nothing was touched). Put the tag back to let deploybot destroy it, or "
        "remove the VM by hand."
    )


def failed(job: Job, exc: BackendError | TimeoutError) -> str:
    text = exc.message if isinstance(exc, BackendError) else str(exc)
    return (
        f"destroy failed: {text}. VM {job.vm_id} is still on {job.backend} (perhaps "
        f"stopped). Fix the cause (or ask an operator), then ask again: "
        f"`/deploy destroy {job.name}`."
    )


def unreachable_backend(job: Job) -> str:
    return (
        f"destroy failed: backend {job.backend} is not configured here, so VM {job.vm_id} "
        "cannot be reached. Ask an operator to add it back to the configuration, then ask again."
    )
