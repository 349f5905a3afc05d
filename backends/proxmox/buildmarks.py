"""What a template build writes on Proxmox and reads back: pure functions, no I/O.

A built template carries its build mark in the description (one `key: value` line each,
values without spaces, so `vmconfig.mark_field` reads them) and tags: the build job's
tag (`plan.tag`, which `vmconfig.tags_of` and `merged_tags` already know as a job tag),
`os-<family>` (what `vmconfig.family_of` reads, so a deploy from it gets the right
OS profile and CPU model) and `profile-<profile>`.

The upload that carries the image to the node is named after the build's job
(`deploybot-<job>.qcow2`), so a crash's leftover is found by name. Where the release
and a storage allow content `import` (PVE 8.4 and later: disk images in an import
storage), the qcow2 goes there as it is. Otherwise it goes to an `iso` storage as
`deploybot-<job>.img`: the ISO store takes only .iso/.img names and its volumes count
as raw, so the image is converted to raw first (`import-from` then copies raw data,
which is right).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from backends.building import BuildPlan, TemplateVersion
from backends.proxmox.vmconfig import family_of, mark_field
from backends.tags import JobMark, parse_tag

IMPORT_RELEASE = (8, 4)  # the first release taking disk images as content `import`
BUILD_HEADER = "Built by deploybot; do not remove the lines below."
_TAG_BAD = re.compile(r"[^a-z0-9_\-+.]+")
_DISK = re.compile(r"^(scsi|virtio|sata|ide)\d+$")


@dataclass(frozen=True)
class UploadTarget:
    """Where the image goes before it is imported: storage, content type, file name."""

    storage: str
    content: str  # import or iso
    filename: str

    @property
    def volid(self) -> str:
        return f"{self.storage}:{self.content}/{self.filename}"


def upload_name(job_id: str, content: str) -> str:
    return f"{upload_prefix(job_id)}{'qcow2' if content == 'import' else 'img'}"


def upload_prefix(job_id: str) -> str:
    return f"deploybot-{job_id.lower()}."


def choose_upload(
    storages: list[dict[str, Any]], release: tuple[int, int], prefer: str, job_id: str
) -> UploadTarget | None:
    """An enabled storage taking the upload: content `import` when the release has it,
    else `iso`; `prefer` (the disk storage) first, then by name. None: no such storage."""
    kinds = ("import", "iso") if release >= IMPORT_RELEASE else ("iso",)
    for kind in kinds:
        able = sorted(
            (str(s["storage"]) for s in storages if kind in contents(s)),
            key=lambda name: (name != prefer, name),
        )
        if able:
            return UploadTarget(able[0], kind, upload_name(job_id, kind))
    return None


def contents(storage: dict[str, Any]) -> set[str]:
    return {c for c in re.split(r"[,;\s]+", str(storage.get("content", ""))) if c}


def tag_text(text: str) -> str:
    """A valid Proxmox tag from free text (lower case; other characters become `-`)."""
    return _TAG_BAD.sub("-", text.lower()).strip("-") or "unknown"


def os_family(plan: BuildPlan) -> str:
    """The family the OS profiles know: `el9`/`el10` for EL (from the profile's name,
    `rocky-10` -> el10), else the plan's own."""
    found = family_of(plan.profile, frozenset(), {})
    return found if found.startswith(plan.os_family) else plan.os_family


def build_tags(plan: BuildPlan) -> str:
    tags = {plan.tag, f"os-{tag_text(os_family(plan))}", f"profile-{tag_text(plan.profile)}"}
    return ";".join(sorted(tags))


def build_description(plan: BuildPlan) -> str:
    lines = [
        BUILD_HEADER,
        f"job: {plan.job_id}",
        f"tag: {plan.tag}",
        f"build: {tag_text(plan.profile)}",
        f"name: {plan.name}",
        f"version: {plan.version}",
        f"built: {plan.built_at.isoformat()}",
        f"cpu: {plan.cpu}",
        f"source: {plan.source_digest}",
        f"os: {os_family(plan)}",
    ]
    return "\n".join(lines)


def build_mark(config: dict[str, Any]) -> JobMark | None:
    """The build job's mark of a VM deploybot built as a template; None for any other."""
    if BUILD_HEADER not in str(config.get("description", "")):
        return None
    tag = mark_field(config, "tag")
    return parse_tag(tag) if tag else None


def ours(config: dict[str, Any], installation: str | None) -> bool:
    """Built as a template by this installation."""
    mark = build_mark(config)
    return mark is not None and mark.installation == installation


def version_of(vmid: str, node: str, config: dict[str, Any]) -> TemplateVersion | None:
    mark = build_mark(config)
    base = mark_field(config, "name")
    number = mark_field(config, "version")
    if mark is None or base is None or number is None or not number.isdigit():
        return None
    built = mark_field(config, "built")
    try:
        built_at = datetime.fromisoformat(built) if built else None
    except ValueError:
        built_at = None
    return TemplateVersion(
        vm_id=vmid,
        name=str(config.get("name", "")),
        base_name=base,
        profile=mark_field(config, "build") or "",
        version=int(number),
        built_at=built_at,
        cpu=mark_field(config, "cpu"),
        mark=mark,
        placement=node,
    )


Volume = tuple[str, str]  # (storage, the file or volume name without folders)


def base_volumes(config: dict[str, Any]) -> set[Volume]:
    """The template's own disk volumes (`local-lvm:base-9000-disk-0` ->
    (local-lvm, base-9000-disk-0); `local:9000/base-9000-disk-0.qcow2` -> (local,
    base-9000-disk-0.qcow2))."""
    found = set()
    for key, value in config.items():
        if _DISK.match(key) and isinstance(value, str) and "media=cdrom" not in value:
            store, _, name = value.split(",", 1)[0].partition(":")
            if name and "cloudinit" not in name:
                found.add((store, name.rsplit("/", 1)[-1]))
    return found


def clone_parents(volume: dict[str, Any]) -> set[Volume]:
    """The base volumes a listed volume is a linked clone of: its `parent` (dir and
    file storages: `../9000/base-9000-disk-0.qcow2`), and the `base-.../vm-...` form
    of its volid (lvmthin, zfs, rbd)."""
    store, _, name = str(volume.get("volid", "")).partition(":")
    parents = set()
    if volume.get("parent"):
        parents.add((store, str(volume["parent"]).split("@", 1)[0].rsplit("/", 1)[-1]))
    if "/" in name and "base-" in name.split("/", 1)[0]:
        parents.add((store, name.split("/", 1)[0]))
    return parents
