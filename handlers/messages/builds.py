"""What deploybot says about template builds (issue 17): their progress, their end, and
the tables of built templates and profiles."""

from __future__ import annotations

from backends.building import TemplateVersion
from bot.images.profiles import Profile
from bot.models.builds import Build, BuildState
from bot.models.notices import BUILD_ASKED, BUILD_DECIDED, BUILD_STARTED
from handlers.messages.text import Said, escape, mention

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


def build_status(build: Build) -> list[Said]:
    """`/deploy status BUILD`: the headline (naming its requester), what it did so far,
    and its end; plain text, escaped by the front end that shows it."""
    first = f"{build_headline(build)} (build {build.id}, asked by {build.requester})"
    lines = [Said(first, (build.requester,))]
    lines += [Said(f"  {note}") for note in build.notes]
    if build.state.final or build.state is BuildState.PUBLISHED:
        lines += [Said(line) for line in build_end(build)]
    return lines


def build_cancelling(build: Build) -> str:
    """The answer to `/deploy cancel BUILD`."""
    if build.state is BuildState.CANCELLED:
        return f"Build {build.short_id} ({build.versioned_name}) is cancelled."
    return (
        f"Cancelling build {build.short_id} ({build.versioned_name}): it rolls back what "
        "it made; its thread says when it is done."
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


# --- template builds from chat (`/deploy template build`) ------------------------------


def build_accepted(build: Build) -> str:
    """The answer to `/deploy template build` (plain)."""
    what = f"Build {build.id} of {build.profile} as {build.versioned_name} on {build.backend}"
    if build.state is BuildState.AWAITING_APPROVAL:
        return (
            f"{what} waits for an approver ({build.approval_reason}); the approvers have "
            "been asked. Its progress follows in the thread."
        )
    return f"{what} is queued; its progress follows in the thread."


def build_thread_update(build: Build, part: str, note: str) -> Said:
    """A change of a build's state, in its thread: a decision names who decided."""
    text = _build_update(build, part, note)
    decided = part == BUILD_DECIDED and build.decided_by
    return Said(text, (build.decided_by,) if decided and build.decided_by else ())


def _build_update(build: Build, part: str, note: str) -> str:
    if part == BUILD_ASKED:
        if build.approval_reason and build.decided_by is None:
            return f"waiting for approval ({build.approval_reason}); the approvers have been asked."
        return f"queued: {build_started(build)}"
    if part == BUILD_DECIDED:
        if build.state is BuildState.EXPIRED:
            return "expired: nobody approved it in time. Ask again if it is still needed."
        if build.state is BuildState.REJECTED:
            return f"rejected by {build.decided_by}: {note or 'no reason given'}"
        return f"approved by {build.decided_by}: queued"
    if part == BUILD_STARTED:
        return "building"
    return note


def slack_build_end(build: Build) -> str:
    """The end of a build's thread (plain): published and how to deploy from it, or the
    cause and what was left."""
    return "\n".join(build_end(build))


def build_approval_needed(build: Build) -> str:
    """The approval card's notification text (plain)."""
    return f"Approval needed: template build {build.versioned_name} on {build.backend}"


def build_approval_summary(build: Build) -> str:
    """Mrkdwn: the build on the approval card, every value from the request escaped."""
    where = f"{build.backend}/{build.placement}" if build.placement else build.backend
    asks = escape(f"asks to build template {build.versioned_name} from {build.profile}")
    details = escape(
        f"storage {build.storage or 'the default'}; published as {build.name}, which "
        f"later deploys of template={build.name} use.\n"
        f"Needs approval because {build.approval_reason}. Build {build.id}."
    )
    return f"*{mention(build.requester)} {asks}* on {escape(where)}\n{details}"


def build_card_outcome(build: Build, note: str) -> str:
    """Mrkdwn: what replaces the card's buttons once the build is decided (the reason
    escaped, so `<!channel>` in it pings nobody)."""
    at = f"{build.decided_at:%H:%M} UTC" if build.decided_at else "an unknown time"
    if build.state is BuildState.EXPIRED:
        return ":hourglass: Expired: nobody approved it in time."
    if build.decided_by is None:
        return f"{BUILD_LABELS[build.state].capitalize()}: no decision was needed any more."
    if build.state is BuildState.REJECTED:
        reason = escape(note or build.error or "no reason")
        return f":x: Rejected by {mention(build.decided_by)}: {reason}"
    return f":white_check_mark: Approved by {mention(build.decided_by)} at {at}"


def build_decided_answer(build: Build) -> str:
    """The approver's answer after a decision (plain)."""
    verb = "Rejected" if build.state is BuildState.REJECTED else "Approved"
    return f"{verb} build {build.id} of {build.versioned_name}."


def build_context(build: Build) -> str:
    """Mrkdwn: the line under a build's parent message."""
    return f"build {build.short_id} · asked by {mention(build.requester)}"


def build_outcome_dm(build: Build) -> str:
    """The requester's direct message when their build ended (plain)."""
    return f"Your template build {build.id}: {build_headline(build)}. " + build_end(build)[0]
