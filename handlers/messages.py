"""Every sentence deploybot says to a person, in one place.

Each message says what happened and what to do next. Front ends (the terminal now,
Slack later) only lay these texts out; they never word their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, tzinfo

from backends.base import Template
from bot.check import CheckResult
from bot.gc import GcReport
from bot.leaseterms import LeaseSettings, show_length
from bot.models import Approval, ApprovalState, Job, JobEvent, JobState, RollbackReport, UserPrefs
from bot.parser import SUBCOMMAND_USAGE, USAGE
from bot.quotas import NAMES as QUOTA_NAMES
from bot.quotas import Standing
from bot.quotas import amount as quota_amount
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


def templates(found: dict[str, list[Template] | str]) -> list[str]:
    lines = []
    for backend, items in found.items():
        if isinstance(items, str):
            lines.append(f"{backend}: could not list templates: {items}.")
            continue
        names = ", ".join(_template(t) for t in items) or "none"
        lines.append(f"{backend}: {names}")
        lines += [f"{backend}: {t.name} is refused: {t.problem}" for t in items if t.problem]
    lines.append("Use one with template=NAME, e.g. /deploy web01 10.0.0.50 template=debian-12")
    return lines


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


# --- Slack ------------------------------------------------------------------------
# Slack renders `<@U123>` as the person's name and `<!date^...>` in the reader's time zone.
# In Slack's mrkdwn `&`, `<` and `>` are markup: `<!channel>` pings everyone, `<@U123>`
# pings someone and `<https://x|y>` is a link. So text the bot did not write (a reason,
# a template name, an error that quotes what someone typed) is escaped before the bot
# adds its own markup. The functions below that add markup (mention, slack_time, bold)
# escape what they embed and return mrkdwn; the other texts here are plain, and the
# Slack front end escapes each as a whole (handlers/slack/views.mrkdwn) before turning
# the user ids in it into mentions.

FULL_COPY = "full copy: minutes, not seconds"
LINKED_CLONE = "fast linked clone: seconds"
SLACK_WORKING = "On it…"
FORM_TITLE = "Deploy a VM"
FORM_LOADING = "Looking up templates, nodes and storage…"
SETTINGS_TITLE = "Your deploy settings"
REJECT_TITLE = "Reject deploy"
FORM_LABELS = {
    "template": "Template",
    "placement": "Where (backend or node)",
    "storage": "Storage",
    "network": "Network",
    "name": "VM name",
    "address": "Address",
    "cores": "CPU cores",
    "memory": "Memory",
    "disk": "Grow the disk by (GiB)",
    "user": "Login user",
    "keys": "SSH public keys (one per line)",
    "upgrade": "Upgrade packages on first boot",
    "lease": "Lease (how long the VM lives)",
    "default_template": "Default template",
    "reason": "Why is it rejected?",
}
FORM_HINTS = {
    "address": "Inside {subnets}, e.g. {example}; empty: the next free address",
    "name": "Letters, digits and hyphens, e.g. web01",
    "keys": "Prefilled from your saved keys (`/deploy key ...` or `/deploy settings`).",
    "storage": "Leave empty to use the template's own storage.",
}
TEMPLATES_OVERFLOW = "There are {count} templates: type part of a name to find one."


def escape(text: str) -> str:
    """Plain text as mrkdwn that shows it as is (`&` first, or it would be escaped twice)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def mention(user: str) -> str:
    return f"<@{user}>"


def slack_time(moment: datetime) -> str:
    fallback = f"{moment:%Y-%m-%d %H:%M} UTC"
    return f"<!date^{int(moment.timestamp())}^{{date_short_pretty}} {{time}}|{fallback}>"


def clone_mode(linked: bool, reason: str) -> str:
    """Mrkdwn: the backend's reason may name storage the person chose."""
    why = escape(reason)
    return f"{LINKED_CLONE} ({why})" if linked else f"*{FULL_COPY}* ({why})"


def backends_not_answering(problems: Sequence[str]) -> str:
    """Mrkdwn, under the form: the backends' own words, which may quote names."""
    return escape("Not every backend answered: " + "; ".join(problems))


