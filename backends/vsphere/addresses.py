"""The IPv4 addresses every VM of a vCenter or standalone host reports (`in_use`), for
IPAM's conflict check before a clone. Blocking; runs inside `Session.run`.

What VMware Tools reports of each VM, `guest.net` (each virtual NIC's addresses) and
`guest.ipAddress` (the primary one), with its name, template mark and instance UUID,
comes from the session's VM tracker (`KnownVMs.tracked_vms`, `ADDRESS_PATHS` among
the paths it keeps): read whole once per login, then brought up to date by one
`WaitForUpdatesEx` that returns only what changed since its last look. So the check
costs one small request whatever the size of the inventory, and still sees an address
a VM took a moment ago (the look starts after the check was asked). Reading every
VM's addresses for each check cost ~1.8 MB per check at 2,000 VMs.

vSphere keeps no "configured address" a VM has before its guest reports it: a VM
whose guest is stopped, or runs without Tools, lists nothing. (deploybot's own
clones carry theirs in guestinfo metadata, which this does not read: all VMs'
`config.extraConfig` is megabytes in a large inventory.)
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from backends.base import AddressUse
from backends.guestaddr import reported_addresses
from backends.vsphere.conn import Props, Row

# What the tracker keeps for this check besides the name, template mark and UUID.
ADDRESS_PATHS = ["guest.net", "guest.ipAddress"]


def in_use(rows: Iterable[Row]) -> list[AddressUse]:
    """The addresses of the tracked VMs (`rows`), templates left out."""
    return [use for obj, p in rows if not p.get("config.template") for use in _uses(obj, p)]


def _uses(obj: Any, p: Props) -> list[AddressUse]:
    # An inaccessible VM has no config: its managed object id is all there is.
    vm_id = str(p.get("config.instanceUuid") or obj._moId)
    name = str(p.get("name") or vm_id)
    found: dict[ipaddress.IPv4Address, AddressUse] = {}
    primary = [("guest", str(p.get("guest.ipAddress") or ""))]
    for source, pairs in (("guest.net", _nic_pairs(p)), ("guest.ipAddress", primary)):
        for ip in reported_addresses(pairs):
            found.setdefault(ip, AddressUse(ip, vm_id, name, source))
    return list(found.values())


def _nic_pairs(p: Props) -> list[tuple[str, str]]:
    """(interface, address) pairs of the VM's virtual NICs. An entry with deviceConfigId
    -1 is no virtual NIC but an interface inside the guest (a docker bridge): left out."""
    pairs: list[tuple[str, str]] = []
    for nic in p.get("guest.net") or []:
        if nic.deviceConfigId == -1:
            continue
        label = f"nic{nic.deviceConfigId}"
        configured = nic.ipConfig.ipAddress if nic.ipConfig else None
        pairs += [(label, str(a.ipAddress)) for a in configured or []]
        pairs += [(label, str(a)) for a in nic.ipAddress or []]
    return pairs
