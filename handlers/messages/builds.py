"""What deploybot says about template builds (issue 17): their progress, their end, and
the tables of built templates and profiles."""

from __future__ import annotations

from backends.building import TemplateVersion
from bot.images import Profile
from bot.models.builds import Build, BuildState

__all__ = [
    "build_end",
    "build_headline",
    "build_started",
    "builds_table",
    "profiles_table",
    "template_versions_table",
]

BUILD_LABELS = {
    BuildState.AWAITING_APPROVAL: "waiting for approval",
    BuildState.QUEUED: "queued",
    BuildState.RUNNING: "building",
    BuildState.ROLLING_BACK: "rolling back",
    BuildState.PUBLISHED: "published",
    BuildState.FAILED: "failed",
    BuildState.CANCELLED: "cancelled",
    BuildState.REJECTED: "rejected",
    BuildState.EXPIRED: "expired",
    BuildState.RETIRED: "retired",
}


def build_headline(build: Build) -> str:
    return (
        f"template {build.versioned_name} ({build.profile}) on {build.backend}: "
        f"{BUILD_LABELS[build.state]}"
    )


def build_started(build: Build) -> str:
    return (
        f"build {build.id} of {build.profile} as {build.versioned_name} on {build.backend}, "
        f"asked by {build.requester}"
    )


def build_end(build: Build) -> list[str]:
    """The last lines of a build's thread: what it made, or why not and what is left."""
    if build.state is BuildState.PUBLISHED:
        return [
            f"Published: {build.name} is version {build.version} ({build.versioned_name}). "
            f"Deploy from it with template={build.name}."
        ]
    lines = [
        f"The build {BUILD_LABELS[build.state]} at {build.failed_step or 'its start'}: "
        f"{build.error or 'no reason recorded'}."
    ]
    if build.wreckage:
        lines.append(
            f"Left behind: {build.wreckage}. Remove it by hand, or run `deploybot gc` "
            "and follow what it lists."
        )
    else:
        lines.append("Everything it made was removed; fix the cause and build again.")
    return lines


def _when(build: Build) -> str:
    return build.created_at.strftime("%Y-%m-%d %H:%M")


def builds_table(builds: list[Build]) -> list[str]:
    if not builds:
        return ["No template builds yet: `deploybot template build PROFILE --backend B`."]
    lines = ["build     template              backend   state        asked             by"]
    for b in builds:
        lines.append(
            f"{b.short_id:<9} {b.versioned_name:<21} {b.backend:<9} "
            f"{BUILD_LABELS[b.state]:<12} {_when(b):<17} {b.requester}"
        )
    return lines


def template_versions_table(backend: str, versions: list[TemplateVersion]) -> list[str]:
    if not versions:
        return [f"{backend}: no template built by deploybot."]
    lines = [f"{backend}: template  profile  version  built  CPU baseline  current  used by"]
    for v in versions:
        built = v.built_at.strftime("%Y-%m-%d") if v.built_at else "-"
        used = ", ".join(v.used_by) or "-"
        lines.append(
            f"  {v.name}  {v.profile}  v{v.version}  {built}  {v.cpu or '-'}  "
            f"{'yes' if v.current else 'no'}  {used}"
        )
    return lines


def profiles_table(profiles: dict[str, Profile]) -> list[str]:
    lines = ["profile        OS         CPU baseline   user     image"]
    for name, p in sorted(profiles.items()):
        lines.append(
            f"{name:<14} {p.os_family + ' ' + p.version:<10} {p.cpu:<14} {p.user:<8} {p.file_name}"
        )
    return lines