def storage_option(name: str, free_bytes: int) -> str:
    return f"{name} ({free_bytes / 1024**3:,.0f} GiB free)"


def slack_thread_update(job: Job, note: str, approval: Approval | None) -> str:
    """A state change in the requester's thread; an approval names who decided."""
    if job.state is JobState.AWAITING_APPROVAL:
        return (
            f"waiting for approval ({job.approval_reason}); the approvers have been asked. "
            f"Cancel with `/deploy cancel {job.id}`."
        )
    if approval is not None and approval.decided_by and job.state is JobState.QUEUED:
        return approved(job, approval.decided_by)  # plain: the front end adds the mention
    return job_update(job, note)


def slack_finished(job: Job, rollback: RollbackReport | None) -> str:
    lines = finished(job, rollback)
    return "\n".join(f"`{ln.strip()}`" if ln.startswith("    ") else ln for ln in lines)


def approval_needed(job: Job) -> str:
    """The approval card's notification text (plain)."""
    return f"Approval needed: {job.name} {job.address} (job {job.id})"


def approval_summary(job: Job) -> str:
    """Mrkdwn: the request on the approval card, every value from it escaped."""
    req = job.request
    where = f"{job.backend}/{req.placement}" if req.placement else job.backend
    asks = escape(f"asks to deploy {job.name} {address_of(job)}")
    details = escape(
        f"template {req.template}, {req.cores} cores, {req.memory_mib} MiB memory, "
        f"disk +{req.disk_grow_gib} GiB, login {req.user}\n"
        f"Needs approval because {job.approval_reason}. Job {job.id}."
    )
    return f"*{mention(job.requester)} {asks}* on {escape(where)}\n{details}"


def approval_outcome(job: Job, approval: Approval | None) -> str:
    """Mrkdwn: what replaces the Approve / Reject buttons once the request is decided;
    the approver's reason is escaped, so `<!channel>` in it pings nobody."""
    if approval is None or approval.state is ApprovalState.PENDING:
        return f"{STATE_LABELS[job.state].capitalize()}: no decision was needed any more."
    at = slack_time(approval.decided_at) if approval.decided_at else "an unknown time"
    if approval.state is ApprovalState.APPROVED and approval.decided_by:
        return f":white_check_mark: Approved by {mention(approval.decided_by)} at {at}"
    if approval.state is ApprovalState.REJECTED and approval.decided_by:
        reason = escape(approval.note) if approval.note else "no reason"
        return f":x: Rejected by {mention(approval.decided_by)}: {reason}"
    if approval.state is ApprovalState.CANCELLED:
        by = f" by {mention(approval.decided_by)}" if approval.decided_by else ""
        return f":no_entry_sign: Cancelled{by} before a decision."
    return f":hourglass: Expired at {at}: nobody approved it in time."


def approval_cancelled(note: str) -> str:
    """Plain: the core's note names the canceller by id, made a mention by the front end."""
    said = note[:1].upper() + note[1:] if note else "Cancelled"
    return f":no_entry_sign: {said} before a decision."


def key_saved(prefs: UserPrefs) -> str:
    count = len(prefs.ssh_keys)
    return (
        f"Saved. You have {count} SSH key{'s' if count != 1 else ''}; deploys that name no "
        "key log in with them. `/deploy settings` shows and edits them."
    )


def settings_saved(prefs: UserPrefs) -> str:
    template = prefs.default_template or "the configured default"
    return f"Settings saved: {len(prefs.ssh_keys)} SSH key(s), default template {template}."


def duplicate_ignored(job_id: str) -> str:
    return f"Already handled (job {job_id}); nothing was done twice."


def form_opened_elsewhere() -> str:
    return "The form could not be opened (it took too long); type `/deploy` again."


def missing_field(label: str) -> str:
    return f"{label} is required."


def reason_required() -> str:
    return "Say why, so the requester can fix the request."


def reject_question(job_id: str) -> str:
    """Mrkdwn, atop the modal that asks for the reason."""
    return f"Reject job {escape(job_id)}?"


