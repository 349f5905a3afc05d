"""What `deploybot migrate plan` says: the table of templates with the reason for each,
the count per category, the digest, and the reasons as JSON gets them."""

from __future__ import annotations

from typing import Any

from bot.migration.classify import Category, Finding, MatchedBy, Missing, Note, NoteKind
from bot.migration.plan import CATEGORIES, Plan

CATEGORY_WORDS = {
    Category.REBUILDABLE: "rebuild",
    Category.ON_TARGET: "on target",
    Category.NOT_MAPPABLE: "not mappable",
}
NOTE_WORDS = {
    NoteKind.DATASOURCE_PINNED: "cloud-init datasource pinned ({})",
    NoteKind.GUESTINFO: "cloud-init documents in guestinfo ({}), read by VMware's datasource only",
    NoteKind.VMWARE_NIC: "NIC {}: a VMware model (Proxmox guests boot virtio or e1000)",
    NoteKind.VMWARE_CONTROLLER: "disk controller {}: VMware's (Proxmox boots virtio-scsi)",
    NoteKind.VMWARE_INTERFACE: "notes name {}, a VMware interface name",
}


def reason(finding: Finding) -> str:
    """Why a finding is in its category, in one sentence."""
    if finding.category is Category.NOT_MAPPABLE:
        return _missing(finding)
    how = "its build mark" if finding.matched_by is MatchedBy.BUILD_MARK else finding.evidence
    if finding.category is Category.ON_TARGET:
        return (
            f"profile {finding.profile} (from {how}) is on the target already as "
            f"{finding.target_name} (build v{finding.target_version})"
        )
    return f"rebuild from profile {finding.profile} (from {how})"


def _missing(finding: Finding) -> str:
    detail = finding.detail
    if finding.missing is Missing.UNKNOWN_PROFILE:
        return (
            f"its build mark names profile {detail[0]}, which this installation lacks "
            f"(has: {', '.join(detail[1:]) or 'none'}): add [images.profiles.{detail[0]}]"
        )
    if finding.missing is Missing.UNKNOWN_OS:
        return (
            f"no build profile is for its guest OS (guest id {detail[0] or 'unset'}); "
            f"profiles exist for {', '.join(detail[1:])}: add a profile for it"
        )
    if finding.missing is Missing.NO_VERSION:
        return (
            f"guest OS {detail[0]}, but neither its guest id, name nor annotation names a "
            f"release of {', '.join(detail[1:])}: write the release in its annotation "
            "(e.g. 'Debian 12') or add a profile for it"
        )
    return f"several profiles fit ({', '.join(detail)}): write one release in its annotation"


def note_text(note: Note) -> str:
    return NOTE_WORDS[note.kind].format(note.value)


def plan_lines(plan: Plan, written_to: str | None) -> list[str]:
    scope = [f"folder {plan.scope.folder}" if plan.scope.folder else "", plan.scope.name or ""]
    where = ", ".join(s for s in scope if s)
    lines = [
        f"Migration plan (dry run, nothing changed): {plan.source} -> {plan.target}"
        + (f" ({where})" if where else ""),
    ]
    if not plan.findings:
        lines.append("  No template in scope.")
    for finding in sorted(
        plan.findings, key=lambda f: (CATEGORIES[f.kind].index(f.category), f.name)
    ):
        lines.append(
            f"  {finding.name:<24} {CATEGORY_WORDS[finding.category]:<13} {reason(finding)}"
        )
        lines += [
            f"  {'':<24} {'':<13}   not imported as is: {note_text(n)}" for n in finding.notes
        ]
    lines.append(count_line(plan))
    lines.append(target_line(plan))
    lines.append(f"Source digest {plan.digest}.")
    if written_to:
        lines.append(f"Plan written to {written_to}.")
    else:
        lines.append("Not written: add --out FILE to keep the plan for an apply.")
    return lines


def count_line(plan: Plan) -> str:
    counts = plan.counts()["template"]
    parts = [f"{counts[c.value]} {CATEGORY_WORDS[c]}" for c in CATEGORIES["template"]]
    return f"Templates: {sum(counts.values())} in scope: {', '.join(parts)}."


def target_line(plan: Plan) -> str:
    built = plan.target_templates
    if not built:
        return f"Target {plan.target}: no template deploybot built."
    names = ", ".join(f"{name} ({profile} v{version})" for name, profile, version in built)
    return f"Target {plan.target}: {len(built)} template(s) deploybot built: {names}."


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan document with each finding's reason and notes worded."""
    document = plan.document()
    for data, finding in zip(document["findings"], plan.findings, strict=True):
        data["reason"] = reason(finding)
        data["notes_text"] = [note_text(n) for n in finding.notes]
    return document


def unknown_backend(option: str, name: str, known: list[str]) -> str:
    return f"{option} {name}: no such backend (configured: {', '.join(known) or 'none'})."


def plan_failed(problem: str) -> str:
    return f"migrate plan: {problem}. Nothing was changed, and no plan was written."


def plan_not_written(path: str, problem: str) -> str:
    return (
        f"--out {path}: cannot write the plan there ({problem}); give a path this user may write."
    )
