"""`migrate apply`: the templates of a plan rebuilt on the target, through the build kind.

An apply acts on a plan only while it is true: made within `[migration] plan_valid_s`
(`check_age`) and of a source that still holds what the plan read (`check_source`: the
same scope read again through the read-only source, its digest compared; a changed
source is refused with what changed). Then each profile the plan's rebuildable
templates map to gets one template build on the target (bot/kinds/build/: its
pre-flight, smoke deploy, approval policy and queue, exactly as `template build`):
templates of one profile share its build, since building a profile twice makes the same
template twice. Never an import of the source's disk.

It is idempotent: a profile with a build on the target in flight (the store's
`builds`), or whose template the target holds (its build marks), is not built again; a
published build whose template was removed since is built again; two applies at once are
kept apart by the store's one-build-in-flight-per-name index.
What the apply did and what is left are data (`Applied`, `Outcome`); the words are
handlers/messages/migration.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from backends.building import TemplateVersion
from backends.migrating import ReadOnlySource, TemplateFacts, VMFacts
from bot.addresses.subnets import Subnet
from bot.images.profiles import Profile
from bot.migration.classify import Category, Finding, classify_template
from bot.migration.plan import (
    CATEGORIES,
    Plan,
    PlanFileError,
    read_again,
    source_digest,
    tags_read_again,
)
from bot.migration.vms import classify_vm, network_map
from bot.models.builds import ACTIVE_BUILD_STATES, Build, BuildState
from bot.models.errors import Conflict, UserError

# How far a plan's date may lie ahead of this clock (another process's clock, a little
# fast) before the plan is refused as edited.
CLOCK_SKEW_S = 300.0

# How a build can end without a template.
UNBUILT = frozenset(
    {BuildState.FAILED, BuildState.CANCELLED, BuildState.REJECTED, BuildState.EXPIRED}
)


class PlanTooOld(UserError):
    """A plan made longer ago than `[migration] plan_valid_s`: plan again."""


class SourceChanged(UserError):
    """The source no longer holds what the plan read: plan again."""


@dataclass(frozen=True)
class Changes:
    """What differs between the plan's facts and the source read again, by name."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rebuild:
    """One profile the plan's rebuildable templates map to, and its build."""

    profile: str
    templates: tuple[str, ...]  # the source templates it stands for
    build: Build | None = None  # the build started, or the one found in flight/published
    started: bool = False  # this apply started `build` (False: it was there already)
    on_target: str | None = None  # the target holds it already (its template's name)
    on_target_version: int | None = None  # and that template's build version
    refused: str | None = None  # why no build could be asked for (the build kind's words)

    @property
    def ended(self) -> bool:
        """Nothing more will happen to it (no build, or one no longer in flight)."""
        return self.build is None or self.build.state not in ACTIVE_BUILD_STATES


@dataclass(frozen=True)
class Applied:
    plan: Plan
    rebuilds: tuple[Rebuild, ...]
    # The store's record of an apply asked from chat with builds in flight (its id):
    # its end is told where it was asked once the last build ends (store/applies.py).
    recorded: str | None = None
    # An apply of the same plan asked in the same channel was under way already: this
    # one is told by its end (one table per plan and channel until it has ended).
    joined: bool = False


@dataclass(frozen=True)
class Count:
    """One category of the plan at both ends: how many the plan found on the source,
    and how many of those the target holds now (`target`: a template counts when the
    target holds its profile's template; None for VMs, which an apply never moves)."""

    kind: str  # "template" or "vm"
    category: Category
    source: int
    target: int | None


