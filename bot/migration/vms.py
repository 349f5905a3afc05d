"""What each VM of the source would take to move to Proxmox, and why (issue 30, the
VMs' half of the plan). Nothing here moves a VM: `migrate apply` rebuilds templates
only; the plan lists, per VM, what does not travel and what an operator must decide.

Each note weighs one of three (`WEIGHT`), and the heaviest gives the VM its category:

- blocked: the plan cannot say where it goes: a NIC on a network no subnet maps to a
  target segment, a disk whose provisioning flags are impossible (thin and eagerly
  scrubbed at once), a raw device mapping (a LUN, not a file to convert), or a VM whose
  configuration could not be read;
- needs a decision: snapshots (only one state moves), changed block tracking (the
  incremental backup chain ends), custom attributes, vSphere tags and DRS rules
  (vCenter's; a placement rule becomes a choice of node; a tag may drive a backup
  policy or a firewall rule, which must be redone on the target), reservations,
  limits or shares, a NIC or disk controller that boots on Proxmox only as another
  model (another driver in the guest), a MAC set by hand (keep it, or replace it);
- said, nothing to decide: the hardware version and the folder (vSphere's), a NIC or
  controller Proxmox emulates as is, VMware Tools (qemu-guest-agent cannot be seen from
  vSphere: not known), a generated MAC, each NIC's target bridge and VLAN, each disk's
  provisioning and target format.

vSphere tags ("Category/Tag") could be carried as Proxmox tags, which are flat labels
of a VM (`tags`, letters, digits and `- _ + .`, no categories): `proxmox_tag` gives the
form one would take (`Category.Tag`). Nothing here or in `migrate apply` writes them:
the note says what they would be, an operator decides.

Everything here is data: the notes are worded in handlers/messages/migration.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum

from backends.migrating import DiskFacts, NicFacts, VMFacts, provisioning
from bot.addresses.subnets import Subnet
from bot.migration.classify import Category, Finding, Note, NoteKind


class Weight(IntEnum):
    SAID = 0
    DECISION = 1
    BLOCKER = 2


WEIGHT: dict[NoteKind, Weight] = {
    NoteKind.UNREADABLE: Weight.BLOCKER,
    NoteKind.NO_SEGMENT: Weight.BLOCKER,
    NoteKind.DISK_IMPOSSIBLE: Weight.BLOCKER,
    NoteKind.DISK_RAW_DEVICE: Weight.BLOCKER,
    NoteKind.SNAPSHOTS: Weight.DECISION,
    NoteKind.CHANGE_TRACKING: Weight.DECISION,
    NoteKind.CUSTOM_ATTRIBUTES: Weight.DECISION,
    NoteKind.TAGS: Weight.DECISION,
    NoteKind.DRS_RULES: Weight.DECISION,
    NoteKind.ALLOCATION: Weight.DECISION,
    NoteKind.NIC_MODEL_CHANGE: Weight.DECISION,
    NoteKind.CONTROLLER_CHANGE: Weight.DECISION,
    NoteKind.MAC_MANUAL: Weight.DECISION,
    NoteKind.HARDWARE_VERSION: Weight.SAID,
    NoteKind.FOLDER: Weight.SAID,
    NoteKind.NIC_MODEL: Weight.SAID,
    NoteKind.CONTROLLER: Weight.SAID,
    NoteKind.TOOLS: Weight.SAID,
    NoteKind.MAC_GENERATED: Weight.SAID,
    NoteKind.NETWORK: Weight.SAID,
    NoteKind.DISK: Weight.SAID,
}
CATEGORY_OF = {
    Weight.SAID: Category.MOVES_AS_IS,
    Weight.DECISION: Category.NEEDS_DECISIONS,
    Weight.BLOCKER: Category.BLOCKED,
}
# The Proxmox NIC model that boots with the driver the guest has now (the same device,
# emulated by QEMU), else the one every OS has in the box (e1000). virtio is the fast
# path and needs virtio drivers in the guest (in Linux, not in a stock Windows image).
NIC_TARGETS: dict[str, tuple[str, bool]] = {
    "e1000": ("e1000", True),
    "e1000e": ("e1000e", True),
    "pcnet32": ("pcnet", True),
    "vmxnet3": ("e1000", False),  # vmxnet3's driver comes with VMware Tools
    "vmxnet2": ("e1000", False),
}
# The same for the controller holding a disk: Proxmox's `scsihw` (scsi disks) or the
# disk's bus. QEMU emulates VMware's pvscsi; it has no LSI Logic 53c1030 (lsi is the
# 53C895A, another driver) and no BusLogic or SAS 1068, so those boot as SATA (AHCI),
# whose driver an installed guest may still lack in its initramfs: a decision.
CONTROLLER_TARGETS: dict[str, tuple[str, bool]] = {
    "pvscsi": ("scsihw=pvscsi", True),
    "sata": ("sata", True),
    "ide": ("ide", True),
    "lsilogic": ("scsihw=lsi", False),
    "lsilogic-sas": ("sata", False),
    "buslogic": ("sata", False),
    "nvme": ("sata", False),
}
# Proxmox storage types whose VM disks are files (qcow2 keeps a disk thin there) and
# those that hold raw volumes thin by themselves; plain lvm allocates a volume whole.
FILE_STORAGES = frozenset({"dir", "nfs", "cifs", "glusterfs"})
THIN_STORAGES = frozenset({"lvmthin", "zfspool", "rbd", "btrfs", "iscsidirect"})
TOOLS_RUNNING = "guestToolsRunning"
# What a Proxmox tag may hold (pve-common's pve-tag format), and the first character.
PVE_TAG_OTHER = re.compile(r"[^A-Za-z0-9_+.-]+")
PVE_TAG_START = re.compile(r"[A-Za-z0-9_]")

# A network's place on the target: (subnet label, the target segment, "" for none).
Mapped = tuple[str, str]


def network_map(
    subnets: Iterable[Subnet], source: str, target: str
) -> dict[str, tuple[Mapped, ...]]:
    """Per vSphere network name, each subnet whose segment on `source` is that network
    and its segment on `target` ("" when it has none)."""
    found: dict[str, list[Mapped]] = {}
    for subnet in subnets:
        there, here = subnet.segment(source), subnet.segment(target)
        if there is not None:
            found.setdefault(there.network, []).append((subnet.label, str(here or "")))
    return {network: tuple(places) for network, places in found.items()}


def classify_vm(
    facts: VMFacts,
    networks: Mapping[str, Sequence[Mapped]],
    storage_type: str | None = None,
) -> Finding:
    """`networks`: `network_map` of the configuration; `storage_type`: the type of the
    target storage the disks would land on, when known."""
    notes = [Note(NoteKind.UNREADABLE, facts.name)] if not facts.source_id else _vm_notes(facts)
    notes += [n for nic in facts.nics for n in _nic_notes(nic, networks)]
    notes += [n for disk in facts.disks for n in _disk_notes(disk, storage_type)]
    weight = max((WEIGHT[n.kind] for n in notes), default=Weight.SAID)
    return Finding(
        kind="vm",
        source_id=facts.source_id,
        name=facts.name,
        category=CATEGORY_OF[weight],
        notes=tuple(sorted(notes, key=lambda n: -WEIGHT[n.kind])),
    )


def _vm_notes(facts: VMFacts) -> list[Note]:
    notes: list[Note] = []
    if facts.snapshots:
        notes.append(Note(NoteKind.SNAPSHOTS, str(len(facts.snapshots)), facts.snapshots))
    if facts.change_tracking:
        notes.append(Note(NoteKind.CHANGE_TRACKING, "enabled"))
    if facts.custom_attributes:
        names = tuple(name for name, _value in facts.custom_attributes)
        notes.append(Note(NoteKind.CUSTOM_ATTRIBUTES, str(len(names)), names))
    if facts.tags:
        notes.append(Note(NoteKind.TAGS, str(len(facts.tags)), facts.tags))
    if facts.drs_rules:
        rules = tuple(f"{name} ({kind})" for name, kind in facts.drs_rules)
        notes.append(Note(NoteKind.DRS_RULES, str(len(rules)), rules))
    for what, unit, allocation in (("cpu", "MHz", facts.cpu), ("memory", "MiB", facts.memory)):
        if not allocation.is_default():
            limit = "none" if allocation.limit < 0 else f"{allocation.limit} {unit}"
            detail = (f"{allocation.reservation} {unit}", limit, allocation.shares)
            notes.append(Note(NoteKind.ALLOCATION, what, detail))
    if facts.folder:
        notes.append(Note(NoteKind.FOLDER, facts.folder))
    notes.append(Note(NoteKind.HARDWARE_VERSION, facts.hardware_version or "not said"))
    running = "running" if facts.tools_status == TOOLS_RUNNING else "not running"
    version = facts.tools_version if facts.tools_version not in ("", "0") else "none reported"
    notes.append(Note(NoteKind.TOOLS, running, (version,)))
    return notes


def proxmox_tag(tag: str) -> str:
    """The Proxmox tag a vSphere tag ("Category/Tag") could become: the category and the
    tag joined by a dot, every run of characters a Proxmox tag cannot hold as one "-"."""
    category, _slash, name = tag.partition("/")
    text = PVE_TAG_OTHER.sub("-", f"{category}.{name}" if name else category)
    return text if PVE_TAG_START.match(text) else f"_{text}"


def _nic_notes(nic: NicFacts, networks: Mapping[str, Sequence[Mapped]]) -> list[Note]:
    model, same = NIC_TARGETS.get(nic.model, ("e1000", False))
    kind = NoteKind.NIC_MODEL if same else NoteKind.NIC_MODEL_CHANGE
    notes = [Note(kind, nic.label, (nic.model, model))]
    mac = NoteKind.MAC_MANUAL if nic.mac_manual else NoteKind.MAC_GENERATED
    notes.append(Note(mac, nic.label, (nic.mac,)))
    backing = "distributed portgroup" if nic.distributed else "standard network"
    places = networks.get(nic.network, ())
    targets = sorted({segment for _subnet, segment in places})
    subnets = tuple(subnet for subnet, _segment in places)
    if len(targets) == 1 and targets[0]:
        detail = (nic.network, backing, ", ".join(subnets), targets[0])
        notes.append(Note(NoteKind.NETWORK, nic.label, detail))
    else:  # no subnet names it, none has a segment on the target, or they disagree
        detail = (nic.network, backing, ", ".join(subnets), " / ".join(t for t in targets if t))
        notes.append(Note(NoteKind.NO_SEGMENT, nic.label, detail))
    return notes


# A disk note's provisioning when no backing of the disk said it, before the backing's
# kind (SeSparseBackingInfo...): "not said", never taken for thick lazy zeroed.
NOT_SAID = "not-said:"


def _disk_notes(disk: DiskFacts, storage_type: str | None) -> list[Note]:
    size = _size(disk.capacity_kib)
    notes: list[Note] = []
    if disk.controller:
        target, same = CONTROLLER_TARGETS.get(disk.controller, ("sata", False))
        kind = NoteKind.CONTROLLER if same else NoteKind.CONTROLLER_CHANGE
        notes.append(Note(kind, disk.label, (disk.controller, target)))
    if disk.backing == "rdm":
        return [*notes, Note(NoteKind.DISK_RAW_DEVICE, disk.label, (size,))]
    if disk.thin is None and disk.eager is None:  # no backing said (sparse, SEsparse)
        said = f"{NOT_SAID}{disk.backing}"
        return [*notes, Note(NoteKind.DISK, disk.label, (size, said, *_format(storage_type)))]
    state = provisioning(disk.thin, disk.eager)
    if state is None:
        return [*notes, Note(NoteKind.DISK_IMPOSSIBLE, disk.label, (size,))]
    notes.append(Note(NoteKind.DISK, disk.label, (size, state.value, *_format(storage_type))))
    return notes


def _format(storage_type: str | None) -> tuple[str, str]:
    """The target format of a disk and whether it stays thin there: "thin",
    "whole" (allocated whole) or "" (depends on the storage, not known)."""
    if storage_type in FILE_STORAGES:
        return ("qcow2", "thin")
    if storage_type in THIN_STORAGES:
        return ("raw", "thin")
    if storage_type == "lvm":
        return ("raw", "whole")
    return ("qcow2 or raw", "")


def _size(kib: int) -> str:
    if kib >= 1024 * 1024:
        return f"{kib / (1024 * 1024):g} GiB"
    return f"{kib / 1024:g} MiB" if kib else "size not said"
