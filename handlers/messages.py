"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal now,
Slack later) only lay these texts out; they never word their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.base import Template
from bot.models import Job, JobEvent, JobState, RollbackReport
from bot.parser import SUBCOMMAND_USAGE, USAGE
from bot.service import JobStatus

STEP_LABELS = {
    "check_free": "check name and address",
    "clone": "copy template",
    "identity": "set identity (cloud-init)",
    "resize": "grow disk",
    "power_on": "power on",
    "address": "wait for address",
    "ssh": "check SSH",
    "rollback": "roll back",
}

STATE_LABELS = {
    JobState.AWAITING_APPROVAL: "awaiting approval",
    JobState.QUEUED: "queued",
    JobState.RUNNING: "deploying",
    JobState.ROLLING_BACK: "rolling back",
    JobState.SUCCEEDED: "ready",
    JobState.FAILED: "failed",
    JobState.CANCELLED: "cancelled",
    JobState.REJECTED: "rejected",
    JobState.EXPIRED: "expired",
}

HELP = "\n".join(
    [
        "Deploy a VM from a template:",
        f"  {USAGE}",
        "  e.g. /deploy web01 10.0.0.50 mem=4G disk=+20G",
        "Other commands:",
        *(f"  {usage}" for name, usage in SUBCOMMAND_USAGE.items() if name != "help"),
        "Defaults: template, size and login user come from the configuration; "
        "upgrade=no unless you say upgrade=yes.",
    ]
)

SHELL_HELP = "\n".join(
    [
        "Type what you would type in Slack: /deploy help, /deploy web01 10.0.0.50, ...",
        "  as NAME              act as another person (to approve, for instance)",
        "  approve JOB          short for /deploy approve JOB",
        "  reject JOB REASON    short for /deploy reject JOB REASON",
        "  quit                 leave, once running deploys have finished",
    ]
)

INTERNAL_ERROR = (
    "Sorry, something went wrong on my side and nothing was changed. "
    "The details are in the bot's log ({log}); try again, or show it to an operator."
)


def step_label(step: str) -> str:
    return STEP_LABELS.get(step, step)


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
    return STATE_LABELS[state]


def approved(job: Job, approver: str) -> str:
    return f"approved by {approver}; queued."


def accepted(job: Job) -> str:
    if job.state is JobState.AWAITING_APPROVAL:
        return (
            f"Job {job.id}: {job.name} {job.address} needs approval ({job.approval_reason}). "
            f"I have asked the approvers; follow it with `/deploy status {job.id}`."
        )
    return f"Job {job.id}: deploying {job.name} {job.address} shortly. Watch the thread."


def step_started(step: str, detail: str) -> str:
    return f"… {step_label(step)}" + (f" ({detail})" if detail else "")


def step_finished(step: str, duration_s: float, ok: bool, detail: str) -> str:
    mark = "✓" if ok else "✗"
    text = f"{mark} {step_label(step):<26} {duration_s:6.1f} s"
    return text + (f"  {detail}" if detail else "")


def finished(job: Job, rollback: RollbackReport | None) -> list[str]:
    """The end of a thread: the SSH line, or what failed and what the rollback did."""
    if job.state is JobState.SUCCEEDED:
        return [f"ready in {_took(job)}. Log in with:", f"    {job.ssh_line}"]
    if job.state is JobState.CANCELLED:
        lines = ["cancelled."]
    else:
        step = step_label(job.failed_step) if job.failed_step else "an earlier step"
        lines = [f"failed at {step}: {job.error}."]
    lines.extend(_rollback_lines(rollback))
    if job.state is JobState.FAILED:
        lines.append("Fix the cause (or ask an operator), then run the same /deploy again.")
    return lines


def _rollback_lines(rollback: RollbackReport | None) -> list[str]:
    if rollback is None:
        return []
    lines = []
    if rollback.undone:
        lines.append("Rolled back: " + "; ".join(rollback.undone) + ".")
    if not rollback.undone and not rollback.failed and not rollback.wreckage:
        lines.append("Nothing had been built, so there was nothing to remove.")
    for failure in rollback.failed:
        lines.append(f"Rollback problem: {failure}.")
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


def status(info: JobStatus) -> list[str]:
    job = info.job
    lines = [f"Job {job.id}: {headline(job)} (requested by {job.requester})"]
    if info.approval and info.approval.decided_by:
        verb = info.approval.state.value
        lines.append(f"  {verb} by {info.approval.decided_by} at {info.approval.decided_at:%H:%M}")
    lines.extend(f"  {_event_line(e)}" for e in info.events)
    if job.ssh_line and job.state is JobState.SUCCEEDED:
        lines.append(f"  {job.ssh_line}")
    if job.error and job.state is not JobState.SUCCEEDED:
        lines.append(f"  reason: {job.error}")
    if job.wreckage:
        lines.append(f"  left behind: {job.wreckage}")
    return lines


def _event_line(event: JobEvent) -> str:
    took = f" {event.duration_s:.1f} s" if event.duration_s is not None else ""
    detail = f"  {event.detail}" if event.detail else ""
    return f"{event.at:%H:%M:%S} {step_label(event.step)} {event.phase}{took}{detail}"


def history(jobs: Sequence[Job], *, filtered: bool = False) -> list[str]:
    if not jobs and filtered:
        return ["No deploys match; drop a filter to see more."]
    if not jobs:
        return ["No deploys yet. Start one with /deploy web01 10.0.0.50."]
    lines = [f"{'job':<8} {'when':<16} {'who':<10} {'name':<14} {'address':<15} state"]
    for job in jobs:
        lines.append(
            f"{job.id:<8} {job.created_at:%Y-%m-%d %H:%M} {job.requester:<10.10} "
            f"{job.name:<14.14} {job.address:<15} {STATE_LABELS[job.state]}"
        )
    return lines


def templates(found: dict[str, list[Template] | str]) -> list[str]:
    lines = []
    for backend, items in found.items():
        if isinstance(items, str):
            lines.append(f"{backend}: could not list templates ({items}); try again shortly.")
            continue
        names = ", ".join(f"{t.name} ({t.os_family})" for t in items) or "none"
        lines.append(f"{backend}: {names}")
    lines.append("Use one with template=NAME, e.g. /deploy web01 10.0.0.50 template=debian-12")
    return lines


def cancelling(job: Job) -> str:
    if job.state is JobState.CANCELLED:
        return f"Job {job.id} cancelled before it started; nothing was built."
    return f"Cancelling job {job.id}: whatever was built is being removed. Watch the thread."


def unknown_shell_input() -> str:
    return "I only understand /deploy ..., as NAME, approve JOB, reject JOB REASON and quit."


def switched_user(user: str) -> str:
    return f"You are now {user}."


def serve_unavailable() -> str:
    return (
        "The Slack front end is not part of this build yet. Use `deploybot shell` to deploy "
        "from a terminal, or `deploybot demo` to watch a scripted session."
    )
