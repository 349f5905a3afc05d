"""The migration plan: every object of the source in scope with what it becomes, the
count per category, and the digest of the source facts it was made from.

The digest is the sha256 of a canonical JSON (sorted keys, no spaces, UTF-8) of the
source's name, the scope and the facts read (`TemplateFacts`, sorted by id): an apply
reads the same scope again and compares, so a source that changed since the plan is
refused rather than acted on (`source_unchanged`). The plan file holds the whole plan
as JSON (0600: it names machines); `read_plan` reads it back and refuses one whose facts
no longer hash to its digest (edited or damaged).

VMs join as findings of kind "vm" with facts of their own, under the same digest and
counts per kind (`CATEGORIES`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from backends.building import TemplateVersion
from backends.migrating import ReadOnlySource, Scope, TemplateFacts
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
from bot.models import utcnow
from bot.models.errors import UserError

FORMAT = "deploybot-migration-plan/1"


class PlanFileError(UserError):
    """A plan file that cannot be used: unreadable, not a plan, or not what its digest
    says (edited or damaged). The message says which and that a new plan is needed."""


# The categories of each kind of finding, in the order they are shown; "vm" joins with
# its own (what travels, what needs a decision) when VMs are classified.
CATEGORIES: dict[str, tuple[Category, ...]] = {
    "template": (Category.REBUILDABLE, Category.ON_TARGET, Category.NOT_MAPPABLE),
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

    def counts(self) -> dict[str, dict[str, int]]:
        """Per kind, the number of objects in each category (every category named)."""
        counts = {kind: {c.value: 0 for c in shown} for kind, shown in CATEGORIES.items()}
        for finding in self.findings:
            counts[finding.kind][finding.category.value] += 1
        return counts

    def document(self) -> dict[str, Any]:
        """The plan as JSON data: what the plan file holds and `--json` prints."""
        return {
            "format": FORMAT,
            "made_at": self.made_at.isoformat(),
            "source": self.source,
            "target": self.target,
            "scope": asdict(self.scope),
            "source_digest": self.digest,
            "counts": self.counts(),
            "findings": [_finding_json(f) for f in self.findings],
            "facts": [f.as_json() for f in self.facts],
            "target_templates": [list(t) for t in self.target_templates],
        }


def _finding_json(finding: Finding) -> dict[str, Any]:
    data = asdict(finding)
    data["notes"] = [{"kind": n.kind.value, "value": n.value} for n in finding.notes]
    return {k: (v.value if hasattr(v, "value") else v) for k, v in data.items()}


def canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def source_digest(source: str, scope: Scope, facts: Sequence[TemplateFacts]) -> str:
    ordered = sorted(facts, key=lambda f: (f.source_id, f.name))
    data = {"source": source, "scope": asdict(scope), "facts": [f.as_json() for f in ordered]}
    return "sha256:" + hashlib.sha256(canonical(data)).hexdigest()


def classify(
    source: str,
    target: str,
    scope: Scope,
    facts: Sequence[TemplateFacts],
    profiles: Mapping[str, Profile],
    target_versions: Sequence[TemplateVersion],
    made_at: datetime,
) -> Plan:
    """The plan of `facts` (pure: the reads happened before)."""
    findings = tuple(classify_template(f, profiles, target_versions) for f in facts)
    return Plan(
        source,
        target,
        scope,
        made_at,
        tuple(facts),
        findings,
        source_digest(source, scope, facts),
        tuple(sorted((v.name, v.profile, v.version) for v in target_versions if v.current)),
    )


async def make_plan(
    source: ReadOnlySource,
    target_name: str,
    target_versions: Sequence[TemplateVersion],
    profiles: Mapping[str, Profile],
    scope: Scope,
    now: datetime | None = None,
) -> Plan:
    """Read the source (read-only) and classify what it holds. `target_versions`: the
    templates deploybot built on the target (`BuildsTemplates.template_versions`)."""
    facts = await source.template_facts(scope)
    return classify(
        source.name, target_name, scope, facts, profiles, target_versions, now or utcnow()
    )


def write_plan(plan: Plan, path: Path) -> None:
    """The plan file, made 0600 before anything is written to it; replaced whole."""
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(plan.document(), out, indent=2, sort_keys=True, ensure_ascii=False)
        out.write("\n")
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


def read_plan(path: Path) -> Plan:
    """The plan a file holds, whose facts must still hash to its digest: a plan edited
    or damaged since it was written is refused, as a source that changed would be."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"plan file {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"plan file {path}: not a deploybot migration plan ({FORMAT})")
    try:
        plan = _from_document(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanFileError(f"plan file {path}: damaged ({exc!r}); make a new plan") from None
    if source_digest(plan.source, plan.scope, plan.facts) != plan.digest:
        raise PlanFileError(
            f"plan file {path}: its facts do not match its digest (edited or damaged); "
            "make a new plan"
        )
    return plan


async def source_unchanged(plan: Plan, source: ReadOnlySource) -> bool:
    """Whether `source` (opened again, read-only) still holds what the plan read: the
    same scope read again gives the same digest."""
    facts = await source.template_facts(plan.scope)
    return source_digest(plan.source, plan.scope, facts) == plan.digest


def _from_document(data: dict[str, Any]) -> Plan:
    facts = tuple(
        TemplateFacts(
            source_id=str(f["source_id"]),
            name=str(f["name"]),
            guest_id=str(f["guest_id"]),
            annotation=str(f["annotation"]),
            extra=tuple(sorted((str(k), str(v)) for k, v in dict(f["extra"]).items())),
            nics=tuple(str(n) for n in f["nics"]),
            disk_controllers=tuple(str(c) for c in f["disk_controllers"]),
            hardware_version=str(f["hardware_version"]),
        )
        for f in data["facts"]
    )
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
    )


def _finding(f: dict[str, Any]) -> Finding:
    matched, missing = f.get("matched_by"), f.get("missing")
    return Finding(
        kind=str(f["kind"]),
        source_id=str(f["source_id"]),
        name=str(f["name"]),
        category=Category(f["category"]),
        profile=f.get("profile"),
        matched_by=MatchedBy(matched) if matched else None,
        evidence=str(f.get("evidence", "")),
        target_name=f.get("target_name"),
        target_version=f.get("target_version"),
        missing=Missing(missing) if missing else None,
        detail=tuple(str(d) for d in f.get("detail", ())),
        notes=tuple(Note(NoteKind(n["kind"]), str(n["value"])) for n in f.get("notes", ())),
    )
