"""What each template of the source becomes on the target, and why.

A template is never imported: the disk would travel, but what makes it deploy would
not (a datasource list pinned to VMware, open-vm-tools without qemu-guest-agent,
paravirtual VMware devices, interface names in the notes). It is rebuilt on the target
from the build profile it was made from, which is found

1. by its build mark (`deploybot-build profile=... version=...` in the annotation,
   backends/vsphere/buildmark.py): the profile it names, if this installation has it;
2. else by its guest OS: the family of its guest id (debian, ubuntu, el) and a
   release of that family's profiles written in the name or the annotation ("Debian
   12", "rocky-9"), else in the guest id (rhel9_64Guest). A guest id that names no OS
   (otherGuest) leaves it to the name and annotation. Exactly one profile must fit.

A template whose profile the target already has (a template deploybot built there from
it, read from the target's build marks) is `on-target`; one for which no profile fits
is `not-mappable`, with what is missing. `notes` list what an import would have got
wrong, so an operator sees why it is rebuilt.

Everything here is data: the reasons are worded in handlers/messages/migration.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from backends.building import TemplateVersion
from backends.migrating import DATASOURCE_WORD, GUESTINFO_PREFIX, TemplateFacts
from backends.vsphere import buildmark
from backends.vsphere.inventory import os_family
from bot.images.profiles import Profile

# How a distribution is written in names and notes ("Rocky Linux 9"), by the first word
# of a profile's name; a profile of another name is known by its name alone.
DISTRO_WORDS = {
    "debian": ("debian",),
    "ubuntu": ("ubuntu",),
    "rocky": ("rocky",),
    "alma": ("alma", "almalinux"),
    "rhel": ("rhel", "red hat", "redhat"),
    "centos": ("centos",),
    "oracle": ("oracle", "ol"),
}
# The release in a guest id: rhel9_64Guest, debian12_64Guest (ubuntu64Guest has none).
GUEST_RELEASE = re.compile(r"^[a-z]+?(\d+)(?:_64)?guest$")
# Devices a Proxmox guest has no driver of by default (its models are virtio, e1000).
VMWARE_NICS = frozenset({"vmxnet3", "vmxnet2", "pcnet32"})
VMWARE_CONTROLLERS = frozenset({"pvscsi", "buslogic", "lsilogic", "lsilogic-sas"})
# Interface names a VMware guest's kernel gives its NICs (ens192, ens160, ens33...).
VMWARE_INTERFACE = re.compile(r"\bens(?:192|160|161|224|256|33|34|35)\b")
CLOUD_INIT_GUESTINFO = ("metadata", "userdata", "vendordata")


class Category(StrEnum):
    # templates
    REBUILDABLE = "rebuildable"
    ON_TARGET = "on-target"
    NOT_MAPPABLE = "not-mappable"
    # VMs (bot/migration/vms.py)
    MOVES_AS_IS = "moves-as-is"
    NEEDS_DECISIONS = "needs-decisions"
    BLOCKED = "blocked"


class MatchedBy(StrEnum):
    BUILD_MARK = "build-mark"
    GUEST_OS = "guest-os"


class Missing(StrEnum):
    """Why no profile fits a template."""

    UNKNOWN_PROFILE = "unknown-profile"  # its build mark names a profile we lack
    UNKNOWN_OS = "unknown-os"  # its guest id is of a family no profile has
    NO_VERSION = "no-version"  # its family is known, no version of it is written
    AMBIGUOUS = "ambiguous"  # several profiles fit


class NoteKind(StrEnum):
    """What an imported copy of the template would carry that breaks a deploy."""

    DATASOURCE_PINNED = "datasource-pinned"  # a datasource list in extraConfig
    GUESTINFO = "guestinfo"  # cloud-init documents for the VMware datasource
    VMWARE_NIC = "vmware-nic"
    VMWARE_CONTROLLER = "vmware-controller"
    VMWARE_INTERFACE = "vmware-interface"  # ens192 in its notes
    # A VM's (bot/migration/vms.py, which says how much each weighs)
    UNREADABLE = "unreadable"
    SNAPSHOTS = "snapshots"
    CHANGE_TRACKING = "change-tracking"
    CUSTOM_ATTRIBUTES = "custom-attributes"
    TAGS = "tags"  # vSphere tags (a template's too: a rebuilt one does not carry them)
    FOLDER = "folder"
    DRS_RULES = "drs-rules"
    ALLOCATION = "allocation"
    HARDWARE_VERSION = "hardware-version"
    NIC_MODEL = "nic-model"  # the same model boots on Proxmox
    NIC_MODEL_CHANGE = "nic-model-change"  # another model: another driver in the guest
    CONTROLLER = "controller"
    CONTROLLER_CHANGE = "controller-change"
    TOOLS = "tools"
    MAC_GENERATED = "mac-generated"
    MAC_MANUAL = "mac-manual"
    NETWORK = "network"
    NO_SEGMENT = "no-segment"
    DISK = "disk"
    DISK_IMPOSSIBLE = "disk-impossible"
    DISK_RAW_DEVICE = "disk-raw-device"


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    value: str
    detail: tuple[str, ...] = ()  # more particulars (a VM's notes), worded with the value


@dataclass(frozen=True)
class Finding:
    """One source object and what it becomes. `kind` is "template" or "vm" (a VM's
    findings are its notes; the profile fields stay empty)."""

    kind: str
    source_id: str
    name: str
    category: Category
    profile: str | None = None
    matched_by: MatchedBy | None = None
    evidence: str = ""  # where the profile was read: "build mark", "name 'debian-12'"
    target_name: str | None = None  # on-target: the target's template of that profile
    target_version: int | None = None
    missing: Missing | None = None
    detail: tuple[str, ...] = ()  # the missing's particulars (profiles, guest id)
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True)
class _Fit:
    profile: str | None
    matched_by: MatchedBy | None = None
    evidence: str = ""
    missing: Missing | None = None
    detail: tuple[str, ...] = ()


def classify_template(
    facts: TemplateFacts, profiles: Mapping[str, Profile], target: Sequence[TemplateVersion]
) -> Finding:
    fit = _profile_of(facts, profiles)
    there = _on_target(fit.profile, target) if fit.profile is not None else None
    category = (
        Category.NOT_MAPPABLE
        if fit.profile is None
        else Category.REBUILDABLE
        if there is None
        else Category.ON_TARGET
    )
    return Finding(
        kind="template",
        source_id=facts.source_id,
        name=facts.name,
        category=category,
        profile=fit.profile,
        matched_by=fit.matched_by,
        evidence=fit.evidence,
        target_name=there.name if there else None,
        target_version=there.version if there else None,
        missing=fit.missing,
        detail=fit.detail,
        notes=notes_of(facts),
    )


def _on_target(profile: str, target: Sequence[TemplateVersion]) -> TemplateVersion | None:
    """The target's template built from `profile`: its current one, else its newest."""
    built = [v for v in target if v.profile == profile]
    return max(built, key=lambda v: (v.current, v.version), default=None)


