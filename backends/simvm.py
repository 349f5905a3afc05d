"""The simulator's data: its VMs, timings and faults, and how its state file keeps them.

Split from backends/sim.py (the simulator's behaviour), which re-exports what tests use.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import ipaddress
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.base import Identity, Template, VMInfo

FaultKind = Literal["error", "hang", "crash", "flaky"]
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

    def info(self) -> VMInfo:
        return VMInfo(self.vm_id, self.name, self.running, frozenset(self.tags), self.placement)


DEFAULT_TEMPLATES = (
    Template("ubuntu-24.04", "ubuntu", None, "local-lvm", 4, "ubuntu"),
    Template("debian-12", "debian", None, "local-lvm", 3, "debian"),
    Template("rocky-9", "el9", None, "local-lvm", 10, "rocky"),
)
DEFAULT_STORAGES = (
    ("local-lvm", 512 * GIB, 380 * GIB, True),
    ("bulk-nfs", 4096 * GIB, 2900 * GIB, False),
)


def fake_fingerprint(vm_id: str) -> str:
    """A stable, obviously simulated host key fingerprint for a simulated guest."""
    digest = hashlib.sha256(f"deploybot-sim-{vm_id}".encode()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def vm_to_dict(vm: SimVM) -> dict[str, Any]:
    identity = None
    if vm.identity is not None:
        identity = {
            **dataclasses.asdict(vm.identity),
            "address": str(vm.identity.address),
            "gateway": str(vm.identity.gateway),
            "dns": [str(d) for d in vm.identity.dns],
        }
    fields = ("vm_id", "name", "template", "placement", "storage", "disk_gib", "running", "lock")
    return {
        **{f: getattr(vm, f) for f in fields},
        "tags": sorted(vm.tags),
        "identity": identity,
        "address": str(vm.address) if vm.address else None,
    }


def vm_from_dict(item: dict[str, Any]) -> SimVM:
    identity = None
    if item["identity"] is not None:
        raw = item["identity"]
        identity = Identity(
            **{
                **raw,
                "ssh_keys": tuple(raw["ssh_keys"]),
                "address": ipaddress.IPv4Interface(raw["address"]),
                "gateway": ipaddress.IPv4Address(raw["gateway"]),
                "dns": tuple(ipaddress.IPv4Address(d) for d in raw["dns"]),
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
    )
