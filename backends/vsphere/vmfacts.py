# mypy: disable-error-code="no-untyped-call"
"""The facts of a source's VMs (issue 30), from the properties a read-only session read:
what will not travel to Proxmox or needs a decision (`backends.migrating.VMFacts`).

Pure: `vm_facts` turns one VM's properties, and what was read around it (its folders'
names, the distributed portgroups' names, the clusters' DRS rules), into plain data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from pyVmomi import vim

from backends.migrating import Allocation, DiskFacts, NicFacts, VMFacts
from backends.vsphere.conn import Props, Row

# What the plan reads of each VM (one request for all of them).
VM_PATHS = [
    "name",
    "parent",
    "config.template",
    "config.instanceUuid",
    "config.guestId",
    "config.version",
    "config.hardware.device",
    "config.changeTrackingEnabled",
    "config.cpuAllocation",
    "config.memoryAllocation",
    "snapshot",
    "customValue",
    "availableField",
    "guest.toolsRunningStatus",
    "guest.toolsVersion",
]
# The kinds of DRS rule, by the class vSphere gives each.
RULE_KINDS: dict[type, str] = {
    vim.cluster.AffinityRuleSpec: "affinity",
    vim.cluster.AntiAffinityRuleSpec: "anti-affinity",
    vim.cluster.VmHostRuleInfo: "vm-host",
    vim.cluster.DependencyRuleInfo: "dependency",
}


def folder_paths(rows: Iterable[Row], root_id: str) -> dict[str, str]:
    """Each VM folder's path under the datacenter's VM folder (`root_id`: "")."""
    folders = {str(obj._moId): (str(p.get("name")), p.get("parent")) for obj, p in rows}
    paths = {root_id: ""}

    def path(moid: str, depth: int = 0) -> str:
        if moid in paths or moid not in folders or depth > 64:
            return paths.get(moid, "")
        name, parent = folders[moid]
        above = path(str(parent._moId), depth + 1) if parent is not None else ""
        paths[moid] = f"{above}/{name}" if above else name
        return paths[moid]

    for moid in folders:
        path(moid)
    return paths


def drs_rules(rows: Iterable[Row]) -> dict[str, list[tuple[str, str]]]:
    """The DRS rules naming each VM (by managed object id), from the clusters'
    configurationEx: affinity and anti-affinity rules list their VMs, a VM-host rule
    names a VM group."""
    named: dict[str, list[tuple[str, str]]] = {}
    for _obj, p in rows:
        config = p.get("configurationEx")
        if config is None:
            continue
        groups = {
            g.name: [str(v._moId) for v in g.vm or []]
            for g in getattr(config, "group", None) or []
            if isinstance(g, vim.cluster.VmGroup)
        }
        for rule in getattr(config, "rule", None) or []:
            kind = next((k for t, k in RULE_KINDS.items() if isinstance(rule, t)), "other")
            vms = [str(v._moId) for v in getattr(rule, "vm", None) or []]
            if isinstance(rule, vim.cluster.VmHostRuleInfo):
                vms = groups.get(rule.vmGroupName or "", [])
            if isinstance(rule, vim.cluster.DependencyRuleInfo):
                vms = groups.get(rule.vmGroup or "", []) + groups.get(
                    rule.dependsOnVmGroup or "", []
                )
            label = str(rule.name) + ("" if rule.enabled is not False else " (disabled)")
            for vm in vms:
                named.setdefault(vm, []).append((label, kind))
    return named


def vm_facts(
    obj: Any,
    p: Props,
    folders: Mapping[str, str],
    portgroups: Mapping[str, str],
    rules: Mapping[str, list[tuple[str, str]]],
    nic_models: Mapping[type, str],
    controller_models: Mapping[type, str],
) -> VMFacts:
    devices = p.get("config.hardware.device") or []
    by_key = {d.key: d for d in devices}
    labels = _labels(devices)
    parent = p.get("parent")
    fields = {f.key: str(f.name) for f in p.get("availableField") or []}
    attributes = sorted(
        (fields.get(v.key, str(v.key)), str(getattr(v, "value", ""))[:200])
        for v in p.get("customValue") or []
    )
    return VMFacts(
        source_id=str(p.get("config.instanceUuid") or ""),
        name=str(p.get("name") or ""),
        guest_id=str(p.get("config.guestId") or ""),
        folder=folders.get(str(parent._moId), "") if parent is not None else "",
        hardware_version=str(p.get("config.version") or ""),
        snapshots=tuple(_snapshots(getattr(p.get("snapshot"), "rootSnapshotList", None))),
        change_tracking=bool(p.get("config.changeTrackingEnabled")),
        custom_attributes=tuple(attributes),
        drs_rules=tuple(sorted(rules.get(str(obj._moId), []))),
        cpu=_allocation(p.get("config.cpuAllocation")),
        memory=_allocation(p.get("config.memoryAllocation")),
        tools_status=str(p.get("guest.toolsRunningStatus") or ""),
        tools_version=str(p.get("guest.toolsVersion") or ""),
        nics=tuple(
            _nic(d, labels[d.key], portgroups, nic_models)
            for d in devices
            if isinstance(d, vim.vm.device.VirtualEthernetCard)
        ),
        disks=tuple(
            _disk(d, labels[d.key], by_key, controller_models)
            for d in devices
            if isinstance(d, vim.vm.device.VirtualDisk)
        ),
    )


def _labels(devices: list[Any]) -> dict[int, str]:
    """Each device's label ("Network adapter 1"), with its key where two share one, so
    that a note names one device."""
    plain = {d.key: _label(d) for d in devices}
    seen = Counter(plain.values())
    return {k: label if seen[label] == 1 else f"{label} (key {k})" for k, label in plain.items()}


def _snapshots(trees: Any) -> list[str]:
    names: list[str] = []
    for tree in trees or []:
        names.append(str(tree.name))
        names += _snapshots(tree.childSnapshotList)
    return names


def _allocation(info: Any) -> Allocation:
    if info is None:
        return Allocation()
    shares: Any = getattr(info, "shares", None)
    level = str(getattr(shares, "level", None) or "normal")
    if level == "custom":
        level = f"custom:{shares.shares}"
    limit = info.limit
    return Allocation(
        reservation=int(info.reservation or 0),
        limit=-1 if limit is None else int(limit),
        shares=level,
    )


def _nic(
    device: Any, label: str, portgroups: Mapping[str, str], models: Mapping[type, str]
) -> NicFacts:
    backing = device.backing
    distributed = isinstance(
        backing, vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo
    )
    if distributed:
        key = str(backing.port.portgroupKey or "")
        network = portgroups.get(key, key)
    else:
        network = str(getattr(backing, "deviceName", "") or "")
    return NicFacts(
        label=label,
        model=model_of(models, device),
        mac=str(device.macAddress or ""),
        mac_manual=str(device.addressType or "").lower() == "manual",
        network=network,
        distributed=distributed,
    )


def _disk(
    device: Any, label: str, by_key: Mapping[int, Any], models: Mapping[type, str]
) -> DiskFacts:
    backing = device.backing
    controller = by_key.get(device.controllerKey)
    if isinstance(backing, vim.vm.device.VirtualDisk.FlatVer2BackingInfo):
        kind = "flat"
    elif isinstance(backing, vim.vm.device.VirtualDisk.RawDiskMappingVer1BackingInfo):
        kind = "rdm"
    else:
        kind = type(backing).__name__.rsplit(".", 1)[-1]
    thin, eager = _flags(backing)
    return DiskFacts(
        label=label,
        controller=model_of(models, controller) if controller is not None else "",
        capacity_kib=int(device.capacityInKB or 0),
        backing=kind,
        thin=None if thin is None else bool(thin),
        eager=None if eager is None else bool(eager),
    )


def _flags(backing: Any) -> tuple[Any, Any]:
    """A disk's two provisioning flags. A backing without them (sparse, SEsparse, some
    snapshot deltas) has them, if anywhere, on the root of its parent chain: the base
    disk. None, None when no backing of the chain says (never read as thick lazy)."""
    root = backing
    for _ in range(256):  # a chain is at most 255 deltas deep (vSphere's own limit)
        thin = getattr(root, "thinProvisioned", None)
        eager = getattr(root, "eagerlyScrub", None)
        if thin is not None or eager is not None or getattr(root, "parent", None) is None:
            return thin, eager
        root = root.parent
    return None, None


def _label(device: Any) -> str:
    info = getattr(device, "deviceInfo", None)
    return str(getattr(info, "label", "") or f"device {device.key}")


def model_of(models: Mapping[type, str], device: Any) -> str:
    for kind, name in models.items():
        if isinstance(device, kind):
            return name
    return type(device).__name__.rsplit(".", 1)[-1].removeprefix("Virtual").lower()
