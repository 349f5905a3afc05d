"""What a migration reads of the hypervisor it leaves (issue 30): the read-only source
contract and the facts of one template, as plain data the plan classifies.

A source is opened through a type that has no mutating method at all, not through a
backend with a flag: `ReadOnlySource` is everything it offers, and every call reads
(backends/vsphere/readonly.py implements it for vCenter and ESXi; its SOAP stub also
refuses, before sending, any method that is not a read). An OVA on a web server is a
source too, read from its head alone (backends/vsphere/ovahead.py).

The facts are what a plan's digest covers, so that an apply can read them again and
notice a source that changed since: only what the classification uses, in a stable
order, and no secret. A template's guestinfo documents may hold keys and passwords,
so only a digest of each is kept; a key that names cloud-init datasources keeps its
value (that value is the finding).

A VM's facts (`VMFacts`) are what will not travel or needs a decision: snapshots, changed
block tracking, custom attributes, tags, folder, DRS rules, reservations and shares, hardware
version, VMware Tools, and per NIC and disk the device, MAC, network and provisioning.
Both kinds carry their vSphere tags ("Category/Tag", sorted; read from vCenter's vAPI
tagging service, backends/vsphere/tagging.py): None when they could not be read (a
standalone ESXi host, an OVA, a vCenter without the service), and then left out of
the JSON, so that a plan made without tags digests exactly as one made before tags
were read. A disk's provisioning is kept as vSphere's two flags (`thinProvisioned`, `eagerlyScrub`),
not as a state: thin excludes eager, so three states are valid and the fourth
combination is reported as impossible (`provisioning`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Protocol

# guestinfo keys are VMware's channel into the guest (cloud-init's VMware datasource
# reads guestinfo.metadata, .userdata, .vendordata); their values are kept as digests.
GUESTINFO_PREFIX = "guestinfo."
# A key naming the datasources cloud-init may use (tools that pin the list record it
# like `guestinfo.cloudinit.datasource_list = [VMware]`): its value is kept.
DATASOURCE_WORD = "datasource"
MAX_VALUE_CHARS = 200


@dataclass(frozen=True)
class TemplateFacts:
    """One template of the source as the plan sees it."""

    source_id: str  # vSphere: config.instanceUuid (durable); an OVA: its URL
    name: str
    guest_id: str  # vSphere's guest id (debian12_64Guest); "" when the source says none
    annotation: str
    extra: tuple[tuple[str, str], ...]  # (key, value or sha256:digest), sorted
    nics: tuple[str, ...]  # NIC models, one per NIC: vmxnet3, e1000, e1000e
    disk_controllers: tuple[str, ...]  # controllers holding a disk: pvscsi, lsilogic, sata
    hardware_version: str  # vmx-13; "" when not said
    tags: tuple[str, ...] | None = None  # "Category/Tag", sorted; None: not read

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return _tags_json(data, self.tags)


def template_facts_of(data: dict[str, Any]) -> TemplateFacts:
    """`TemplateFacts.as_json` read back (a plan file)."""
    return TemplateFacts(
        source_id=str(data["source_id"]),
        name=str(data["name"]),
        guest_id=str(data["guest_id"]),
        annotation=str(data["annotation"]),
        extra=tuple(sorted((str(k), str(v)) for k, v in dict(data["extra"]).items())),
        nics=tuple(str(n) for n in data["nics"]),
        disk_controllers=tuple(str(c) for c in data["disk_controllers"]),
        hardware_version=str(data["hardware_version"]),
        tags=_tags_of(data),
    )


def _tags_json(data: dict[str, Any], tags: tuple[str, ...] | None) -> dict[str, Any]:
    """Tags not read are left out (see the module docstring), read ones are a list."""
    if tags is None:
        del data["tags"]
    else:
        data["tags"] = list(tags)
    return data


def _tags_of(data: dict[str, Any]) -> tuple[str, ...] | None:
    tags = data.get("tags")
    return None if tags is None else tuple(sorted(str(t) for t in tags))


@dataclass(frozen=True)
class Scope:
    """Which part of the source a plan covers: a folder, a name pattern (fnmatch)."""

    folder: str | None = None
    name: str | None = None


def extra_facts(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The extraConfig entries a plan keeps (the last value of a key wins, as vSphere
    reads them): datasource keys with their value, other guestinfo keys as digests."""
    kept: dict[str, str] = {}
    for key, value in pairs:
        if DATASOURCE_WORD in key.lower():
            kept[key] = str(value)[:MAX_VALUE_CHARS]
        elif key.lower().startswith(GUESTINFO_PREFIX):
            kept[key] = "sha256:" + hashlib.sha256(str(value).encode()).hexdigest()
    return tuple(sorted(kept.items()))


