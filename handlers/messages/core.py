"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal now,
Slack later) only lay these texts out; they never word their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, tzinfo

from backends.base import Template
from backends.building import TemplateVersion
from bot.models import Job, JobEvent, JobState, RollbackReport
from bot.parser import SUBCOMMAND_USAGE, USAGE
from bot.service import JobStatus, VMPage

STEP_LABELS = {
    "check_free": "check name and address",
    "clone": "copy template",
    "identity": "set identity (cloud-init)",
    "resize": "grow disk",
    "power_on": "power on",
    "address": "wait for address",
    "ssh": "check SSH",
    "register": "mark the address in use (IPAM)",
    "rollback": "roll back",
    "stop": "stop the VM",
    "destroy": "destroy the VM",
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
    JobState.RELEASED: "released (VM gone)",
    JobState.DESTROY_REQUESTED: "destroy awaiting approval",
    JobState.DESTROYING: "being destroyed",
    JobState.DESTROYED: "destroyed",
    JobState.EXPIRED_OFF: "powered off (lease ended)",
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
        "Each VM gets a lease (lease=7d, up to the maximum here): I remind you before it "
        "ends, power the VM off at the end and destroy it after a grace period, unless "
        "you extend it.",
    ]
)

SHELL_HELP = "\n".join(
    [
        "Type what you would type in Slack: /deploy help, /deploy web01 10.0.0.50, ...",
        "  as NAME              act as another person (to approve, for instance)",
        "  approve JOB          short for /deploy approve JOB",
        "  reject JOB REASON    short for /deploy reject JOB REASON",
        "  destroy NAME         short for /deploy destroy NAME",
        "  list [all|@USER]     short for /deploy list ...",
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
    if state is JobState.EXPIRED_OFF:
        return (
            f"{note or 'lease ended'}; it is destroyed after the grace period unless "
            f"extended: `/deploy lease extend {job.name} 7d`."
        )
    return destroy_update(job, note) or STATE_LABELS[state]


def destroy_update(job: Job, note: str) -> str | None:
    """A destroy's state change (bot/destroy.py), said with what happens next."""
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


def finished(job: Job, rollback: RollbackReport | None) -> list[str]:
    """The end of a thread: the SSH line, or what failed and what the rollback did."""
    if job.state is JobState.SUCCEEDED:
        lines = [f"ready in {_took(job)}. Log in with:", f"    {job.ssh_line}"]
        if job.host_key:
            lines.append(f"Its host key is {job.host_key}: check that ssh shows the same.")
        return lines
    if job.state is JobState.DESTROYED:
        return [destroyed(job)]
    if job.state is JobState.CANCELLED:
        lines = ["cancelled."]
    else:
        step = step_label(job.failed_step) if job.failed_step else "an earlier step"
        lines = [f"failed at {step}: {job.error}."]
    lines.extend(_rollback_lines(rollback))
    if job.state is JobState.FAILED:
        lines.append("Fix the cause (or ask an operator), then run the same /deploy again.")
    return lines


def slack_outcome_dm(job: Job) -> str:
    """Plain: the outcome told to the requester by direct message (escaped by the caller)."""
    where = f"{job.name} {job.address} (job {job.short_id})"
    if job.state is JobState.SUCCEEDED:
        return f"{where} is ready: `{job.ssh_line}`"
    if job.state is JobState.CANCELLED:
        return f"{where} was cancelled; its thread says what was removed."
    if job.state is JobState.DESTROYED:
        return f"{where} was destroyed; its name and address are free again."
    step = step_label(job.failed_step) if job.failed_step else "an earlier step"
    return f"{where} failed at {step}: {job.error}. Its thread says what was rolled back."


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
    if job.destroy_by and job.destroy_asked_at:
        approved = f", approved by {job.destroy_approver}" if job.destroy_approver else ""
        gone = f"; gone at {job.destroyed_at:%H:%M} UTC" if job.destroyed_at else ""
        lines.append(
            f"  destroy asked by {job.destroy_by} at {job.destroy_asked_at:%Y-%m-%d %H:%M} UTC"
            f"{approved}{gone}"
        )
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
            f"{job.short_id:<8} {job.created_at:%Y-%m-%d %H:%M} {job.requester:<10.10} "
            f"{job.name:<14.14} {job.address:<15} {STATE_LABELS[job.state]}"
        )
    return lines


def templates(
    found: dict[str, list[Template] | str],
    built: dict[str, dict[str, TemplateVersion]] | None = None,
) -> list[str]:
    """`/deploy templates`: each backend's templates; on a backend that builds templates
    (`built`: its versions by name), a table of what deploybot built of each, `-` for the
    templates it did not build."""
    lines = []
    for backend, items in found.items():
        if isinstance(items, str):
            lines.append(f"{backend}: could not list templates: {items}.")
            continue
        names = ", ".join(_template(t) for t in items) or "none"
        lines.append(f"{backend}: {names}")
        lines += [f"{backend}: {t.name} is refused: {t.problem}" for t in items if t.problem]
        versions = (built or {}).get(backend)
        if versions is not None and items:
            lines += _built_table([(t.name, versions.get(t.name)) for t in items])
    lines.append("Use one with template=NAME, e.g. /deploy web01 10.0.0.50 template=debian-12")
    return lines


def built_cells(version: TemplateVersion | None) -> tuple[str, str, str, str]:
    """`/deploy templates`' build columns: profile, version, build date, CPU baseline;
    `-` for a template deploybot did not build."""
    if version is None:
        return ("-", "-", "-", "-")
    built = version.built_at.strftime("%Y-%m-%d") if version.built_at else "-"
    return (version.profile, f"v{version.version}", built, version.cpu or "-")


def _built_table(rows: list[tuple[str, TemplateVersion | None]]) -> list[str]:
    table = [("template", "profile", "version", "built", "CPU baseline")]
    table += [(name, *built_cells(version)) for name, version in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return [
        "  "
        + "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True))
        + "  "
        + row[4]
        for row in table
    ]


def _template(template: Template) -> str:
    refused = ", refused" if template.problem else ""  # the reason follows the list
    return f"{template.name} ({template.os_family}{refused})"


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


def list_title(page: VMPage, me: str) -> str:
    whose = (
        "Everyone's VMs"
        if page.requester is None
        else ("Your VMs" if page.requester == me else f"VMs of {page.requester}")
    )
    return f"{whose}: {page.total} (page {page.page} of {page.pages})"


def list_empty(page: VMPage, me: str) -> str:
    if page.requester == me:
        return "You have no VMs from deploybot. Deploy one with /deploy web01."
    if page.requester is None:
        return "deploybot holds no VMs at all. Deploy one with /deploy web01."
    return f"{page.requester} has no VMs from deploybot. `/deploy list all` shows everyone's."


def age(job: Job, now: datetime) -> str:
    seconds = max(0, int((now - job.created_at).total_seconds()))
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def list_row(job: Job, now: datetime) -> str:
    """Mrkdwn: one VM of `/deploy list`; what people typed is escaped."""
    address = job.final_address or job.address
    where = escape(f"{job.name}")
    return (
        f"*{where}* `{address}` on {escape(job.backend)} · {age(job, now)} old · "
        f"lease end {lease_cell(job)} · {STATE_LABELS[job.state]} · job {job.short_id} · "
        f"{mention(job.requester)}"
    )


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


def destroy_decision(note: str) -> str:
    """Plain: what replaces the destroy card's buttons (the core's note names people by
    id; the front end makes them mentions)."""
    said = note[:1].upper() + note[1:] if note else "Decided"
    mark = ":white_check_mark:" if "approved" in note else ":no_entry_sign:"
    return f"{mark} {said}."


LEASE_NONE = "—"  # not ready yet: its lease starts when the VM is


def list_lines(page: VMPage, me: str, now: datetime) -> list[str]:
    """`/deploy list` as a table (the shell, the CLI)."""
    if not page.jobs:
        return [list_empty(page, me)]
    lines = [
        list_title(page, me),
        f"{'name':<16} {'address':<15} {'backend':<10} {'age':>4} {'lease end':<16} "
        f"{'state':<26} job",
    ]
    for job in page.jobs:
        lines.append(
            f"{job.name:<16.16} {job.final_address or job.address:<15} {job.backend:<10.10} "
            f"{age(job, now):>4} {lease_cell(job):<16} {STATE_LABELS[job.state]:<26} "
            f"{job.short_id}"
        )
    if page.page < page.pages:
        lines.append(f"More: add page={page.page + 1}.")
    return lines


def cancelling(job: Job) -> str:
    if job.state is JobState.SUCCEEDED:  # a destroy awaiting approval was withdrawn
        return destroy_withdrawn(job)
    if job.state is JobState.CANCELLED:
        return f"Job {job.id} cancelled before it started; nothing was built."
    return f"Cancelling job {job.id}: whatever was built is being removed. Watch the thread."


def unknown_shell_input() -> str:
    return (
        "I only understand /deploy ..., as NAME, approve JOB, reject JOB REASON, destroy NAME, "
        "list and quit."
    )


def switched_user(user: str) -> str:
    return f"You are now {user}."


def escape(text: str) -> str:
    """Plain text as mrkdwn that shows it as is (`&` first, or it would be escaped twice)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def mention(user: str) -> str:
    return f"<@{user}>"


def when(moment: datetime, zone: tzinfo = UTC) -> str:
    """A time as people read it in their zone: "Tue 8 Dec 14:00 CET"."""
    local = moment.astimezone(zone)
    return f"{local:%a} {local.day} {local:%b %H:%M} {local.tzname() or 'UTC'}"


def lease_cell(job: Job) -> str:
    """`/deploy list`'s lease end (UTC): a time, "never", or LEASE_NONE before ready."""
    end = job.lease_end
    if end is not None:
        return when(end)
    if job.state in (JobState.SUCCEEDED, JobState.EXPIRED_OFF) and job.lease_s is None:
        return "never"
    return LEASE_NONE