@dataclass(frozen=True)
class Outcome:
    """The end of an apply: the plan's counts on the source against the templates
    deploybot built on the target, by profile, and the rebuilds as they are now."""

    applied: Applied
    # profile -> (template name, build version) of the target's current templates
    target: Mapping[str, tuple[str, int]]

    @property
    def rebuilds(self) -> tuple[Rebuild, ...]:
        return self.applied.rebuilds

    def wanted(self) -> set[str]:
        """The profiles the plan's templates that migrate (rebuildable, on target) need."""
        return {
            f.profile
            for f in self.applied.plan.findings
            if f.kind == "template"
            and f.profile is not None
            and f.category in (Category.REBUILDABLE, Category.ON_TARGET)
        }

    def missing(self) -> set[str]:
        """Profiles the migrating templates need that the target does not hold yet."""
        return self.wanted() - set(self.target)

    def failed(self) -> list[Rebuild]:
        """Rebuilds that were refused, or whose build ended without a template."""
        return [
            r
            for r in self.rebuilds
            if r.refused or (r.build is not None and r.build.state in UNBUILT)
        ]

    def counts(self) -> tuple[Count, ...]:
        """Every category of the plan (templates, then VMs), source against target,
        counted per source template: two templates of one profile count twice."""
        findings = self.applied.plan.findings
        rows = []
        for category in CATEGORIES["template"]:
            found = [f for f in findings if f.kind == "template" and f.category is category]
            held = [f for f in found if f.profile is not None and f.profile in self.target]
            rows.append(Count("template", category, len(found), len(held)))
        for category in CATEGORIES["vm"]:
            moved = sum(1 for f in findings if f.kind == "vm" and f.category is category)
            rows.append(Count("vm", category, moved, None))
        return tuple(rows)

    def built(self) -> list[tuple[str, str, int]]:
        """The profiles the migrating templates need that the target holds now, as
        (profile, its template's name, its build version), by profile."""
        return [(p, *self.target[p]) for p in sorted(self.wanted()) if p in self.target]

    def left(self) -> list[Finding]:
        """The templates no apply can rebuild (not mappable), with their reasons."""
        return [f for f in self.applied.plan.findings if f.category is Category.NOT_MAPPABLE]


def check_findings(
    plan: Plan, profiles: Mapping[str, Profile], subnets: Sequence[Subnet] = ()
) -> None:
    """The digest covers the facts, not the findings: refuse a plan whose findings do
    not follow from its facts with this installation's profiles and subnets (its file
    edited to rebuild something else, or the configuration changed since). Every fact
    is classified again and must have exactly one finding, which says the same; no
    finding may stand without its fact. So an apply builds only what the facts it
    re-checks on the source call for."""
    networks = network_map(subnets, plan.source, plan.target)
    now = [classify_template(f, profiles, []) for f in plan.facts]
    now += [classify_vm(v, networks) for v in plan.vm_facts]
    found: dict[tuple[str, str, str], list[Finding]] = {}
    for finding in plan.findings:
        found.setdefault((finding.kind, finding.source_id, finding.name), []).append(finding)
    for fresh in now:
        said = found.pop((fresh.kind, fresh.source_id, fresh.name), [])
        if len(said) != 1 or not _same_finding(fresh, said[0]):
            _refuse_finding(plan, fresh.name)
    for (_kind, _id, name), _said in sorted(found.items()):  # a finding without a fact
        _refuse_finding(plan, name)


def _same_finding(fresh: Finding, said: Finding) -> bool:
    """A template's profile and whether it migrates (rebuildable or on the target: that
    depends on the target's templates then); a VM's category."""
    if fresh.kind != "template":
        return said.category is fresh.category and said.profile is None
    return said.profile == fresh.profile and said.category in _MIGRATES[fresh.category]


_MIGRATES = {
    Category.REBUILDABLE: (Category.REBUILDABLE, Category.ON_TARGET),
    Category.ON_TARGET: (Category.REBUILDABLE, Category.ON_TARGET),
    Category.NOT_MAPPABLE: (Category.NOT_MAPPABLE,),
}


def _refuse_finding(plan: Plan, name: str) -> None:
    raise PlanFileError(
        f"The plan's finding for {name} does not follow from its facts (the plan was "
        "edited, or the build profiles or subnets changed since). Nothing was started: "
        f"make a new plan (migrate plan --from {plan.source} --to {plan.target}) and "
        "apply that."
    )


def check_age(plan: Plan, now: datetime, valid_s: float) -> None:
    """Refuse a plan older than `valid_s`, and one whose date cannot be true (no time
    zone, or later than now beyond the clocks' skew): it was edited."""
    made_at = plan.made_at
    if made_at.tzinfo is None or made_at.utcoffset() is None:
        raise PlanFileError(
            f"This plan's date ({made_at.isoformat()}) has no time zone, which deploybot "
            "never writes (the plan was edited). Nothing was started: make a new plan "
            f"(migrate plan --from {plan.source} --to {plan.target}) and apply that."
        )
    if made_at - now > timedelta(seconds=CLOCK_SKEW_S):
        raise PlanFileError(
            f"This plan says it was made at {made_at:%Y-%m-%d %H:%M %Z}, later than now "
            f"({now:%Y-%m-%d %H:%M %Z}); a plan from the future was edited. Nothing was "
            f"started: make a new plan (migrate plan --from {plan.source} --to "
            f"{plan.target}) and apply that."
        )
    age = now - made_at
    if age > timedelta(seconds=valid_s):
        raise PlanTooOld(
            f"This plan was made {_length(age.total_seconds())} ago "
            f"({plan.made_at:%Y-%m-%d %H:%M} UTC); a plan is valid for "
            f"{_length(valid_s)} ([migration] plan_valid_s). Nothing was started: make a "
            f"new plan (migrate plan --from {plan.source} --to {plan.target}) and apply that."
        )


