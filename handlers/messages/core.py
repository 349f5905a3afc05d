"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal now,
Slack later) only lay these texts out; they never word their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from bot.models import Job, JobState, RollbackReport
from handlers.messages.destroys import destroy_update, destroy_withdrawn, destroyed
from handlers.messages.hostkeys import host_key_lines
from handlers.messages.text import STATE_LABELS, step_label

INTERNAL_ERROR = (
    "Sorry, something went wrong on my side and nothing was changed. "
    "The details are in the bot's log ({log}); try again, or show it to an operator."
)


def headline(job: Job) -> str:
    """The one-line summary every thread starts with and Slack keeps current."""
    where = f"{job.backend}/{job.request.placement}" if job.request.placement else job.backend
    return f"{job.name} {job.address} on {where}: {STATE_LABELS[job.state]}"


def job_update(job: Job, note: str = "") -> str:
    """A state change, said with what happens next."""
    state = job.state
    if state is JobState.AWAITING_APPROVAL:
        return (
            f"requested by {job.requester}; waiting for approval ({job.approval_reason}). "
            f"An approver answers `approve {job.id}` or `reject {job.id} REASON`."
        )
    if state is JobState.QUEUED:
        return "queued; it starts as soon as a slot is free." + (f" {note}" if note else "")
    if state is JobState.RUNNING:
        return "deploying."
    if state is JobState.ROLLING_BACK:
        return "something failed; removing what was built so far."
    if state is JobState.REJECTED:
        return f"rejected: {note or 'no reason given'}. Change the request and ask again."
    if state is JobState.EXPIRED:
        return "nobody approved it in time, so it expired. Ask again when an approver is around."
    if state is JobState.CANCELLED:
        return f"{note or 'cancelled'}. Nothing was built."
    if state is JobState.EXPIRED_OFF:
        return (
            f"{note or 'lease ended'}; it is destroyed after the grace period unless "
            f"extended: `/deploy lease extend {job.name} 7d`."
        )
    return destroy_update(job, note) or STATE_LABELS[state]


def approved(job: Job, approver: str) -> str:
    return f"approved by {approver}; queued."


def approve_answer(job: Job, approver: str) -> str:
    return f"Job {job.id}: {approved(job, approver)}"


def reject_answer(job: Job) -> str:
    return f"Job {job.id}: rejected; {job.requester} has been told why."


def address_of(job: Job) -> str:
    """The job's address, and whether deploybot chose it (the requester gave none)."""
    if job.request.picked:
        return f"{job.address} (next free in {job.request.subnet})"
    return job.address


def accepted(job: Job) -> str:
    where = f"{job.name} {address_of(job)}"
    if job.state is JobState.AWAITING_APPROVAL:
        return (
            f"Job {job.id}: {where} needs approval ({job.approval_reason}). "
            f"I have asked the approvers; follow it with `/deploy status {job.id}`."
        )
    return f"Job {job.id}: deploying {where} shortly. Watch the thread."


def step_started(step: str, detail: str) -> str:
    return f"… {step_label(step)}" + (f" ({detail})" if detail else "")


def step_finished(step: str, duration_s: float, ok: bool, detail: str) -> str:
    mark = "✓" if ok else "✗"
    text = f"{mark} {step_label(step):<26} {duration_s:6.1f} s"
    return text + (f"  {detail}" if detail else "")


def nics_line(job: Job) -> str | None:
    """Every NIC's address when the VM has more than one (None: one NIC), e.g.
    "NICs: net0 10.0.0.50/24 (lab), net1 10.0.20.5/24 (lab20, MAC 52:54:00:12:34:56)"."""
    request = job.request
    if not request.nics:
        return None
    first = request.address.ip if job.final_address is None else job.final_address
    legs = [(f"{first}/{request.address.network.prefixlen}", request.subnet, request.mac)]
    legs += [(str(n.address), n.subnet, n.mac) for n in request.nics]
    shown = [
        f"net{i} {address} ({', '.join(x for x in (subnet, mac and f'MAC {mac}') if x)})"
        for i, (address, subnet, mac) in enumerate(legs)
    ]
    return "NICs: " + ", ".join(shown)


