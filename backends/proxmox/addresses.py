"""The IPv4 addresses every VM of the cluster uses (`addresses_in_use`), for IPAM's
conflict check before a clone.

Proxmox has no bulk read of VM configs or agent answers: after the one VM listing
(`/cluster/resources?type=vm`, templates left out), each VM's config is read for its
static `ipconfigN` addresses (`ip=10.0.0.5/24,gw=...`; `dhcp` gives none), and each
running VM whose config enables the agent is asked `agent/network-get-interfaces`
(a guest may have addresses of its own besides its cloud-init one).
That is a request or two per VM, so:

* The caller's own installation's VMs (their tags in the listing) are not read at
  all: their jobs hold their addresses in deploybot's store, which the caller asks
  first. Only VMs built by hand or by another installation cost requests.

* At most `addresses_parallel` of them are in flight at once: the API's connections
  (`max_parallel_requests`) are shared with the deploys, which must not queue behind
  a sweep of hundreds of VMs.
* One sweep serves every caller for `addresses_cache_s` (a burst of requests checking
  their addresses costs one sweep), and callers that come while it runs share it.
  This process's own clones do not drop it: the addresses of deploybot's VMs are held
  by their jobs in the store, which the caller asks first; 50 deploys at once would
  otherwise each sweep the whole cluster. A VM this process destroys is `forget`-ten:
  taken out of the kept answer (and of a sweep running then), so its address is free
  at once.

The same configs give every VM's MACs (`netN`) for the check of a fixed `mac=`
(`macs`): each config a sweep read within `addresses_cache_s` is reused, so a MAC check
right after the address check reads only the configs that one left out (this
installation's own VMs).

A guest agent that is silent, not running or not configured is just "no reported
addresses" (a guest's business, not an error); the API not answering, or refusing a
read (403: the agent needs VM.GuestAgent.Audit, before PVE 9 VM.Monitor), fails the
whole sweep: a shorter list would read as "no conflict" (except the VMs of a node
that is down, listed with status unknown: left out and logged, so one node down does
not stop every deploy; they run nothing meanwhile). VMs the API user may not
see at all (a token limited to a pool) are left out of the listing by Proxmox
itself: a complete check needs VM.Audit on /vms. Containers (LXC) are not read.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Callable
from typing import Any

from backends.base import AddressUse, PermanentError, RetryableError, Unreachable
from backends.guestaddr import listable, reported_addresses
from backends.proxmox.agent import interfaces
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import Forbidden
from backends.proxmox.inventory import LISTING_REUSE_S, Inventory
from backends.tags import parse_tag

log = logging.getLogger(__name__)
_IPCONFIG = re.compile(r"ipconfig\d+")
_NET = re.compile(r"net\d+")
_MAC = re.compile(r"[0-9a-f]{2}(?::[0-9a-f]{2}){5}")
AGENT = "guest agent"


def configured(config: dict[str, Any]) -> list[tuple[ipaddress.IPv4Address, str]]:
    """The static IPv4 addresses in a config's `ipconfigN` keys, with the key."""
    found: list[tuple[ipaddress.IPv4Address, str]] = []
    for key in sorted(k for k in config if _IPCONFIG.fullmatch(k)):
        for part in str(config[key]).split(","):
            name, _, value = part.strip().partition("=")
            if name != "ip" or value == "dhcp":
                continue
            try:
                ip = ipaddress.IPv4Interface(value).ip
            except ValueError:  # not something this server would have accepted
                continue
            if listable(ip):
                found.append((ip, key))
    return found


def macs_of(config: dict[str, Any]) -> frozenset[str]:
    """The MACs (lower-case) of a config's `netN` lines, in either spelling
    (`virtio=BC:24:11:..,...` or `model=virtio,macaddr=BC:24:11:..,...`)."""
    found: set[str] = set()
    for key in (k for k in config if _NET.fullmatch(k)):
        for part in str(config[key]).split(","):
            value = part.partition("=")[2].strip().lower()
            if _MAC.fullmatch(value):
                found.add(value)
    return frozenset(found)


