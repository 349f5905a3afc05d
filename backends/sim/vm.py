"""The simulator's data: its VMs, timings and faults, and how its state file keeps them.

The simulator's behaviour is in the package's other modules (backends/sim/__init__.py
exports what tests use); its `[[backends]]` model (`Config`) lives here too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.base import Identity, Nic, Segment, Template, VMInfo
from backends.config import BackendConfig

FaultKind = Literal["error", "hang", "crash", "flaky", "outage", "impostor", "rekeyed"]
# How the simulator confirms a guest's host key (issue 28): its guest agent reads the
# guest's keys (ReadsHostKeys), it installs the key deploybot chose (ChoosesHostKeys),
# or neither (the key is only seen over SSH).
HostKeyMode = Literal["agent", "chosen", "none"]
FAULT_KINDS: tuple[FaultKind, ...] = ("error", "hang", "crash")
GIB = 1024**3


@dataclass
class Fault:
    op: str
    kind: FaultKind
    times: int = 1


class SimulatedCrash(RuntimeError):
    """Raised by a ``crash`` fault: deliberately not a BackendError."""


@dataclass(frozen=True)
class SimTiming:
    """Seconds each hypervisor-side task takes before scaling."""

    clone_linked_s: float = 2.5
    clone_full_s: float = 8.0
    config_s: float = 0.3
    resize_s: float = 0.6
    start_s: float = 1.0
    boot_s: float = 3.5
    sshd_s: float = 0.5
    stop_s: float = 1.0
    destroy_s: float = 0.4
    poll_s: float = 0.5


@dataclass
class SimVM:
    vm_id: str
    name: str
    template: str
    placement: str
    storage: str
    disk_gib: int
    tags: set[str] = field(default_factory=set)
    running: bool = False
    lock: str | None = None
    identity: Identity | None = None
    booted: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set by a power-off
    boot_task: asyncio.Task[None] | None = None
    # The address of a VM built by hand (`SimBackend.add_vm`), set in its guest by its
    # owner: deploybot's VMs have theirs in `identity`.
    address: ipaddress.IPv4Address | None = None
    # The size a growth aims at, kept with the VM as vSphere keeps it in extraConfig:
    # asked again (a retry, a resumed job), the growth finds it reached.
    grow_target_gib: int | None = None
    # Who runs the task holding `lock` (backends/sim/state.py): a lock whose owner is
    # gone is a task that finished meanwhile.
    lock_owner: str | None = None
    # The public host key its sshd presents ("ssh-ed25519 AAAA..."): its own, made at
    # clone, or the one deploybot chose once the identity installed it.
    host_key: str | None = None
    # The private host key its stored user-data holds (the chosen mode), as vSphere's
    # guestinfo.userdata would, until deploybot forgets it.
    user_data_key: str | None = None
    # The host certificate its sshd presents beside `host_key` (HostCertificate): the one
    # deploybot's host CA signed, installed through the agent or with the chosen key.
    host_certificate: str | None = None
    # Its NICs' MACs in order (lower-case): the first made at clone (or the fixed one),
    # the later ones when the identity adds them.
    macs: tuple[str, ...] = ()

    def info(self) -> VMInfo:
        return VMInfo(self.vm_id, self.name, self.running, frozenset(self.tags), self.placement)


DEFAULT_TEMPLATES = (
    Template("ubuntu-24.04", "ubuntu", None, "local-lvm", 4, "ubuntu"),
    Template("debian-12", "debian", None, "local-lvm", 3, "debian"),
    Template("rocky-9", "el9", None, "local-lvm", 10, "rocky"),
)


class SimNetwork(BaseModel):
    """A network of the simulator (`[[backends.networks]]`): a bridge (VLAN-aware or
    not), a standard or distributed portgroup, or a distributed switch's uplink
    portgroup (never a VM's), on `placements` (empty: on every one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    kind: Literal["bridge", "portgroup", "distributed", "uplink"] = "bridge"
    vlan_aware: bool = False  # a bridge that carries VLAN tags
    placements: tuple[str, ...] = ()  # where it exists; empty: every placement

    def on(self, placement: str | None) -> bool:
        return not self.placements or placement is None or placement in self.placements


# vmbr0 carries no tags, vmbr1 does: as on a Proxmox node set up for VLANs on vmbr1.
DEFAULT_NETWORKS = (SimNetwork(name="vmbr0"), SimNetwork(name="vmbr1", vlan_aware=True))

DEFAULT_STORAGES = (
    ("local-lvm", 512 * GIB, 380 * GIB, True),
    ("bulk-nfs", 4096 * GIB, 2900 * GIB, False),
)


def sim_mac(vm_id: str, index: int) -> str:
    """The MAC the simulator gives a VM's NIC `index` (0: the first), as Proxmox would
    (its BC:24:11 prefix): derived from the VM id, so the same VM keeps the same MACs."""
    low = hashlib.sha256(f"{vm_id}/{index}".encode()).digest()[:3]
    return ":".join(f"{b:02x}" for b in (0xBC, 0x24, 0x11, *low))


def vm_to_dict(vm: SimVM) -> dict[str, Any]:
    identity = None
    if vm.identity is not None:
        identity = {
            **dataclasses.asdict(dataclasses.replace(vm.identity, host_key=None)),
            "address": str(vm.identity.address),
            "gateway": str(vm.identity.gateway),
            "dns": [str(d) for d in vm.identity.dns],
            "more_nics": [
                {
                    "address": str(n.address),
                    "gateway": str(n.gateway) if n.gateway else None,
                    "segment": dataclasses.asdict(n.segment) if n.segment else None,
                    "mac": n.mac,
                }
                for n in vm.identity.more_nics
            ],
        }
    fields = (
        "vm_id", "name", "template", "placement", "storage", "disk_gib", "running", "lock",
        "lock_owner", "host_key", "user_data_key", "host_certificate",
    )  # fmt: skip
    return {
        **{f: getattr(vm, f) for f in fields},
        "tags": sorted(vm.tags),
        "identity": identity,
        "address": str(vm.address) if vm.address else None,
        "grow_target_gib": vm.grow_target_gib,
        "macs": list(vm.macs),
    }


def vm_from_dict(item: dict[str, Any]) -> SimVM:
    identity = None
    if item["identity"] is not None:
        raw = item["identity"]
        identity = Identity(
            **{
                **{k: v for k, v in raw.items() if k != "host_key"},
                "ssh_keys": tuple(raw["ssh_keys"]),
                "address": ipaddress.IPv4Interface(raw["address"]),
                "gateway": ipaddress.IPv4Address(raw["gateway"]),
                "dns": tuple(ipaddress.IPv4Address(d) for d in raw["dns"]),
                "segment": Segment(**raw["segment"]) if raw.get("segment") else None,
                "more_nics": tuple(_nic(n) for n in raw.get("more_nics") or ()),
                "search_domains": tuple(raw.get("search_domains") or ()),
            }
        )
    return SimVM(
        item["vm_id"],
        item["name"],
        item["template"],
        item["placement"],
        item["storage"],
        item["disk_gib"],
        set(item["tags"]),
        item["running"],
        item["lock"],
        identity,
        address=ipaddress.IPv4Address(item["address"]) if item.get("address") else None,
        grow_target_gib=item.get("grow_target_gib"),
        lock_owner=item.get("lock_owner"),
        host_key=item.get("host_key"),
        user_data_key=item.get("user_data_key"),
        host_certificate=item.get("host_certificate"),
        macs=tuple(item.get("macs") or ()),
    )


def _nic(raw: dict[str, Any]) -> Nic:
    return Nic(
        ipaddress.IPv4Interface(raw["address"]),
        ipaddress.IPv4Address(raw["gateway"]) if raw.get("gateway") else None,
        Segment(**raw["segment"]) if raw.get("segment") else None,
        raw.get("mac"),
    )


def update_vm(vm: SimVM, item: dict[str, Any]) -> None:
    """`vm` as another process left it, changed in place: tasks and waiters hold it."""
    fresh = vm_from_dict(item)
    was_running = vm.running
    for name in (f.name for f in dataclasses.fields(SimVM)):
        if name not in ("booted", "stopped", "boot_task"):
            setattr(vm, name, getattr(fresh, name))
    if vm.running and not was_running:
        vm.stopped.clear()
        vm.booted.set()  # it booted in the process that started it
    elif was_running and not vm.running:
        gone(vm)


def gone(vm: SimVM) -> None:
    """Stopped, or removed by another process: its waiters stop waiting."""
    vm.running = False
    vm.booted.clear()
    vm.stopped.set()
    if vm.boot_task:
        vm.boot_task.cancel()


OPERATIONS = (
    "templates",
    "find_by_name",
    "clone",
    "apply_identity",
    "grow_disk",
    "power_on",
    "wait_for_address",
    "probe_ssh",
    "host_keys",
    "forget_host_key",
    "install_host_certificate",
    "power_off",
    "destroy",
    "addresses_in_use",
    "create_template",
    "publish_template",
)


class Config(BackendConfig):
    """`kind = "sim"`: the built-in simulator; `time_scale` multiplies every duration."""

    kind: Literal["sim"]
    placements: tuple[str, ...] = ("node1", "node2")
    time_scale: float = Field(default=1.0, gt=0, le=100)
    state_file: Path | None = None  # keep the inventory across restarts of the bot
    faults: tuple[Fault, ...] = ()  # e.g. [{op = "power_on", kind = "error"}]
    # "agent": its guest agent reads the guests' host keys; "chosen": it installs the key
    # deploybot chose; "none": neither (the key is only seen over SSH).
    host_keys: HostKeyMode = "agent"
    # Its networks per placement (issue 29): vmbr0, and vmbr1 VLAN-aware, by default.
    networks: tuple[SimNetwork, ...] = DEFAULT_NETWORKS

    @field_validator("faults")
    @classmethod
    def _known_operations(cls, faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
        for fault in faults:
            if fault.op not in OPERATIONS:
                raise ValueError(f"unknown operation {fault.op!r}; one of {', '.join(OPERATIONS)}")
        return faults


class Effect:
    """What a hypervisor task does to the VM when it succeeds, and when it fails (a
    failed clone leaves no VM: it is taken out of `vms`)."""

    def __init__(
        self,
        vm: SimVM,
        vms: dict[str, SimVM],
        apply: Callable[[], None] | None = None,
        *,
        remove: bool = False,
    ) -> None:
        self._vm = vm
        self._vms = vms
        self._apply = apply
        self._remove_on_failure = remove

    def apply(self) -> None:
        if self._apply:
            self._apply()

    def fail(self) -> None:
        if self._remove_on_failure:
            self._vms.pop(self._vm.vm_id, None)