def slack_reject_answer(job: Job) -> str:
    """Plain; Slack shows the requester's id as a mention."""
    return f"Job {job.id}: rejected; {job.requester} is told why."


def bad_ssh_key(problem: str) -> str:
    return f"SSH key: {problem}."


def name_in_flight(name: str, job_id: str) -> str:
    return f"{name} is already being deployed by job {job_id}: pick another name."


def address_in_flight(address: str, job_id: str) -> str:
    return f"{address} is already taken by job {job_id}: pick another address."


def token_missing(variable: str, what: str) -> str:
    return (
        f"{variable} is not set: put the {what} in the environment (see README, Slack "
        "set-up); deploybot serve did not start."
    )


def token_malformed(variable: str, what: str, shape: str) -> str:
    return (
        f"{variable} does not look like a {what} (it should {shape}); check that the "
        "right value is in the right variable. deploybot serve did not start."
    )


def serving_socket() -> str:
    return "deploybot is connected to Slack in Socket Mode. Stop it with Ctrl-C."


def serving_http(url: str) -> str:
    return f"deploybot is listening on {url}/slack/events (health: {url}/healthz)."


def bad_http_address(text: str) -> str:
    return f"--http {text}: give HOST:PORT, e.g. 127.0.0.1:3000."


def slack_headline(job: Job, step: str | None) -> str:
    """Mrkdwn: the parent message, the headline plus the step while a deploy runs."""
    text = escape(headline(job))
    working = job.state in (JobState.RUNNING, JobState.DESTROYING)
    return f"{text} ({step_label(step)})" if step and working else text


def slack_step(step: str, duration_s: float, ok: bool, detail: str) -> str:
    mark = ":white_check_mark:" if ok else ":x:"
    text = f"{mark} {step_label(step)} — {duration_s:.1f} s"
    return text + (f" · {detail}" if detail else "")


def bad_command_name(command: str) -> str:
    return (
        f"{command!r} is not a slash command name: start with /, then 1 to 31 lower-case "
        "letters, digits, - or _ (e.g. /deploy)."
    )


def user_settings(prefs: UserPrefs) -> list[str]:
    """The settings as text (the shell; Slack shows them in a modal)."""
    template = prefs.default_template or "the configured default"
    lines = [f"Default template: {template}.", f"SSH keys ({len(prefs.ssh_keys)}):"]
    lines.extend(f"  {' '.join(key.split()[::2])}" for key in prefs.ssh_keys)
    lines.append("Add a key with /deploy key ssh-ed25519 AAAA... comment.")
    return lines


GC_CATEGORIES = {
    "unknown_job": "job unknown to this bot",
    "ended_job": "job failed or was cancelled",
    "succeeded_job": "job succeeded (kept)",
    "job_in_flight": "job still in flight (kept)",
    "other_installation": "another installation's VM (kept)",
    "unknown_legacy": "old-style tag of a job unknown here (kept)",
    "quarantined_job": "job record damaged, set aside (kept: check it by hand)",
}


def gc_locked(vm_id: str, lock: str) -> str:
    """Why gc leaves an orphan alone: the hypervisor's own lock on it (Proxmox `lock`)."""
    return (
        f"VM is locked ({lock}): another operation holds it, and gc removes no VM while it "
        "is locked. Wait until that operation has finished (the hypervisor's task list "
        "shows it); a lock left by one that died must be cleared by hand (Proxmox: "
        f"`qm unlock {vm_id}`). Then run `deploybot gc` again."
    )


def gc_unknown_backends(unknown: list[str], known: list[str]) -> str:
    return f"No backend called {', '.join(unknown)}; the configured ones are {', '.join(known)}."


