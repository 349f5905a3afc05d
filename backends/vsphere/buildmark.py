"""The build mark: the annotation line that says a template is one deploybot built.

A built template's annotation is three lines: the build job's tag (like any VM
deploybot made), the mark (`deploybot-build key=value ...`: published name, profile,
version, build date, CPU baseline, source digest) and a sentence for people. The mark
is never a job tag (it has spaces), so a clone, whose annotation is written afresh
(`inventory.annotation`), carries neither.
"""

from __future__ import annotations

from datetime import datetime

from backends.building import BuildPlan, TemplateVersion
from backends.tags import JobMark, job_marks
from backends.vsphere.conn import Props
from backends.vsphere.vms import tags

MARK = "deploybot-build"
# What `template_versions` reads of every VM: a few hundred bytes each, no devices.
VERSION_PATHS = ["name", "config.template", "config.annotation", "config.instanceUuid"]


def annotation(plan: BuildPlan, needle: str | None = None) -> str:
    """The built template's annotation; `needle` (the backend's `template_annotation`,
    the filter that makes a VM one of its templates) is added as a line of its own."""
    fields = {
        "name": plan.name,
        "profile": plan.profile,
        "version": str(plan.version),
        "built_at": plan.built_at.isoformat(),
        "cpu": plan.cpu,
        "digest": plan.source_digest,
    }
    mark = " ".join(f"{k}={v}" for k, v in fields.items() if v and " " not in v)
    return (
        f"{plan.tag}\n{MARK} {mark}\n"
        f"Built by deploybot job {plan.job_id} from profile {plan.profile}."
        + (f"\n{needle}" if needle else "")
    )


def read(annotation: object) -> dict[str, str] | None:
    """The fields of the build mark in an annotation; None without one."""
    for line in str(annotation or "").splitlines():
        words = line.strip().split()
        if words and words[0] == MARK:
            pairs = (w.partition("=") for w in words[1:])
            return {k: v for k, sep, v in pairs if sep}
    return None


def job(annotation: object) -> JobMark | None:
    """The build job's mark: the one job tag of the annotation (None for none or two)."""
    marks = job_marks(tags(annotation))
    return marks[0] if len(marks) == 1 else None


def ours(p: Props, installation: str | None) -> bool:
    """Whether `p` (VERSION_PATHS) is a template this installation built."""
    mark = job(p.get("config.annotation"))
    return (
        bool(p.get("config.template"))
        and read(p.get("config.annotation")) is not None
        and mark is not None
        and mark.installation == installation
    )


def version(p: Props, placement: str | None = None) -> TemplateVersion | None:
    """The TemplateVersion of a VM (VERSION_PATHS), or None when it has no build mark."""
    fields = read(p.get("config.annotation"))
    if fields is None or not p.get("config.template"):
        return None
    try:
        number = int(fields.get("version", ""))
    except ValueError:
        return None
    try:
        built_at: datetime | None = datetime.fromisoformat(fields.get("built_at", ""))
    except ValueError:
        built_at = None
    name = str(p.get("name"))
    return TemplateVersion(
        vm_id=str(p.get("config.instanceUuid")),
        name=name,
        base_name=fields.get("name") or name,
        profile=fields.get("profile", ""),
        version=number,
        built_at=built_at,
        cpu=fields.get("cpu"),
        mark=job(p.get("config.annotation")),
        placement=placement,
    )
