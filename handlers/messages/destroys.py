"""What deploybot says about destroying a VM (split from handlers/messages/core.py): the
thread's updates, the answer to `/deploy destroy`, and the destroy card."""

from __future__ import annotations

from bot.models import Job, JobState
from handlers.messages.text import Said, escape, mention


def destroy_update(job: Job, note: str) -> str | None:
    """A destroy's state change (bot/kinds/deploy/destroy.py), said with what happens next."""
    state = job.state
    if state is JobState.DESTROY_REQUESTED:
        return (
            f"{job.destroy_by} asked to destroy it; waiting for approval. An approver "
            f"answers `approve {job.id}` or `reject {job.id} REASON`."
        )
    if state is JobState.DESTROYING:
        by = f"{note}; " if note else ""
        return f"{by}destroying: stopping the VM, then removing it."
    if state is JobState.SUCCEEDED and note:  # a destroy refused, rejected or withdrawn
        return note if note.endswith(".") else f"{note}."
    return None


def destroyed(job: Job) -> str:
    who = [f"asked by {job.destroy_by}"] if job.destroy_by else []
    who += [f"approved by {job.destroy_approver}"] if job.destroy_approver else []
    by = f" ({', '.join(who)})" if who else ""
    return (
        f"destroyed{by}: VM {job.vm_id} is gone from {job.backend}; {job.name} and "
        f"{job.address} are free again."
    )


def destroy_answer(job: Job) -> str:
    """The answer to `/deploy destroy`: what happens now."""
    if job.state is JobState.DESTROY_REQUESTED:
        return (
            f"Job {job.id}: destroying {job.name} needs approval; I have asked the "
            f"approvers. Withdraw it with `/deploy cancel {job.id}`."
        )
    if job.state is JobState.DESTROYED:
        return f"Job {job.id}: {destroyed(job)}"
    if job.state is JobState.SUCCEEDED:  # refused or failed at once: the VM stays
        return f"Job {job.id}: {job.name} was not destroyed; `/deploy status {job.id}` says why."
    return f"Job {job.id}: destroying {job.name} {job.address} on {job.backend}. Watch its thread."


def destroy_withdrawn(job: Job) -> str:
    return f"Job {job.id}: the destroy was withdrawn; {job.name} stays."


def destroy_confirm(job: Job) -> str:
    return (
        f"VM {job.vm_id} on {job.backend} ({job.name}, {job.final_address or job.address}) "
        "will be stopped and removed for good."
    )


def destroy_needed(job: Job) -> str:
    """The destroy card's notification text (plain)."""
    return f"Destroy needs approval: {job.name} {job.address} (job {job.id})"


def destroy_summary(job: Job) -> str:
    """Mrkdwn: the destroy card; every value from the request escaped."""
    asker = mention(job.destroy_by) if job.destroy_by else "someone"
    what = escape(f"asks to destroy {job.name} {job.final_address or job.address}")
    details = escape(
        f"VM {job.vm_id} on {job.backend}, deployed on {job.created_at:%Y-%m-%d %H:%M} UTC. "
        f"Job {job.id}."
    )
    return f"*{asker} {what}* (deployed by {mention(job.requester)})\n{details}"


def destroy_decision(note: str, by: str | None) -> Said:
    """What replaces the destroy card's buttons: the core's note, which names the person
    `by` who decided or withdrew it (bot.models.Notice.by) before any reason."""
    said = note[:1].upper() + note[1:] if note else "Decided"
    mark = ":white_check_mark:" if "approved" in note else ":no_entry_sign:"
    return Said(f"{mark} {said}.", (by,) if by else ())