def gc_report(report: GcReport, window_minutes: float) -> list[str]:
    """What `deploybot gc` found (and, with --apply, did), counted per category."""
    scope = ", ".join(report.scope)
    head = (
        f"gc --apply over {scope}:"
        if report.applied
        else f"gc dry run over {scope} (nothing was touched):"
    )
    lines = [head]
    for backend, counts in report.counts().items():
        if backend in report.unreachable:
            lines.append(
                f"  {backend}: did not answer ({report.unreachable[backend]}); try again later."
            )
            continue
        if backend in report.refused:
            lines.append(
                f"  {backend}: refused to be asked ({report.refused[backend]}); fix that "
                "(configuration, credentials, CA bundle), then run gc again."
            )
            continue
        parts = [f"{n} {GC_CATEGORIES[c]}" for c, n in sorted(counts.items())] or ["no tagged VMs"]
        lines.append(f"  {backend}: " + "; ".join(parts))
    for finding in report.findings:
        if finding.orphan and not report.applied:
            lines.append(
                f"  orphan: VM {finding.vm.vm_id} ({finding.vm.name}) on {finding.backend}, "
                f"job {finding.job_id}: {GC_CATEGORIES[finding.category]}"
            )
            if finding.vm.lock:
                lines.append(f"    {gc_locked(finding.vm.vm_id, finding.vm.lock)}")
        elif finding.category == "other_installation" and not report.applied:
            lines.append(
                f"  another installation: VM {finding.vm.vm_id} ({finding.vm.name}) on "
                f"{finding.backend}, installation {finding.installation}, job "
                f"{finding.job_id}: never removed by this one"
            )
    if report.applied:
        for finding in report.removed:
            lines.append(
                f"  removed: VM {finding.vm.vm_id} ({finding.vm.name}) on {finding.backend}"
            )
        left = [(f, gc_locked(f.vm.vm_id, f.vm.lock or "?")) for f in report.locked]
        for finding, why in [*left, *report.left]:
            lines.append(
                f"  left: VM {finding.vm.vm_id} ({finding.vm.name}) on {finding.backend}: {why}"
            )
        lines.append(
            f"Found {len(report.orphans)} orphan(s), removed {len(report.removed)}, "
            f"left {len(left) + len(report.left)}."
        )
    elif report.orphans:
        lines.append(
            f"Found {len(report.orphans)} orphan(s). Check them, then remove them with "
            f"`deploybot gc --apply` (same scope, within {window_minutes:g} minutes)."
        )
    else:
        lines.append("Found no orphans.")
    return lines


def check_lines(results: Sequence[CheckResult]) -> list[str]:
    """`deploybot check`: one line a check, its fix on the next, and a verdict."""
    lines = []
    for result in results:
        lines.append(f"{'ok' if result.ok else 'PROBLEM':7}  {result.name}: {result.detail}")
        if result.fix:
            lines.append(f"         fix: {result.fix}")
    problems = sum(not r.ok for r in results)
    lines.append(f"{problems} problem(s)." if problems else "All checks passed.")
    return lines


def slack_not_checked(token_env: str) -> str:
    return f"not checked: ${token_env} is not set (only `deploybot serve` needs it)"


def slack_token_fix(token_env: str) -> str:
    return f"set ${token_env} to the app's bot token (xoxb-...; Slack app > OAuth & Permissions)"


def slack_scopes_fix() -> str:
    return (
        "add them to the app (`deploybot manifest` prints its manifest) and reinstall it "
        "to the workspace; the new token has them"
    )


def slack_channel_unreadable(channel: str) -> str:
    return (
        f"membership not checked: the token may not read {channel} (channels:read or "
        "groups:read, which the bot does not otherwise need)"
    )


def slack_channel_fix(bot: str) -> str:
    return (
        f"check slack.approvals_channel (a channel id, C... or G...) and invite the bot "
        f"there: `/invite @{bot}`"
    )


# --- quotas (bot/quotas.py) --------------------------------------------------------------


def _quantity(resource: str, count: int) -> str:
    name = "VM" if resource == "vms" and count == 1 else QUOTA_NAMES[resource]
    return f"{quota_amount(resource, count)} {name}"


def quota_left(standings: Sequence[Standing]) -> str | None:
    """Plain: what the person may still ask for under each quota (the deploy form)."""
    parts = []
    for one in standings:
        left = ", ".join(
            _quantity(r, max(0, limit - one.used.of(r))) for r, limit in one.cap.limits.items()
        )
        parts.append(f"group {one.cap.label}: {left}" if one.cap.group else f"you: {left}")
    return "Quota left: " + "; ".join(parts) + "." if parts else None


