"""The migration plan: every object of the source in scope with what it becomes, the
count per category, and the digest of the source facts it was made from.

The digest is the sha256 of a canonical JSON (sorted keys, no spaces, UTF-8) of the
source's name, the scope and the facts read (`TemplateFacts`, and `VMFacts` when the
source has VMs, each sorted by id; each with its vSphere tags when they were read): an apply
reads the same scope again and compares, so a source that changed since the plan is
refused rather than acted on (`source_unchanged`). The plan file holds the whole plan
as JSON (0600: it names machines); `read_plan` reads it back and refuses one whose facts
no longer hash to its digest (edited or damaged). The digest covers the source's facts
only; the document's `seal` (the sha256 of the canonical document without the seal)
covers the rest too: when it was made, its target, its findings, the target's
templates. The seal is not a signature (anyone may compute it again): it refuses a file
damaged or edited by hand without care, and the apply still classifies the facts again
(bot/migration/apply.py check_findings) and refuses a date in the future.

VMs are findings of kind "vm" with facts of their own (bot/migration/vms.py), under the
same digest and counts per kind (`CATEGORIES`). A plan without VMs (an OVA, or a
scope with none) digests exactly as one made before VMs were read.

A plan whose tags were not read (unreadable then, or made before tags were read) is
compared without them: the facts read again lose their tags first (`read_again`), so
tags readable now do not make every object "changed". A plan made with tags needs
them read again (`tags_read_again`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from backends.building import TemplateVersion
from backends.migrating import (
    ReadOnlySource,
    Scope,
    TemplateFacts,
    VMFacts,
    template_facts_of,
    vm_facts_of,
)
from bot.addresses.subnets import Subnet
from bot.images.profiles import Profile
from bot.migration.classify import (
    Category,
    Finding,
    MatchedBy,
    Missing,
    Note,
    NoteKind,
    classify_template,
)
from bot.migration.vms import classify_vm, network_map
from bot.models import utcnow
from bot.models.errors import UserError

FORMAT = "deploybot-migration-plan/1"


class PlanFileError(UserError):
    """A plan file that cannot be used: unreadable, not a plan, or not what its digest
    says (edited or damaged). The message says which and that a new plan is needed."""


# The categories of each kind of finding, in the order they are shown.
CATEGORIES: dict[str, tuple[Category, ...]] = {
    "template": (Category.REBUILDABLE, Category.ON_TARGET, Category.NOT_MAPPABLE),
    "vm": (Category.MOVES_AS_IS, Category.NEEDS_DECISIONS, Category.BLOCKED),
}


@dataclass(frozen=True)
class Plan:
    source: str  # the backend's name, or the OVA's URL
    target: str
    scope: Scope
    made_at: datetime
    facts: tuple[TemplateFacts, ...]
    findings: tuple[Finding, ...]
    digest: str  # sha256:<hex> of the source facts (`source_digest`)
    # The target's current templates deploybot built: (name, profile, build version).
    # Shown beside the source's counts; not a fact of the source, so not digested.
    target_templates: tuple[tuple[str, str, int], ...] = ()
    vm_facts: tuple[VMFacts, ...] = ()  # digested with `facts`
    # Why the source's tags could not be read (their absence is in the digest: the
    # facts' tags are None), else None.
    tags_unreadable: str | None = None

    def counts(self) -> dict[str, dict[str, int]]:
        """Per kind, the number of objects in each category (every category named)."""
        counts = {kind: {c.value: 0 for c in shown} for kind, shown in CATEGORIES.items()}
        for finding in self.findings:
            counts[finding.kind][finding.category.value] += 1
        return counts

    def document(self) -> dict[str, Any]:
        """The plan as JSON data, sealed: what the plan file holds and `--json` prints."""
        body = {
            "format": FORMAT,
            "made_at": self.made_at.isoformat(),
            "source": self.source,
            "target": self.target,
            "scope": asdict(self.scope),
            "source_digest": self.digest,
            "counts": self.counts(),
            "findings": [_finding_json(f) for f in self.findings],
            "facts": [f.as_json() for f in self.facts],
            "vm_facts": [f.as_json() for f in self.vm_facts],
            "target_templates": [list(t) for t in self.target_templates],
        }
        if self.tags_unreadable is not None:
            body["tags_unreadable"] = self.tags_unreadable
        return {**body, "seal": seal_of(body)}


def _finding_json(finding: Finding) -> dict[str, Any]:
    data = asdict(finding)
    data["notes"] = [
        {"kind": n.kind.value, "value": n.value, **({"detail": list(n.detail)} if n.detail else {})}
        for n in finding.notes
    ]
    return {k: (v.value if hasattr(v, "value") else v) for k, v in data.items()}


def canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal_of(document: Mapping[str, Any]) -> str:
    """The sha256 of a plan document's canonical JSON, its own seal left out."""
    body = {k: v for k, v in document.items() if k != "seal"}
    return "sha256:" + hashlib.sha256(canonical(body)).hexdigest()