async def check_source(plan: Plan, source: ReadOnlySource) -> None:
    """Read the plan's scope of the source again (read-only) and refuse the plan when
    its digest differs, naming what changed, or when the plan read tags and they could
    not be read now (whether one changed cannot be told)."""
    templates, vms = await read_again(plan, source)  # as the plan read it (plan.py)
    if not tags_read_again(plan, source):
        raise SourceChanged(
            f"The tags of {plan.source} could not be read now: {source.tags_unreadable}. "
            "This plan was made with them, so whether one changed since cannot be told. "
            f"Nothing was started: make a new plan (migrate plan --from {plan.source} "
            f"--to {plan.target}) and apply that."
        )
    if source_digest(plan.source, plan.scope, templates, vms) == plan.digest:
        return
    changes = compare([*plan.facts, *plan.vm_facts], [*templates, *vms])
    said = [
        *(f"{n} is new" for n in changes.added),
        *(f"{n} is gone" for n in changes.removed),
        *(f"{n} changed" for n in changes.changed),
    ]
    raise SourceChanged(
        f"The source {plan.source} changed since this plan was made ("
        + (", ".join(said[:10]) or "it was read differently")
        + (f" and {len(said) - 10} more" if len(said) > 10 else "")
        + f"). Nothing was started: make a new plan (migrate plan --from {plan.source} "
        f"--to {plan.target}) and apply that."
    )


Facts = TemplateFacts | VMFacts


def compare(before: Sequence[Facts], after: Sequence[Facts]) -> Changes:
    """By durable id (a VM whose configuration could not be read has none: by name)."""
    old = {(type(f).__name__, f.source_id or f.name): f for f in before}
    new = {(type(f).__name__, f.source_id or f.name): f for f in after}
    return Changes(
        added=tuple(sorted(new[i].name for i in new.keys() - old.keys())),
        removed=tuple(sorted(old[i].name for i in old.keys() - new.keys())),
        changed=tuple(sorted(new[i].name for i in new.keys() & old.keys() if new[i] != old[i])),
    )


def rebuilds_of(plan: Plan) -> list[Rebuild]:
    """The plan's templates that migrate, one entry per profile (sorted): the
    rebuildable ones, and those on the target at plan time (built again only if the
    target lost its template since)."""
    by_profile: dict[str, list[str]] = {}
    migrating = (Category.REBUILDABLE, Category.ON_TARGET)
    for finding in plan.findings:  # a VM's finding never rebuilds anything
        if finding.kind == "template" and finding.category in migrating and finding.profile:
            by_profile.setdefault(finding.profile, []).append(finding.name)
    return [Rebuild(p, tuple(sorted(names))) for p, names in sorted(by_profile.items())]


# Asks for one build of a profile on the plan's target (Builds.request, bound to the
# requester and where its progress goes).
RequestBuild = Callable[[str], Awaitable[Build]]


async def start(
    plan: Plan,
    request: RequestBuild,
    known: Sequence[Build],
    target: Sequence[TemplateVersion],
    again: Callable[[str], Awaitable[Sequence[Build]]],
) -> Applied:
    """Ask for a build of each profile the plan's templates need, unless one is in
    flight (`known`: the store's builds of these profiles on the target) or the target
    holds its template (`target`): a published build whose template is gone is built
    again. `again` reads a profile's builds anew after the store refused a second build
    in flight (another apply was first)."""
    done: list[Rebuild] = []
    for rebuild in rebuilds_of(plan):
        mine = [b for b in known if b.profile == rebuild.profile]  # newest first
        going = next((b for b in mine if b.state in ACTIVE_BUILD_STATES), None)
        built = next((b for b in mine if b.state is BuildState.PUBLISHED), None)
        there = _current(rebuild.profile, target)
        if going is not None:
            done.append(replace(rebuild, build=going))
        elif there is not None:  # with the build that made it, when this store knows it
            done.append(
                replace(rebuild, build=built, on_target=there.name, on_target_version=there.version)
            )
        else:  # never built, or built and since removed from the target
            done.append(await _ask(rebuild, request, again))
    return Applied(plan, tuple(done))