def quota_used(standing: Standing) -> str:
    """Plain: "cores 6 of 16 · ..." for one quota (the App Home)."""
    used = " · ".join(
        f"{QUOTA_NAMES[r]} {standing.used.of(r)} of {quota_amount(r, limit)}"
        for r, limit in standing.cap.limits.items()
    )
    whose = "Your quota" if not standing.cap.group else f"Quota of group {standing.cap.label}"
    return f"{whose}: {used}"


# --- the App Home (handlers/slack/home.py) -------------------------------------------------

HOME_VMS = "Your VMs"
HOME_APPROVALS = "Waiting for your approval"
HOME_RECENT = "Your recent jobs"
HOME_NO_VMS = "You have no VMs from deploybot. Deploy one with /deploy web01 in any channel."
HOME_NO_JOBS = "No jobs yet."
HOME_TEXT = "deploybot: your VMs, approvals and recent jobs"


def home_more(count: int, where: str) -> str:
    """Plain: the rows a full App Home leaves out, and where to see them."""
    return f"… and {count} more: {where} shows them all."


def home_recent_row(job: Job, now: datetime) -> str:
    """Mrkdwn: one of the person's recent jobs; what they typed is escaped."""
    return (
        f"`{job.short_id}` *{escape(job.name)}* on {escape(job.backend)} · "
        f"{STATE_LABELS[job.state]} · {age(job, now)} ago"
    )


# --- leases (bot/leases.py) ------------------------------------------------------------


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


def lease_extended_answer(job: Job) -> str:
    end = job.lease_end
    shown = when(end) if end is not None else "no end"
    return f"The lease of {job.name} (job {job.short_id}) now ends {shown}."


def lease_reminder(job: Job, end: datetime, now: datetime, grace: str, zone: tzinfo) -> str:
    """Plain: the reminder by direct message (the buttons say what to do)."""
    hours = max(0, round((end - now).total_seconds() / 3600))  # "about": rounded
    left = (
        f"{round(hours / 24)} days"
        if hours >= 48
        else f"{hours} hours"
        if hours >= 2
        else "an hour"
    )
    return (
        f"Your VM {job.name} ({job.final_address or job.address} on {job.backend}) expires "
        f"{when(end, zone)}, in about {left}. Then it is powered off, and destroyed {grace} "
        f"later. Extend it if you still need it (or `/deploy lease extend {job.name} 7d`), "
        "or destroy it now if you are done."
    )


def lease_thread(job: Job, step: str, moment: datetime | None, by: str, zone: tzinfo) -> str:
    """Plain: a lease step as a line in the VM's thread (and, when it ended, the DM)."""
    at = when(moment, zone) if moment is not None else "now"
    if step == "expired":
        return (
            f":zzz: The lease of {job.name} ended: VM {job.vm_id} is powered off, not "
            f"destroyed. It will be destroyed {at} unless extended: "
            f"`/deploy lease extend {job.name} 7d`."
        )
    if step == "untouched":
        return (
            f"The lease of {job.name} ended, but VM {job.vm_id} no longer carries "
            "deploybot's tag (changed by hand), so it was left running. Put the tag back "
            f"to let deploybot power it off and destroy it {at}, or remove it by hand."
        )
    if step == "destroying":
        return (
            f"The lease of {job.name} ended and its grace period is over: destroying VM "
            f"{job.vm_id}."
        )
    if step == "extended":
        return f"Lease extended by {by}: {job.name} now expires {at}."
    return f"Reminder sent to {job.requester}: the lease of {job.name} ends {at}."


def lease_hint(policy: LeaseSettings) -> str:
    return (
        f"Like 7d or 12h, up to {show_length(policy.max)}; empty: "
        f"{show_length(policy.default)} here. Extend it later if you need more."
    )


def lease_field_error(policy: LeaseSettings) -> str:
    return (
        f"Give a length from 1m up to {show_length(policy.max)} (the maximum here), like 7d; "
        "extend it later if you need more."
    )