def source_digest(
    source: str, scope: Scope, facts: Sequence[TemplateFacts], vms: Sequence[VMFacts] = ()
) -> str:
    ordered = sorted(facts, key=lambda f: (f.source_id, f.name))
    data: dict[str, Any] = {
        "source": source,
        "scope": asdict(scope),
        "facts": [f.as_json() for f in ordered],
    }
    if vms:  # absent, not empty, without VMs: a templates-only plan keeps its digest
        ordered_vms = sorted(vms, key=lambda f: (f.source_id, f.name))
        data["vms"] = [_digested(f) for f in ordered_vms]
    return "sha256:" + hashlib.sha256(canonical(data)).hexdigest()


def _digested(vm: VMFacts) -> dict[str, Any]:
    """A VM's facts as digested: all but whether VMware Tools runs right now, which a
    reboot of the guest flips without changing what the plan says of it."""
    data = vm.as_json()
    del data["tools_status"]
    return data


def classify(
    source: str,
    target: str,
    scope: Scope,
    facts: Sequence[TemplateFacts],
    profiles: Mapping[str, Profile],
    target_versions: Sequence[TemplateVersion],
    made_at: datetime,
    vms: Sequence[VMFacts] = (),
    subnets: Sequence[Subnet] = (),
    storage_type: str | None = None,
    tags_unreadable: str | None = None,
) -> Plan:
    """The plan of `facts` and `vms` (pure: the reads happened before). `subnets` say
    where each VM's networks go on the target; `storage_type` is the type of the target
    storage its disks would land on, when known; `tags_unreadable` why the source's tags
    could not be read."""
    networks = network_map(subnets, source, target)
    findings = tuple(classify_template(f, profiles, target_versions) for f in facts) + tuple(
        classify_vm(v, networks, storage_type) for v in vms
    )
    return Plan(
        source,
        target,
        scope,
        made_at,
        tuple(facts),
        findings,
        source_digest(source, scope, facts, vms),
        tuple(sorted((v.name, v.profile, v.version) for v in target_versions if v.current)),
        tuple(vms),
        tags_unreadable,
    )


async def make_plan(
    source: ReadOnlySource,
    target_name: str,
    target_versions: Sequence[TemplateVersion],
    profiles: Mapping[str, Profile],
    scope: Scope,
    now: datetime | None = None,
    subnets: Sequence[Subnet] = (),
    storage_type: str | None = None,
) -> Plan:
    """Read the source (read-only) and classify what it holds. `target_versions`: the
    templates deploybot built on the target (`BuildsTemplates.template_versions`)."""
    facts = await source.template_facts(scope)
    vms = await source.vm_facts(scope)
    made_at = now or utcnow()
    return classify(
        source.name, target_name, scope, facts, profiles, target_versions, made_at,
        vms, subnets, storage_type, source.tags_unreadable,
    )  # fmt: skip


def write_plan(plan: Plan, path: Path) -> None:
    """The plan file, made 0600 before anything is written to it; replaced whole. The
    temporary file is a new one of a name nobody could guess (mkstemp: O_EXCL, so never
    a file or link someone left there), beside the plan so the replace is atomic."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temporary = Path(name)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(plan.document(), out, indent=2, sort_keys=True, ensure_ascii=False)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_plan(path: Path) -> Plan:
    """The plan a file holds, whose facts must still hash to its digest: a plan edited
    or damaged since it was written is refused, as a source that changed would be."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"plan file {path}: cannot read it ({exc})") from None
    return plan_from_document(data, f"plan file {path}")


