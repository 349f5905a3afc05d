"""Texts of the day-2 life cycle: quotas, the App Home, VM leases."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, tzinfo

from bot.leases.terms import LeaseSettings, show_length
from bot.models import Job
from bot.requests.quotas import NAMES as QUOTA_NAMES
from bot.requests.quotas import Standing
from bot.requests.quotas import amount as quota_amount
from bot.sshca.certificates import read_certificate
from handlers.messages.listing import age
from handlers.messages.text import STATE_LABELS, Said, escape, when

# --- quotas (bot/requests/quotas.py) --------------------------------------------------------------


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


def home_more(count: int, where: str) -> str:
    """Plain: the rows a full App Home leaves out, and where to see them."""
    return f"… and {count} more: {where} shows them all."


def home_recent_row(job: Job, now: datetime) -> str:
    """Mrkdwn: one of the person's recent jobs; what they typed is escaped."""
    return (
        f"`{job.short_id}` *{escape(job.name)}* on {escape(job.backend)} · "
        f"{STATE_LABELS[job.state]} · {age(job, now)} ago"
    )


# --- leases (bot/leases/enforce.py) ------------------------------------------------------------


def lease_extended_answer(job: Job, zone: tzinfo = UTC) -> str:
    """The new end, in the reader's zone (Slack: theirs; the shell and CLI: UTC)."""
    end = job.lease_end
    shown = when(end, zone) if end is not None else "no end"
    said = f"The lease of {job.name} (job {job.short_id}) now ends {shown}."
    return f"{said} {certificate_end(job, zone)}".rstrip()


def certificate_end(job: Job, zone: tzinfo = UTC) -> str:
    """After an extension: whether the VM's host certificate now holds as long (signed
    again and installed) or still ends at its old date (a backend that cannot install
    one in a running guest, an install that failed); nothing for a VM without one."""
    info = read_certificate(job.host_certificate) if job.host_certificate else None
    end = job.lease_end
    if info is None or end is None:
        return ""
    if info.valid_before >= end - timedelta(minutes=1):
        return "Its host certificate was renewed to the same end."
    return (
        f"Its host certificate still ends {when(info.valid_before, zone)}: after that ssh "
        f"trusts its key only through its own known_hosts line (`/deploy known-hosts "
        f"{job.name}`)."
    )


def lease_reminder(job: Job, end: datetime, now: datetime, grace: str, zone: tzinfo) -> str:
    """Plain: the reminder by direct message (the buttons say what to do)."""
    return (
        f"Your VM {job.name} ({job.final_address or job.address} on {job.backend}) expires "
        f"{when(end, zone)}, {time_left(end - now)}. Then it is powered off, and destroyed {grace} "
        f"later. Extend it if you still need it (or `/deploy lease extend {job.name} 7d`), "
        "or destroy it now if you are done."
    )


def time_left(left: timedelta) -> str:
    """How long until a lease ends, rounded as people say it: "in about 3 days", "in
    about 20 minutes", "in less than a minute"."""
    minutes = max(0, round(left.total_seconds() / 60))
    hours = round(minutes / 60)
    if hours >= 48:
        return f"in about {round(hours / 24)} days"
    if hours >= 2:
        return f"in about {hours} hours"
    if minutes >= 45:
        return "in about an hour"
    if minutes >= 2:
        return f"in about {minutes} minutes"
    return "in about a minute" if minutes == 1 else "in less than a minute"


def lease_thread(job: Job, step: str, moment: datetime | None, by: str, zone: tzinfo) -> Said:
    """A lease step as a line in the VM's thread (and, when it ended, the DM); `by`
    extended it."""
    return Said(_lease_line(job, step, moment, by, zone), _lease_people(job, step, by))


def _lease_people(job: Job, step: str, by: str) -> tuple[str, ...]:
    if step == "extended":
        return (by,)
    if step in ("expired", "untouched", "destroying"):
        return ()
    return (job.requester,)  # "Reminder sent to ..."


def _lease_line(job: Job, step: str, moment: datetime | None, by: str, zone: tzinfo) -> str:
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
