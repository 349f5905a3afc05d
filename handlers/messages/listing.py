"""`/deploy list` (split from handlers/messages/core.py): its title, its rows in Slack and
as a table for the shell and the CLI, each VM's age and lease end."""

from __future__ import annotations

from datetime import UTC, datetime, tzinfo

from bot.app.queries import VMPage
from bot.models import Job, JobState
from handlers.messages.text import STATE_LABELS, escape, mention, when


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


def list_row(job: Job, now: datetime, zone: tzinfo = UTC) -> str:
    """Mrkdwn: one VM of `/deploy list` (Slack), its lease end in the reader's `zone`;
    what people typed is escaped."""
    address = job.final_address or job.address
    where = escape(f"{job.name}")
    return (
        f"*{where}* `{address}` on {escape(job.backend)} · {age(job, now)} old · "
        f"lease end {lease_cell(job, zone)} · {STATE_LABELS[job.state]} · job {job.short_id} · "
        f"{mention(job.requester)}"
    )


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


def lease_cell(job: Job, zone: tzinfo = UTC) -> str:
    """`/deploy list`'s lease end (the shell, the CLI: UTC): a time, "never", or
    LEASE_NONE before ready."""
    end = job.lease_end
    if end is not None:
        return when(end, zone)
    if job.state in (JobState.SUCCEEDED, JobState.EXPIRED_OFF) and job.lease_s is None:
        return "never"
    return LEASE_NONE