def plan_from_document(data: Any, where: str) -> Plan:
    """The plan a document holds (a plan file's, or one kept in the store: `where` names
    it in the refusal), refused like `read_plan` when it does not hash to its digest."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{where}: not a deploybot migration plan ({FORMAT})")
    try:
        plan = _from_document(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanFileError(f"{where}: damaged ({exc!r}); make a new plan") from None
    if source_digest(plan.source, plan.scope, plan.facts, plan.vm_facts) != plan.digest:
        raise PlanFileError(
            f"{where}: its facts do not match its digest (edited or damaged); make a new plan"
        )
    if data.get("seal") != seal_of(data):
        raise PlanFileError(
            f"{where}: its content does not match its seal (edited or damaged: its date, "
            "target or findings changed since it was made); make a new plan"
        )
    return plan


async def source_unchanged(plan: Plan, source: ReadOnlySource) -> bool:
    """Whether `source` (opened again, read-only) still holds what the plan read: the
    same scope read again gives the same digest (and the tags, when the plan read
    them, could be read again)."""
    facts, vms = await read_again(plan, source)
    if not tags_read_again(plan, source):
        return False
    return source_digest(plan.source, plan.scope, facts, vms) == plan.digest


def read_tags(plan: Plan) -> bool:
    """Whether the plan was made with its objects' tags read."""
    if plan.tags_unreadable is not None:
        return False
    tags = [f.tags for f in plan.facts] + [v.tags for v in plan.vm_facts]
    return any(t is not None for t in tags)


def tags_read_again(plan: Plan, source: ReadOnlySource) -> bool:
    """After `read_again`: false when the plan read tags and the source could not now."""
    return not read_tags(plan) or source.tags_unreadable is None


async def read_again(
    plan: Plan, source: ReadOnlySource
) -> tuple[list[TemplateFacts], list[VMFacts]]:
    """The plan's scope of `source` read again, as the plan read it: without tags when
    the plan has none (they are compared only when the plan read them)."""
    facts = await source.template_facts(plan.scope)
    vms = await source.vm_facts(plan.scope)
    if read_tags(plan):
        return facts, vms
    return [replace(f, tags=None) for f in facts], [replace(v, tags=None) for v in vms]


def _from_document(data: dict[str, Any]) -> Plan:
    facts = tuple(template_facts_of(f) for f in data["facts"])
    scope = data["scope"]
    return Plan(
        source=str(data["source"]),
        target=str(data["target"]),
        scope=Scope(folder=scope.get("folder"), name=scope.get("name")),
        made_at=datetime.fromisoformat(data["made_at"]),
        facts=facts,
        findings=tuple(_finding(f) for f in data["findings"]),
        digest=str(data["source_digest"]),
        target_templates=tuple(
            (str(n), str(p), int(v)) for n, p, v in data.get("target_templates", ())
        ),
        vm_facts=tuple(vm_facts_of(f) for f in data.get("vm_facts", ())),
        tags_unreadable=_text_or_none(data.get("tags_unreadable")),
    )


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _finding(f: dict[str, Any]) -> Finding:
    matched, missing = f.get("matched_by"), f.get("missing")
    kind, category = str(f["kind"]), Category(f["category"])
    if category not in CATEGORIES.get(kind, ()):  # an unknown kind has none
        raise ValueError(f"a finding of kind {kind!r} in category {category.value!r}")
    return Finding(
        kind=kind,
        source_id=str(f["source_id"]),
        name=str(f["name"]),
        category=category,
        profile=f.get("profile"),
        matched_by=MatchedBy(matched) if matched else None,
        evidence=str(f.get("evidence", "")),
        target_name=f.get("target_name"),
        target_version=f.get("target_version"),
        missing=Missing(missing) if missing else None,
        detail=tuple(str(d) for d in f.get("detail", ())),
        notes=tuple(
            Note(NoteKind(n["kind"]), str(n["value"]), tuple(str(d) for d in n.get("detail", ())))
            for n in f.get("notes", ())
        ),
    )
