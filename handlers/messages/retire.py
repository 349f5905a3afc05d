"""What `deploybot template gc` says: per backend, each template deploybot built and
whether it may go, then what an apply removed and left."""

from __future__ import annotations

from bot.kinds.build.retire import KEPT_WHY, RetireReport, Verdict

CATEGORY_WORDS = {
    "retire": "older version, unused: may be retired",
    "failed_build": "its build failed or is unknown here: may be removed",
    **{k: f"kept: {v}" for k, v in KEPT_WHY.items()},
}


def _line(verdict: Verdict) -> str:
    v = verdict.version
    built = v.built_at.strftime("%Y-%m-%d") if v.built_at else "-"
    used = f", used by {', '.join(v.used_by)}" if v.used_by else ""
    return (
        f"  {verdict.backend}: {v.name} (template {v.vm_id}, {v.profile} v{v.version}, "
        f"built {built}{used}): {CATEGORY_WORDS[verdict.category]}"
    )


def retire_report(report: RetireReport, window_minutes: float) -> list[str]:
    lines = [f"{b}: could not list its templates: {why}" for b, why in report.unreachable.items()]
    if not report.verdicts:
        return [*lines, "No templates built by deploybot in scope."]
    if not report.applied:
        lines.extend(_line(v) for v in report.verdicts)
        count = sum(1 for v in report.verdicts if v.removable)
        if count:
            lines.append(
                f"{count} may go. To remove them, run `deploybot template gc --apply` with the "
                f"same scope within {window_minutes:g} minutes."
            )
        else:
            lines.append("Nothing to remove.")
        return lines
    for v in report.removed:
        lines.append(f"  removed {v.backend}: {v.version.name} ({v.version.vm_id})")
    lines.extend(f"  left {v.backend}: {v.version.name}: {why}" for v, why in report.left)
    lines.append(f"Removed {len(report.removed)}, left {len(report.left)}.")
    return lines