async def _ask(
    rebuild: Rebuild,
    request: RequestBuild,
    again: Callable[[str], Awaitable[Sequence[Build]]],
) -> Rebuild:
    try:
        return replace(rebuild, build=await request(rebuild.profile), started=True)
    except Conflict as exc:  # a build of that name is in flight: another apply's
        found = list(await again(rebuild.profile))
        if found:
            return replace(rebuild, build=found[0])
        return replace(rebuild, refused=exc.message)
    except UserError as exc:  # the build kind's refusal (profile, subnet, who may)
        return replace(rebuild, refused=exc.message)


def _current(profile: str, target: Sequence[TemplateVersion]) -> TemplateVersion | None:
    return next((v for v in target if v.profile == profile and v.current), None)


def target_profiles(target: Sequence[TemplateVersion]) -> dict[str, tuple[str, int]]:
    """The target's current templates deploybot built, by profile."""
    current = sorted((v for v in target if v.current), key=lambda v: v.name)
    return {v.profile: (v.name, v.version) for v in current}


async def refresh(applied: Applied, get: Callable[[str], Awaitable[Build | None]]) -> Applied:
    """The rebuilds with their builds as the store holds them now."""
    fresh = []
    for rebuild in applied.rebuilds:
        build = await get(rebuild.build.id) if rebuild.build is not None else None
        fresh.append(replace(rebuild, build=build or rebuild.build))
    return replace(applied, rebuilds=tuple(fresh))


def rebuilds_document(applied: Applied) -> list[dict[str, Any]]:
    """The rebuilds as JSON data, their builds by id (kept with an apply's record)."""
    return [
        {
            "profile": r.profile,
            "templates": list(r.templates),
            "build": r.build.id if r.build is not None else None,
            "started": r.started,
            "on_target": r.on_target,
            "on_target_version": r.on_target_version,
            "refused": r.refused,
        }
        for r in applied.rebuilds
    ]


async def rebuilds_from_document(
    document: Sequence[Mapping[str, Any]], get: Callable[[str], Awaitable[Build | None]]
) -> tuple[Rebuild, ...]:
    """`rebuilds_document` read back, each build as the store holds it now."""
    rebuilds = []
    for data in document:
        build = await get(str(data["build"])) if data.get("build") else None
        rebuilds.append(
            Rebuild(
                profile=str(data["profile"]),
                templates=tuple(str(t) for t in data["templates"]),
                build=build,
                started=bool(data["started"]),
                on_target=data.get("on_target"),
                on_target_version=data.get("on_target_version"),
                refused=data.get("refused"),
            )
        )
    return tuple(rebuilds)


def stored_target(applied: Applied) -> dict[str, tuple[str, int]]:
    """The target's templates of the apply's profiles as the store knows them, without
    asking the target: each profile's build that published, else the template the apply
    found there. (A template removed by hand since is not seen: `migrate apply` again
    asks the target.)"""
    held: dict[str, tuple[str, int]] = {}
    for rebuild in applied.rebuilds:
        build = rebuild.build
        if build is not None and build.state is BuildState.PUBLISHED:
            held[rebuild.profile] = (build.name, build.version)
        elif rebuild.on_target is not None:
            version = rebuild.on_target_version or (build.version if build else 0)
            held[rebuild.profile] = (rebuild.on_target, version)
    return held


async def wait_for_builds(
    applied: Applied,
    get: Callable[[str], Awaitable[Build | None]],
    settle: Callable[[], Awaitable[None]],
    changed: Callable[[Build], Awaitable[None]],
    poll_s: float,
) -> Applied:
    """Until every build of the apply has ended: `settle` waits for what runs here; a
    build run elsewhere (approved in chat, taken by a serving process) is read again
    every `poll_s`. `changed` hears each build whose state moved."""
    seen = {r.build.id: r.build.state for r in applied.rebuilds if r.build is not None}
    while True:
        await settle()
        applied = await refresh(applied, get)
        for rebuild in applied.rebuilds:
            build = rebuild.build
            if build is not None and seen.get(build.id) is not build.state:
                seen[build.id] = build.state
                await changed(build)
        if all(r.ended for r in applied.rebuilds):
            return applied
        await asyncio.sleep(poll_s)


def _length(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 1:
        return f"{int(seconds)} s"
    if minutes < 120:
        return f"{minutes} min"
    hours, rest = divmod(minutes, 60)
    return f"{hours} h {rest} min" if hours < 48 else f"{hours // 24} days"