def finished(job: Job, rollback: RollbackReport | None) -> list[str]:
    """The end of a thread: the SSH line (and every NIC's address), or what failed and
    what the rollback did."""
    if job.state is JobState.SUCCEEDED:
        lines = [f"ready in {_took(job)}. Log in with:", f"    {job.ssh_line}"]
        nics = nics_line(job)
        return lines + ([nics] if nics else []) + host_key_lines(job)
    if job.state is JobState.DESTROYED:
        return [destroyed(job)]
    if job.state is JobState.CANCELLED:
        lines = ["cancelled."]
    else:
        step = step_label(job.failed_step) if job.failed_step else "an earlier step"
        lines = [f"failed at {step}: {sentence(job.error or '')}"]
    lines.extend(_rollback_lines(rollback))
    if job.state is JobState.FAILED:
        lines.append("Fix the cause (or ask an operator), then run the same /deploy again.")
    return lines


def slack_outcome_dm(job: Job) -> str:
    """Plain: the outcome told to the requester by direct message (escaped by the caller)."""
    where = f"{job.name} {job.address} (job {job.short_id})"
    if job.state is JobState.SUCCEEDED:
        nics = [nics_line(job) or ""] if job.request.nics else []
        ready = f"{where} is ready: `{job.ssh_line}`"
        return "\n".join([ready, *nics, *_dm_lines(host_key_lines(job))])
    if job.state is JobState.CANCELLED:
        return f"{where} was cancelled; its thread says what was removed."
    if job.state is JobState.DESTROYED:
        return f"{where} was destroyed; its name and address are free again."
    step = step_label(job.failed_step) if job.failed_step else "an earlier step"
    return (
        f"{where} failed at {step}: {sentence(job.error or '')} "
        "Its thread says what was rolled back."
    )


def _dm_lines(lines: list[str]) -> list[str]:
    return [f"`{ln.strip()}`" if ln.startswith("    ") else ln for ln in lines]


def sentence(text: str) -> str:
    """`text` ended as a sentence: a reason that ends with its own full stop (a
    hypervisor's message, "... on pve1.") gets no second one."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _rollback_lines(rollback: RollbackReport | None) -> list[str]:
    if rollback is None:
        return []
    lines = []
    if rollback.undone:
        lines.append("Rolled back: " + "; ".join(rollback.undone) + ".")
    if not rollback.undone and not rollback.failed and not rollback.wreckage:
        lines.append("Nothing had been built, so there was nothing to remove.")
    for failure in rollback.failed:
        lines.append(f"Rollback problem: {sentence(failure)}")
    if rollback.wreckage:
        lines.append(
            "Left behind (remove by hand or with `deploybot gc`): "
            + "; ".join(rollback.wreckage)
            + "."
        )
    return lines


def _took(job: Job) -> str:
    if job.started_at and job.finished_at:
        return f"{(job.finished_at - job.started_at).total_seconds():.1f} s"
    return "a moment"


def cancelling(job: Job) -> str:
    if job.state is JobState.SUCCEEDED:  # a destroy awaiting approval was withdrawn
        return destroy_withdrawn(job)
    if job.state is JobState.CANCELLED:
        return f"Job {job.id} cancelled before it started; nothing was built."
    return f"Cancelling job {job.id}: whatever was built is being removed. Watch the thread."


def switched_user(user: str) -> str:
    return f"You are now {user}."


def secrets_missing(problems: Sequence[str]) -> str:
    """Why a command that needs the configuration's secrets does not start."""
    lines = "\n".join(f"  {problem}" for problem in problems)
    return (
        f"The environment lacks {len(problems)} secret(s) the configuration names (secrets "
        f"are never read from the file):\n{lines}\nSet them, then start again."
    )