def _reachable(vms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Leave out the VMs of nodes that are down (listed with status unknown): their
    configs cannot be read while the node is away, and one node down must not stop every
    deploy's conflict check. They run nothing now; said in the log, not hidden."""
    away = [i for i in vms if i.get("status") == "unknown"]
    if away:
        nodes = sorted({str(i.get("node")) for i in away})
        log.warning(
            "addresses of %d VM(s) on node(s) %s not read: the node is offline",
            len(away),
            ", ".join(nodes),
        )
    return [i for i in vms if i.get("status") != "unknown"]


def _built_by(item: dict[str, Any], installation: str | None) -> bool:
    """Whether the listing's tags say `installation` built this VM."""
    if installation is None:
        return False
    marks = (parse_tag(t.strip()) for t in str(item.get("tags") or "").split(";"))
    return any(m is not None and m.installation == installation for m in marks)


def agent_enabled(config: dict[str, Any]) -> bool:
    """`agent: [enabled=]<1|0>[,fstrim_cloned_disks=..][,type=..]`."""
    for part in str(config.get("agent", "0")).split(","):
        name, _, value = part.partition("=")
        if not value:  # the default key: `1,type=virtio`
            name, value = "enabled", name
        if name == "enabled":
            return value.strip().lower() in ("1", "true", "yes", "on")
    return False


class AddressSweep:
    def __init__(
        self,
        api: PveApi,
        inventory: Inventory,
        *,
        cache_s: float,
        parallel: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.api = api
        self.inventory = inventory
        self.cache_s = cache_s
        self.parallel = parallel
        # Injectable: tests move time on to expire the cached answer.
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.sweeps = 0  # how many were made (tests)
        self._answer: tuple[float, list[AddressUse]] | None = None
        self._flight: asyncio.Future[list[AddressUse]] | None = None
        self._forgotten: dict[str, float] = {}  # VM id -> when this process destroyed it
        self._ours: str | None = None  # the installation whose VMs the kept answer left out
        # VM id -> when its config was read, its name and MACs (`macs` reuses them).
        self._configs: dict[str, tuple[float, str, frozenset[str]]] = {}

    def _fresh(self, ours: str | None) -> list[AddressUse] | None:
        if self._answer is None or self._ours != ours:
            return None
        began, uses = self._answer
        return list(uses) if self.clock() - began < self.cache_s else None

    def forget(self, vm_id: str) -> None:
        """This process destroyed the VM: its addresses are free now."""
        self._forgotten[vm_id] = self.clock()
        self._configs.pop(vm_id, None)
        if self._answer is not None:
            began, uses = self._answer
            self._answer = (began, [u for u in uses if u.vm_id != vm_id])

    async def addresses(self, ours: str | None = None) -> list[AddressUse]:
        kept = self._fresh(ours)
        if kept is not None:
            return kept
        if self._flight is None or self._ours != ours:
            self._ours = ours
            self._flight = asyncio.ensure_future(self._sweep(self.clock(), ours))
            flight = self._flight
            flight.add_done_callback(lambda _f: self._landed(flight))
        # One caller's cancel (a step timeout) is not everyone's.
        return list(await asyncio.shield(self._flight))

    def _landed(self, flight: asyncio.Future[list[AddressUse]]) -> None:
        if self._flight is flight:
            self._flight = None
        if not flight.cancelled():
            flight.exception()  # seen here, so never "exception was never retrieved"

    async def _sweep(self, began: float, ours: str | None) -> list[AddressUse]:
        self.sweeps += 1
        vms = [
            i
            for i in await self.inventory.vms(LISTING_REUSE_S)
            if i.get("template") not in (1, "1", True) and not _built_by(i, ours)
        ]
        vms = _reachable(vms)
        limit = asyncio.Semaphore(self.parallel)
        reads = [asyncio.ensure_future(self._vm(item, limit)) for item in vms]
        try:
            found = await asyncio.gather(*reads)
        except BaseException:
            for read in reads:  # one failed: the answer is lost, stop asking
                read.cancel()
            raise
        # A VM destroyed while this ran may be in its listing; a vmid forgotten before
        # it began may name a new VM now (Proxmox reuses them).
        self._forgotten = {v: at for v, at in self._forgotten.items() if at >= began}
        uses = [use for uses in found for use in uses if use.vm_id not in self._forgotten]
        self._answer = (began, uses)  # as old as the listing it started from
        return uses

    async def _vm(self, item: dict[str, Any], limit: asyncio.Semaphore) -> list[AddressUse]:
        vm_id, node = str(item["vmid"]), str(item["node"])
        async with limit:
            config = await self.inventory.vm_config(node, vm_id)
        if config is None:
            return []  # destroyed since the listing (or migrating: its config moves last)
        name = str(config.get("name") or item.get("name") or vm_id)
        self._configs[vm_id] = (self.clock(), name, macs_of(config))
        uses = {ip: AddressUse(ip, vm_id, name, key) for ip, key in configured(config)}
        if item.get("status") == "running" and agent_enabled(config):
            async with limit:
                reported = await self._agent(node, vm_id)
            for ip in reported:
                uses.setdefault(ip, AddressUse(ip, vm_id, name, AGENT))
        return list(uses.values())

    async def macs(self) -> dict[str, str]:
        """Every VM's MACs (templates left out) -> "name (id)": the configs read within
        `cache_s` (by a sweep or an earlier call) reused, the others read now, at most
        `parallel` at once. Complete or raising, as `addresses`."""
        vms = [
            i
            for i in _reachable(await self.inventory.vms(LISTING_REUSE_S))
            if i.get("template") not in (1, "1", True)
        ]
        limit = asyncio.Semaphore(self.parallel)
        found = await asyncio.gather(*(self._macs_of(item, limit) for item in vms))
        return {mac: f"{name} ({vm_id})" for vm_id, name, macs in found for mac in sorted(macs)}

    async def _macs_of(
        self, item: dict[str, Any], limit: asyncio.Semaphore
    ) -> tuple[str, str, frozenset[str]]:
        vm_id, node = str(item["vmid"]), str(item["node"])
        kept = self._configs.get(vm_id)
        if kept is not None and self.clock() - kept[0] < self.cache_s:
            return vm_id, kept[1], kept[2]
        async with limit:
            config = await self.inventory.vm_config(node, vm_id)
        if config is None:
            return vm_id, "", frozenset()  # destroyed since the listing
        name = str(config.get("name") or item.get("name") or vm_id)
        self._configs[vm_id] = (self.clock(), name, macs_of(config))
        return vm_id, name, self._configs[vm_id][2]

    async def _agent(self, node: str, vm_id: str) -> list[ipaddress.IPv4Address]:
        """What the guest agent reports; nothing when it does not answer. Proxmox
        says so with a 500 ("QEMU guest agent is not running", "No QEMU guest agent
        configured", "VM 104 is not running", a QMP command that "got timeout") that
        the API maps to a PermanentError or, for the timeout and the agent not running
        (`AgentNotRunning`), a RetryableError."""
        path = f"nodes/{node}/qemu/{vm_id}/agent/network-get-interfaces"
        try:
            answer = await self.api.get(path, f"guest agent of VM {vm_id}")
        except (Unreachable, Forbidden):
            raise  # the API, or our right to ask: the list would be short
        except (PermanentError, RetryableError):
            return []
        return reported_addresses(interfaces(answer))