def _profile_of(facts: TemplateFacts, profiles: Mapping[str, Profile]) -> _Fit:
    mark = buildmark.read(facts.annotation)
    if mark is not None and mark.get("profile"):
        name = mark["profile"]
        if name in profiles:
            return _Fit(name, MatchedBy.BUILD_MARK, "build mark")
        return _Fit(None, missing=Missing.UNKNOWN_PROFILE, detail=(name, *sorted(profiles)))
    family = os_family(facts.guest_id)
    # A guest id that names no OS (otherGuest, other3xLinux64Guest) leaves it to what
    # people wrote; one that names an OS no profile has (windows) is answer enough.
    unsaid = family == "other"
    candidates = [p for p in profiles.values() if unsaid or p.os_family == family]
    if not candidates:
        families = sorted({p.os_family for p in profiles.values()})
        return _Fit(None, missing=Missing.UNKNOWN_OS, detail=(facts.guest_id, *families))
    # What people wrote (the name, the annotation) says which distribution; the guest
    # id only the family and, sometimes, the release (rhel9 fits Rocky 9 and Alma 9).
    named: dict[str, str] = {}
    for where, text in (("name", facts.name), ("annotation", facts.annotation)):
        for profile in candidates:
            said = _written(profile, text)
            if said and profile.name not in named:
                named[profile.name] = f"{where} {said!r}"
    guessed = f"guest id {facts.guest_id!r}"
    if not named and not unsaid:
        release = GUEST_RELEASE.match(facts.guest_id.lower())
        if release is not None:
            named = {
                p.name: guessed for p in candidates if p.version.split(".")[0] == release.group(1)
            }
    if len(named) == 1:
        ((name, evidence),) = named.items()
        if evidence != guessed:
            evidence = f"{guessed}, {evidence}"
        return _Fit(name, MatchedBy.GUEST_OS, evidence)
    if not named and unsaid:
        families = sorted({p.os_family for p in profiles.values()})
        return _Fit(None, missing=Missing.UNKNOWN_OS, detail=(facts.guest_id, *families))
    if not named:
        return _Fit(
            None,
            missing=Missing.NO_VERSION,
            detail=(family, *sorted(p.name for p in candidates)),
        )
    return _Fit(None, missing=Missing.AMBIGUOUS, detail=tuple(sorted(named)))


def _written(profile: Profile, text: str) -> str | None:
    """Where `text` names `profile` (its name, or its distribution and release), or None."""
    lowered = text.lower()
    patterns = [rf"(?<![a-z0-9]){re.escape(profile.name.lower())}(?![a-z0-9])"]
    first = re.match(r"[a-z]+", profile.name)
    words = DISTRO_WORDS.get(first.group(0), ()) if first else ()
    if words:
        either = "|".join(re.escape(w) for w in words)
        version = re.escape(profile.version.lower())
        patterns.append(rf"(?<![a-z])(?:{either})(?:[\s_-]*linux)?[\s_-]*v?{version}(?!\d)")
    for pattern in patterns:
        found = re.search(pattern, lowered)
        if found:
            return text[found.start() : found.end()]
    return None


def notes_of(facts: TemplateFacts) -> tuple[Note, ...]:
    notes: list[Note] = []
    extra = dict(facts.extra)
    for key, value in facts.extra:
        if DATASOURCE_WORD in key.lower():
            notes.append(Note(NoteKind.DATASOURCE_PINNED, f"{key}={value}"))
    documents = [f"{GUESTINFO_PREFIX}{d}" for d in CLOUD_INIT_GUESTINFO]
    if present := [k for k in documents if k in extra]:
        notes.append(Note(NoteKind.GUESTINFO, ", ".join(present)))
    for nic in sorted(set(facts.nics) & VMWARE_NICS):
        notes.append(Note(NoteKind.VMWARE_NIC, nic))
    for controller in sorted(set(facts.disk_controllers) & VMWARE_CONTROLLERS):
        notes.append(Note(NoteKind.VMWARE_CONTROLLER, controller))
    for name in sorted(set(VMWARE_INTERFACE.findall(facts.annotation))):
        notes.append(Note(NoteKind.VMWARE_INTERFACE, name))
    if facts.tags:
        notes.append(Note(NoteKind.TAGS, str(len(facts.tags)), facts.tags))
    return tuple(notes)
