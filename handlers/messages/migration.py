"""What `migrate plan` and `migrate apply` say: the table of templates with the reason
for each, the count per category, the digest, the reasons as JSON gets them; a plan kept
for chat in a compact table with its id; what an apply started and, at its end, the
source's counts against the target's templates and what is left."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from bot.migration.apply import Outcome, Rebuild
from bot.migration.classify import Category, Finding, MatchedBy, Missing, Note, NoteKind
from bot.migration.plan import CATEGORIES, Plan
from bot.models.builds import Build, BuildState
from bot.models.plans import KeptPlan
from handlers.messages.builds import BUILD_LABELS

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
        lines.append("Not written: add --out FILE for a plan file.")
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


# --- a plan kept for chat -----------------------------------------------------------

CHAT_FINDINGS = 12  # the findings a chat answer shows (the rest are counted)
CHAT_REASON_CHARS = 90


def _cell(text: str, width: int) -> str:
    """Text from the source (names, notes) in a chat table: one line, no backticks (they
    would end the monospace block), cut to `width`."""
    flat = " ".join(text.replace("`", "'").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def kept_plan_lines(kept: KeptPlan, plan: Plan, valid_s: float) -> list[str]:
    """`/deploy migrate plan`: the counts, the first findings, and the plan's id."""
    lines = [
        f"Migration plan {kept.id} (dry run, nothing changed): {plan.source} -> {plan.target}",
        count_line(plan),
        target_line(plan),
    ]
    shown = sorted(plan.findings, key=lambda f: (CATEGORIES[f.kind].index(f.category), f.name))
    for finding in shown[:CHAT_FINDINGS]:
        lines.append(
            f"  {_cell(finding.name, 24):<24} {CATEGORY_WORDS[finding.category]:<13} "
            f"{_cell(reason(finding), CHAT_REASON_CHARS)}"
        )
    if len(shown) > CHAT_FINDINGS:
        lines.append(f"  ... and {len(shown) - CHAT_FINDINGS} more (the CLI's --json has all)")
    until = kept.created_at + timedelta(seconds=valid_s)
    lines.append(
        f"Apply it with `/deploy migrate apply {kept.id}` (approvers; until "
        f"{until:%Y-%m-%d %H:%M} UTC, while the source stays as it is)."
    )
    return lines


def plan_kept(kept: KeptPlan, valid_s: float) -> str:
    until = kept.created_at + timedelta(seconds=valid_s)
    return (
        f"Plan kept as {kept.id}: apply it with `deploybot migrate apply {kept.id}` (or the "
        f"file) or `/deploy migrate apply {kept.id}`, until {until:%Y-%m-%d %H:%M} UTC."
    )


# --- the apply --------------------------------------------------------------------------


def rebuild_line(rebuild: Rebuild) -> str:
    """One profile of the apply: its build (started, or found) or why there is none."""
    names = ", ".join(rebuild.templates)
    head = f"  {rebuild.profile:<16} for {names}:"
    if rebuild.refused:
        return f"{head} no build: {rebuild.refused}"
    if rebuild.on_target:
        return f"{head} on the target already as {rebuild.on_target}, not built again"
    build = rebuild.build
    assert build is not None
    said = "build started" if rebuild.started else "built or being built already, not again:"
    return f"{head} {said} {build.id} ({build.versioned_name}, {_state(build)})"


def _state(build: Build) -> str:
    if build.state is BuildState.AWAITING_APPROVAL:
        return f"waits for an approver: /deploy approve {build.id}"
    if build.state in (BuildState.FAILED, BuildState.CANCELLED, BuildState.REJECTED):
        return f"{BUILD_LABELS[build.state]}: {build.error or 'no reason recorded'}"
    return BUILD_LABELS[build.state]


def started_lines(outcome: Outcome) -> list[str]:
    """What the apply asked for, per profile, and the builds that wait for an approver."""
    plan = outcome.applied.plan
    lines = [f"Migration apply: {plan.source} -> {plan.target} (templates rebuilt, never imported)"]
    if not outcome.rebuilds:
        lines.append("  No template of the plan is to be rebuilt.")
    lines += [rebuild_line(r) for r in outcome.rebuilds]
    waiting = [
        r.build
        for r in outcome.rebuilds
        if r.build is not None and r.build.state is BuildState.AWAITING_APPROVAL
    ]
    if waiting:
        ids = " ".join(b.id for b in waiting)
        lines.append(
            f"{len(waiting)} build(s) wait for an approver (/deploy approve BUILD in Slack or "
            f"deploybot shell): {ids}."
        )
    return lines


def applied_lines(outcome: Outcome, *, ends: bool) -> list[str]:
    """What the apply asked for, then the source's counts against the target's and what
    is left (`ends`: every build has ended; chat answers at once, before they do)."""
    count = count_line(outcome.applied.plan)
    return [
        *started_lines(outcome),
        "Source " + count[0].lower() + count[1:],
        destination_line(outcome, ends=ends),
        *left_lines(outcome),
    ]


def destination_line(outcome: Outcome, *, ends: bool) -> str:
    plan = outcome.applied.plan
    wanted = sorted(outcome.wanted())
    held = [p for p in wanted if p in outcome.target]
    names = ", ".join(f"{p} ({outcome.target[p][0]} v{outcome.target[p][1]})" for p in held)
    when = "after the apply" if ends else "now"
    return (
        f"Target {plan.target} {when}: {len(held)} of the {len(wanted)} profile(s) the "
        f"migrating templates need" + (f": {names}." if names else ".")
    )


def left_lines(outcome: Outcome) -> list[str]:
    """What is left: templates no profile fits, builds that failed or were refused,
    profiles still being built."""
    lines: list[str] = []
    left = outcome.left()
    if left:
        lines.append(f"Left: {len(left)} template(s) not mappable (no build is started for them):")
        lines += [f"  {f.name}: {reason(f)}" for f in left]
    failed = outcome.failed()
    if failed:
        lines.append(f"Left: {len(failed)} profile(s) not built:")
        for rebuild in failed:
            why = rebuild.refused or (rebuild.build and _state(rebuild.build)) or ""
            lines.append(f"  {rebuild.profile} ({', '.join(rebuild.templates)}): {why}")
    going = [r for r in outcome.rebuilds if not r.ended]
    if going:
        lines.append(
            f"Under way: {len(going)} build(s); `migrate apply` again shows where they "
            "stand and starts nothing twice."
        )
    if not (left or failed or going):
        lines.append("Nothing is left: every template of the plan has its profile on the target.")
    return lines


def build_progress(build: Build) -> str:
    """A build of the apply moved (the CLI's progress)."""
    return f"  {build.profile}: build {build.short_id} {_state(build)}"


def apply_handed_off(outcome: Outcome) -> str:
    ids = " ".join(r.build.id for r in outcome.rebuilds if r.started and r.build is not None)
    return (
        f"Not waiting (--no-wait): a running `deploybot serve` takes the queued builds; "
        f"follow them with `deploybot template list` or `/deploy status BUILD`: {ids or 'none'}."
    )
