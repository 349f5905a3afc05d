"""Texts of the Slack front end."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from bot.models import Approval, ApprovalState, Job, JobState, RollbackReport, UserPrefs
from bot.operations.check import CheckResult
from bot.operations.gc import Finding, GcReport
from handlers.messages.core import address_of, approved, finished, headline, job_update
from handlers.messages.text import STATE_LABELS, Said, escape, mention, step_label

# --- Slack ------------------------------------------------------------------------
# Slack renders `<@U123>` as the person's name and `<!date^...>` in the reader's time zone.
# In Slack's mrkdwn `&`, `<` and `>` are markup: `<!channel>` pings everyone, `<@U123>`
# pings someone and `<https://x|y>` is a link. So text the bot did not write (a reason,
# a template name, an error that quotes what someone typed) is escaped before the bot
# adds its own markup. The functions below that add markup (mention, slack_time, bold)
# escape what they embed and return mrkdwn; the other texts here are plain, and the
# Slack front end escapes each as a whole (handlers/slack/views.mrkdwn). Texts that name
# people return a `Said`: the ids the bot put in, which alone become mentions.

FULL_COPY = "full copy: minutes, not seconds"
LINKED_CLONE = "fast linked clone: seconds"
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
    "nics": "More NICs (optional)",
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
    "nics": (
        "One NIC more per +ADDRESS or +SUBNET (its next free address), each in another "
        "subnet, e.g. {example}; a fixed MAC: mac=52:54:00:12:34:56 (first NIC), mac2=... "
        "(second)"
    ),
    "name": "Letters, digits and hyphens, e.g. web01",
    "keys": "Prefilled from your saved keys (`/deploy key ...` or `/deploy settings`).",
    "storage": "Leave empty to use the template's own storage.",
}
TEMPLATES_OVERFLOW = "There are {count} templates: type part of a name to find one."


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


def slack_thread_update(
    job: Job, note: str, approval: Approval | None, by: str | None = None
) -> Said:
    """A state change in the requester's thread; an approval names who decided, a note
    the person `by` who acted (bot.models.Notice.by)."""
    if job.state is JobState.AWAITING_APPROVAL:
        return Said(
            f"waiting for approval ({job.approval_reason}); the approvers have been asked. "
            f"Cancel with `/deploy cancel {job.id}`."
        )
    if approval is not None and approval.decided_by and job.state is JobState.QUEUED:
        return Said(approved(job, approval.decided_by), (approval.decided_by,))
    asker = job.destroy_by if job.state is JobState.DESTROY_REQUESTED else None
    return Said(job_update(job, note), tuple(p for p in (asker, by) if p))


def slack_finished(job: Job, rollback: RollbackReport | None) -> Said:
    """The end of the thread; a destroy's names who asked and who approved it."""
    lines = finished(job, rollback)
    text = "\n".join(f"`{ln.strip()}`" if ln.startswith("    ") else ln for ln in lines)
    if job.state is not JobState.DESTROYED:
        return Said(text)
    return Said(text, tuple(p for p in (job.destroy_by, job.destroy_approver) if p))


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


def approval_cancelled(note: str, by: str | None) -> Said:
    """The core's note names the canceller `by` (bot.models.Notice.by)."""
    said = note[:1].upper() + note[1:] if note else "Cancelled"
    return Said(f":no_entry_sign: {said} before a decision.", (by,) if by else ())


def key_saved(prefs: UserPrefs) -> str:
    count = len(prefs.ssh_keys)
    return (
        f"Saved. You have {count} SSH key{'s' if count != 1 else ''}; deploys that name no "
        "key log in with them. `/deploy settings` shows and edits them."
    )


def settings_saved(prefs: UserPrefs) -> str:
    template = prefs.default_template or "the configured default"
    return f"Settings saved: {len(prefs.ssh_keys)} SSH key(s), default template {template}."


def form_opened_elsewhere() -> str:
    return "The form could not be opened (it took too long); type `/deploy` again."


def missing_field(label: str) -> str:
    return f"{label} is required."