@dataclass(frozen=True)
class NicFacts:
    """One NIC of a VM."""

    label: str  # "Network adapter 1"
    model: str  # vmxnet3, e1000, e1000e, ...
    mac: str
    mac_manual: bool  # addressType "manual": set by someone, not generated by vSphere
    network: str  # the portgroup's (or standard network's) name; "" when not said
    distributed: bool  # a distributed portgroup (else a standard network)


@dataclass(frozen=True)
class DiskFacts:
    """One virtual disk of a VM."""

    label: str  # "Hard disk 1"
    controller: str  # the model of the controller holding it: pvscsi, lsilogic, sata, ...
    capacity_kib: int
    backing: str  # "flat" (a VMDK), "rdm" (a raw device mapping), else the backing's type
    thin: bool | None  # thinProvisioned (None: not said, e.g. an RDM)
    eager: bool | None  # eagerlyScrub


class Provisioning(StrEnum):
    """The three valid states of vSphere's two provisioning flags."""

    THIN = "thin"
    THICK_LAZY = "thick-lazy-zeroed"
    THICK_EAGER = "thick-eager-zeroed"


def provisioning(thin: bool | None, eager: bool | None) -> Provisioning | None:
    """The state of a disk's two flags; None for thin and eager at once, which vSphere
    cannot have (thin excludes eager zeroing): a reading that says so is reported as
    impossible, never rounded to one of the three."""
    if thin and eager:
        return None
    if thin:
        return Provisioning.THIN
    return Provisioning.THICK_EAGER if eager else Provisioning.THICK_LAZY


@dataclass(frozen=True)
class Allocation:
    """A VM's CPU (MHz) or memory (MiB) reservation, limit and shares; vSphere's default
    is no reservation, no limit, normal shares."""

    reservation: int = 0
    limit: int = -1  # -1: unlimited
    shares: str = "normal"  # low, normal, high, or custom:<n>

    def is_default(self) -> bool:
        return self == Allocation()


@dataclass(frozen=True)
class VMFacts:
    """One VM (not a template) of the source as the plan sees it."""

    source_id: str  # config.instanceUuid; "" when its configuration could not be read
    name: str
    guest_id: str
    folder: str  # the VM folder's path under the datacenter ("" at its root)
    hardware_version: str  # vmx-19
    snapshots: tuple[str, ...]  # every snapshot's name, depth first
    change_tracking: bool  # changed block tracking (CBT)
    custom_attributes: tuple[tuple[str, str], ...]  # (name, value), sorted
    drs_rules: tuple[tuple[str, str], ...]  # (rule name, kind), sorted
    cpu: Allocation  # MHz
    memory: Allocation  # MiB
    tools_status: str  # guest.toolsRunningStatus: guestToolsRunning, guestToolsNotRunning
    tools_version: str  # guest.toolsVersion ("0": none)
    nics: tuple[NicFacts, ...]
    disks: tuple[DiskFacts, ...]
    tags: tuple[str, ...] | None = None  # "Category/Tag", sorted; None: not read

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["custom_attributes"] = dict(self.custom_attributes)
        data["drs_rules"] = [list(r) for r in self.drs_rules]
        return _tags_json(data, self.tags)


def vm_facts_of(data: dict[str, Any]) -> VMFacts:
    """`VMFacts.as_json` read back (a plan file)."""
    return VMFacts(
        source_id=str(data["source_id"]),
        name=str(data["name"]),
        guest_id=str(data["guest_id"]),
        folder=str(data["folder"]),
        hardware_version=str(data["hardware_version"]),
        snapshots=tuple(str(s) for s in data["snapshots"]),
        change_tracking=bool(data["change_tracking"]),
        custom_attributes=tuple(
            sorted((str(k), str(v)) for k, v in data["custom_attributes"].items())
        ),
        drs_rules=tuple((str(n), str(k)) for n, k in data["drs_rules"]),
        cpu=Allocation(**data["cpu"]),
        memory=Allocation(**data["memory"]),
        tools_status=str(data["tools_status"]),
        tools_version=str(data["tools_version"]),
        nics=tuple(NicFacts(**n) for n in data["nics"]),
        disks=tuple(DiskFacts(**d) for d in data["disks"]),
        tags=_tags_of(data),
    )


class ReadOnlySource(Protocol):
    """A hypervisor opened for reading only. Nothing here changes it; there is no
    method that could."""

    name: str
    # Why the last reads found no tags (they could not be read), else None.
    tags_unreadable: str | None

    async def template_facts(self, scope: Scope) -> list[TemplateFacts]:
        """Every template in `scope`, sorted by name then id."""
        ...

    async def vm_facts(self, scope: Scope) -> list[VMFacts]:
        """Every VM (not a template) in `scope`, sorted by name then id."""
        ...

    def api_calls(self) -> Counter[str]:
        """The calls sent so far, by method name."""
        ...

    async def close(self) -> None: ...
