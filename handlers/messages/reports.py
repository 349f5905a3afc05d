"""The answers to the read-only commands (split from handlers/messages/core.py): `/deploy
status`, `history` and `templates`."""

from __future__ import annotations

from collections.abc import Sequence

from backends.base import Template
from backends.building import TemplateVersion
from bot.app.queries import JobStatus
from bot.models import Job, JobEvent, JobState
from handlers.messages.core import headline, nics_line
from handlers.messages.text import STATE_LABELS, Said, step_label


def status(info: JobStatus) -> list[str]:
    return [said.text for said in status_said(info)]


def status_said(info: JobStatus) -> list[Said]:
    """`status`, each line with the people it names from the records (the requester;
    who decided; who asked for the destroy and who approved it)."""
    job, approval = info.job, info.approval
    lines = [
        Said(f"Job {job.id}: {headline(job)} (requested by {job.requester})", (job.requester,))
    ]
    if approval and approval.decided_by:
        verb = approval.state.value
        when = f"{approval.decided_at:%H:%M}"
        lines.append(Said(f"  {verb} by {approval.decided_by} at {when}", (approval.decided_by,)))
    if job.destroy_by and job.destroy_asked_at:
        approved = f", approved by {job.destroy_approver}" if job.destroy_approver else ""
        gone = f"; gone at {job.destroyed_at:%H:%M} UTC" if job.destroyed_at else ""
        asked = f"  destroy asked by {job.destroy_by} at {job.destroy_asked_at:%Y-%m-%d %H:%M} UTC"
        people = tuple(p for p in (job.destroy_by, job.destroy_approver) if p)
        lines.append(Said(f"{asked}{approved}{gone}", people))
    lines.extend(Said(f"  {_event_line(e)}") for e in info.events)
    if job.ssh_line and job.state is JobState.SUCCEEDED:
        lines.append(Said(f"  {job.ssh_line}"))
    nics = nics_line(job)
    if nics:
        lines.append(Said(f"  {nics}"))
    if job.error and job.state is not JobState.SUCCEEDED:
        lines.append(Said(f"  reason: {job.error}"))
    if job.wreckage:
        lines.append(Said(f"  left behind: {job.wreckage}"))
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
    return [HISTORY_HEADER, *(history_line(job) for job in jobs)]


HISTORY_HEADER = f"{'job':<8} {'when':<16} {'who':<10} {'name':<14} {'address':<15} state"


def history_line(job: Job) -> str:
    """One row of `history` (the CLI prints them a page at a time)."""
    return (
        f"{job.short_id:<8} {job.created_at:%Y-%m-%d %H:%M} {job.requester:<10.10} "
        f"{job.name:<14.14} {_addresses(job):<15} {STATE_LABELS[job.state]}"
    )


def _addresses(job: Job) -> str:
    """The first NIC's address, and how many NICs more ("10.0.0.50 +2")."""
    more = len(job.request.nics)
    return f"{job.address} +{more}" if more else job.address


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