def reason_required() -> str:
    return "Say why, so the requester can fix the request."


def reject_question(job_id: str, noun: str) -> str:
    """Mrkdwn, atop the modal that asks for the reason; `noun`: what its kind calls
    one ("job", "build": bot/kinds/)."""
    return f"Reject {noun} {escape(job_id)}?"


def slack_reject_answer(job: Job) -> Said:
    """Slack shows the requester's id as a mention."""
    return Said(f"Job {job.id}: rejected; {job.requester} is told why.", (job.requester,))


def bad_ssh_key(problem: str) -> str:
    return f"SSH key: {problem}."


def name_in_flight(name: str, job_id: str) -> str:
    return f"{name} is already being deployed by job {job_id}: pick another name."


def subnet_choice(subnet: str, segment: str | None) -> str:
    """A subnet as the form lists it, with where its VMs go on the chosen backend:
    "10.0.20.0/24, vmbr0 VLAN 20"."""
    return f"{subnet}, {segment}" if segment else subnet


def address_in_flight(address: str, job_id: str) -> str:
    return f"{address} is already taken by job {job_id}: pick another address."


def token_missing(variable: str, what: str) -> str:
    return (
        f"{variable} is not set: put the {what} in the environment (see docs/slack.md, "
        "Slack set-up); deploybot serve did not start."
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
    "published_build": "template a build published (kept)",
    "job_in_flight": "job still in flight (kept)",
    "other_installation": "another installation's VM (kept)",
    "unknown_legacy": "old-style tag of a job unknown here (kept)",
    "quarantined_job": "job record damaged, set aside (kept: check it by hand)",
}


# In a deploy's thread when its command was carried out by another process, after the
# one that received it stopped before answering (bot/chat/inbox.py): Slack may have shown the
# person an error ("failed with the error ...") while the VM was being built.
COMMAND_RESUMED = (
    "This deploy was asked for while deploybot was restarting, and Slack may have shown "
    "an error then. The command was kept and is being carried out after all: follow it "
    "here, or cancel it with /deploy cancel JOB if it is no longer wanted."
)


# A command that came while the database did not answer (bot/chat/inbox.NotKept): refused
# within Slack's 3 s, and never carried out later (docs/operations.md: "When the database
# goes away").
STORE_NOT_ANSWERING = (
    "I can't record requests right now (the database is not answering); try again in a "
    "minute. Nothing was done with this command."
)


def gc_count(n: int, category: str) -> str:
    """`n` VMs of one category: "1 VM: job succeeded (kept)", "2 VMs: ..." (the labels
    describe one finding each, so the number counts the VMs, not the jobs)."""
    return f"{n} {'VM' if n == 1 else 'VMs'}: {GC_CATEGORIES[category]}"


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


def gc_holds_key(finding: Finding, forgotten: bool) -> str:
    where = f"VM {finding.vm.vm_id} ({finding.vm.name}) on {finding.backend}"
    if forgotten:
        return f"  host key: {where}: its private host key was removed from the hypervisor"
    return (
        f"  host key: {where} still keeps the private SSH host key deploybot chose in its "
        "stored cloud-config (anyone who can read the VM's settings can read it): "
        "`deploybot gc --apply` removes it"
    )


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
        parts = [gc_count(n, c) for c, n in sorted(counts.items())] or ["no tagged VMs"]
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
    for finding in report.holding_keys:
        lines.append(gc_holds_key(finding, report.applied and finding in report.keys_forgotten))
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
        label = "PROBLEM" if not result.ok else "WARNING" if result.warning else "ok"
        lines.append(f"{label:7}  {result.name}: {result.detail}")
        if result.fix:
            lines.append(f"         fix: {result.fix}")
    problems = sum(not r.ok for r in results)
    warnings = sum(r.ok and r.warning for r in results)
    verdict = f"{problems} problem(s)." if problems else "All checks passed."
    lines.append(verdict + (f" {warnings} warning(s): read them above." if warnings else ""))
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
