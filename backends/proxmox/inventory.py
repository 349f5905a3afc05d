"""What a Proxmox cluster has and can do: its release, nodes, templates, storages and
CPUs, and what a clone request implies (linked or full, possible at all).

Templates come from the template flag (`/cluster/resources?type=vm`), never from names;
storages come with their capacity in the same call that lists them. Facts that do not
change while the bot runs (the release, the cluster's name, a node's CPU) are read once;
templates and storage types are cached for `discovery_cache_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from backends.base import CloneMode, CloneSpec, PermanentError, Template, VMNotFound
from backends.proxmox.api import PveApi
from backends.proxmox.config import Config, OSProfile
from backends.proxmox.vmconfig import (
    GIB,
    Disk,
    boot_disk,
    cpu_model,
    family_of,
    missing_cpu_flags,
    parse_release,
    tags_of,
)

T = TypeVar("T")

# Storage types whose volumes can back a linked clone; file-based ones only with qcow2.
LINKED_TYPES = frozenset({"zfspool", "lvmthin", "rbd", "btrfs", "dir", "nfs", "cifs"})
_FILE_TYPES = frozenset({"dir", "nfs", "cifs", "glusterfs", "btrfs"})
# Models every QEMU offers whatever the host CPU (`host` is the host CPU itself).
_ALWAYS = frozenset({"host", "kvm64", "qemu64"})
_INF = float("inf")


def _name(item: dict[str, Any]) -> str:
    """A listed VM's name as its config would give it (a VM without one: its vmid)."""
    return str(item.get("name") or item["vmid"])


class NoSuchTemplate(PermanentError):
    """No template has the name asked for."""


@dataclass(frozen=True)
class TemplateInfo:
    vmid: int
    name: str
    node: str
    disk: Disk
    family: str

    def public(self, default_user: str) -> Template:
        gib = self.disk.size_bytes // GIB
        return Template(self.name, self.family, self.node, self.disk.storage, gib, default_user)


@dataclass(frozen=True)
class StorageInfo:
    name: str
    type: str
    shared: bool
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class NodeCpu:
    model: str
    flags: frozenset[str] | None  # None: the server did not say (the schema allows it)
    models: frozenset[str]  # what the node offers; read only when `flags` is missing


# How old a VM listing may be for a request's template lookup and address check (see
# Inventory.vms): they come within milliseconds of each other.
LISTING_REUSE_S = 1.0


class _Shared:
    """Concurrent callers asking the same question share one request: fifty deploys
    arriving together would otherwise read the same template configs fifty times."""

    def __init__(self) -> None:
        self._flights: dict[Hashable, asyncio.Future[Any]] = {}

    async def __call__(self, key: Hashable, ask: Callable[[], Awaitable[T]]) -> T:
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(ask())
            self._flights[key] = flight
            flight.add_done_callback(lambda _done: self._flights.pop(key, None))
        result: T = await asyncio.shield(flight)  # one caller's cancel is not everyone's
        return result


class Inventory:
    def __init__(self, config: Config, api: PveApi) -> None:
        self.config = config
        self.api = api
        self._release: tuple[int, int] | None = None
        self._cluster: str | Literal[False] | None = False  # False: not asked yet
        self._templates: dict[str, TemplateInfo] = {}
        self._template_configs: dict[tuple[int, str], TemplateInfo] = {}
        self._templates_at = float("-inf")
        self._named_at: dict[str, float] = {}  # when each template's config was read
        self._storages: dict[str, dict[str, StorageInfo]] = {}
        self._cpus: dict[str, NodeCpu] = {}
        self._shared = _Shared()
        # The last VM listing: when it was asked for, this process's changes by then
        # (`PveApi.changes`: a clone or destroy of its own makes it stale), and what.
        self._listing: tuple[float, int, list[dict[str, Any]]] | None = None
        self.known_vmids: frozenset[int] = frozenset()  # as the last VM listing had them

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # --- the server ---------------------------------------------------------------------

    async def release(self) -> tuple[int, int]:
        """The PVE release (`/version`), read once: it gates features such as ciupgrade."""
        if self._release is None:
            version = await self._shared("version", lambda: self.api.get("version", "version"))
            self._release = parse_release(str(version.get("release", "")))
        return self._release

    async def cluster_name(self) -> str | None:
        """The cluster's name; None for a standalone node."""
        if self._cluster is False:
            entries = await self._shared(
                "cluster", lambda: self.api.get("cluster/status", "cluster status")
            )
            names = [e.get("name") for e in entries if e.get("type") == "cluster"]
            self._cluster = str(names[0]) if names and names[0] else None
        return self._cluster

    async def online_nodes(self) -> list[str]:
        nodes = await self._shared("nodes", lambda: self.api.get("nodes", "node list"))
        return sorted(str(n["node"]) for n in nodes if n.get("status") == "online")

    async def default_node(self) -> str:
        if self.config.node:
            return self.config.node
        nodes = await self.online_nodes()
        if not nodes:
            raise PermanentError(f"{self.config.name}: no node is online")
        return nodes[0]

    async def vms(self, reuse_s: float = 0.0) -> list[dict[str, Any]]:
        """The cluster's VMs and templates (`/cluster/resources?type=vm`). `reuse_s`: a
        listing asked for at most that long ago does, unless this process changed
        something since: a request's template lookup and its address check list the
        VMs within milliseconds of each other. The name check before a clone and
        callers that decide about a VM (ownership, gc) always ask."""
        kept = self._listing
        if (
            reuse_s > 0
            and kept
            and self._now() - kept[0] <= reuse_s
            and kept[1] == self.api.changes
        ):
            items = kept[2]
        else:
            items = await self._shared("vms", self._list)
        # VMs and containers share one id space.
        self.known_vmids = frozenset(int(i["vmid"]) for i in items if "vmid" in i)
        return [i for i in items if i.get("type", "qemu") == "qemu"]

    async def _list(self) -> list[dict[str, Any]]:
        """One listing, kept with when it was asked for and this process's changes by
        then (callers joining it later share its age, not theirs)."""
        asked_at, changes = self._now(), self.api.changes
        items: list[dict[str, Any]] = await self.api.get("cluster/resources", "VM list", type="vm")
        if self._listing is None or self._listing[0] < asked_at:
            self._listing = (asked_at, changes, items)
        return items

    async def next_vmid(self) -> int:
        """`/cluster/nextid`: the lowest free id. Callers asking together share one answer
        (and must not all take it: see Cloning.free_vmid)."""
        answer = await self._shared("nextid", lambda: self.api.get("cluster/nextid", "VM id"))
        return int(answer)

    async def vm_config(self, node: str, vm_id: str) -> dict[str, Any] | None:
        """A VM's config (with its `digest`); None when there is no such VM on the node."""
        try:
            config: dict[str, Any] = await self.api.get(
                f"nodes/{node}/qemu/{vm_id}/config", f"config of VM {vm_id}"
            )
        except VMNotFound:
            return None
        return config

    # --- templates and storages ---------------------------------------------------------

    async def templates(self) -> dict[str, TemplateInfo]:
        """Templates by name, with their boot disk and OS family."""
        if self._now() - self._templates_at > self.config.discovery_cache_s:
            self._template_configs.clear()
        items = [i for i in await self.vms() if i.get("template") in (1, "1", True)]
        keys = [
            (int(i["vmid"]), str(i["node"])) for i in sorted(items, key=lambda i: int(i["vmid"]))
        ]
        missing = [k for k in keys if k not in self._template_configs]
        found = await asyncio.gather(*(self._template_config(k) for k in missing))
        self._template_configs.update(zip(missing, found, strict=True))
        by_name: dict[str, TemplateInfo] = {}
        for key in keys:
            by_name.setdefault(self._template_configs[key].name, self._template_configs[key])
        self._templates, self._templates_at = by_name, self._now()
        self._named_at = dict.fromkeys(by_name, self._templates_at)
        return by_name

    async def _template_config(self, key: tuple[int, str]) -> TemplateInfo:
        return await self._shared(("template", *key), lambda: self._read_template(*key))

    async def _read_template(self, vmid: int, node: str) -> TemplateInfo:
        config = await self.vm_config(node, str(vmid)) or {}
        name = str(config.get("name") or vmid)
        family = family_of(name, tags_of(config), self.config.template_os)
        return TemplateInfo(vmid, name, node, boot_disk(config), family)

    async def template(self, name: str) -> TemplateInfo:
        """The template called `name` (the lowest vmid, when several share it). The VM
        listing names every template, so only the config of this one is read, not one
        per template on the cluster."""
        found = self._templates.get(name)
        if found is not None and self._now() - self._named_at.get(name, -_INF) <= (
            self.config.discovery_cache_s
        ):
            return found
        items = [i for i in await self.vms(LISTING_REUSE_S) if i.get("template") in (1, "1", True)]
        named = sorted((int(i["vmid"]), str(i["node"])) for i in items if _name(i) == name)
        if not named:
            known = ", ".join(sorted({_name(i) for i in items})) or "none"
            raise NoSuchTemplate(
                f"template {name!r} does not exist on {self.config.name} (have: {known})"
            )
        info = self._template_configs[named[0]] = await self._template_config(named[0])
        self._templates[name], self._named_at[name] = info, self._now()
        return info

    def forget_templates(self) -> None:
        """Drop what is known of templates (a build renamed or added one): the next
        deploy reads them again."""
        self._templates, self._template_configs, self._named_at = {}, {}, {}
        self._templates_at = float("-inf")
        self._listing = None

    async def storages(self, node: str) -> list[StorageInfo]:
        """Storages for VM disks on a node, with free and total space from the same call."""
        items = await self.api.get(
            f"nodes/{node}/storage", "storage list", content="images", enabled=1
        )
        found = [
            StorageInfo(
                str(s["storage"]),
                str(s.get("type", "")),
                bool(s.get("shared")),
                int(s.get("total", 0)),
                int(s.get("avail", 0)),
            )
            for s in items
        ]
        self._storages[node] = {s.name: s for s in found}
        return found

    async def _storage_map(self, node: str) -> dict[str, StorageInfo]:
        if node not in self._storages:
            await self._shared(("storages", node), lambda: self.storages(node))
        return self._storages[node]

    # --- what a clone implies -----------------------------------------------------------

    def target_node(self, spec: CloneSpec, template: TemplateInfo) -> str:
        return spec.placement or self.config.node or template.node

    async def clone_mode(
        self, spec: CloneSpec, template: TemplateInfo, node: str
    ) -> tuple[CloneMode, str]:
        """Linked or full, the target storage and why; raise when it cannot be done.

        A linked clone needs the template's own storage, of a type with the clone
        feature (plain lvm has none; file storages only with qcow2); anything else is a
        full copy: minutes, not seconds.
        """
        storages = await self._storage_map(template.node)
        source = storages.get(template.disk.storage)
        if node != template.node and not (source and source.shared):
            raise PermanentError(
                f"template {template.name} is on {template.node}'s local storage "
                f"{template.disk.storage}: it can only be cloned on {template.node}"
            )
        target = spec.storage or self.config.storage or template.disk.storage
        if target not in storages:
            have = ", ".join(sorted(storages)) or "none"
            raise PermanentError(
                f"storage {target!r} does not exist on {template.node} (have: {have})"
            )
        kind = storages[target].type
        if target != template.disk.storage:
            why = f"{target} is not the template's storage ({template.disk.storage})"
        elif kind not in LINKED_TYPES:
            why = f"{target} ({kind}) cannot hold linked clones"
        elif kind in _FILE_TYPES and not template.disk.volume.endswith(".qcow2"):
            why = f"the template's disk on {target} is not qcow2"
        else:
            return CloneMode(True, f"linked clone on {target}: seconds"), target
        return CloneMode(False, f"{why}: full copy, minutes not seconds"), target

    def profile(self, family: str) -> OSProfile:
        return self.config.os_profiles.get(family) or OSProfile()

    def cpu_for(self, family: str) -> str:
        return self.profile(family).cpu or self.config.cpu

    async def check_baseline(self, template: TemplateInfo, node: str) -> None:
        """Refuse a node that cannot run the template's CPU model: its guest would die
        at boot ("Fatal glibc error: CPU does not support x86-64-v3")."""
        cpu = self.cpu_for(template.family)
        shortfall = await self.cpu_shortfall(cpu, node)
        if shortfall is not None:
            raise PermanentError(
                f"template {template.name} ({template.family}) needs CPU model "
                f"{cpu_model(cpu)}, but {shortfall}: its guest would "
                f"panic at boot. {await self._baseline_advice(template, node)}"
            )

    async def cpu_shortfall(self, cpu: str, node: str) -> str | None:
        """What node `node` lacks to run CPU model `cpu` (`node pve2 (Xeon ...) lacks
        avx2`); None when it can run it."""
        host = await self._cpu(node)
        missing = missing_cpu_flags(cpu, host.flags) if host.flags is not None else []
        offered = host.flags is not None or cpu_model(cpu) in host.models | _ALWAYS
        if not missing and offered:
            return None
        lacks = f"lacks {', '.join(missing)}" if missing else f"does not offer {cpu_model(cpu)}"
        return f"node {node} ({host.model}) {lacks}"

    async def _baseline_advice(self, template: TemplateInfo, node: str) -> str:
        """What to do instead; "another node" only where the template could go there."""
        source = (await self._storage_map(template.node)).get(template.disk.storage)
        if node == template.node and not (source and source.shared):
            return (
                f"The template is on {node}'s local storage {template.disk.storage}, so no "
                "other node can clone it either: copy the template to shared storage or to "
                "a node with that CPU, or change the OS profile's CPU model."
            )
        return "Deploy on another node (on=NODE), or change the OS profile."

    async def _cpu(self, node: str) -> NodeCpu:
        if node not in self._cpus:
            self._cpus[node] = await self._shared(("cpu", node), lambda: self._read_cpu(node))
        return self._cpus[node]

    async def _read_cpu(self, node: str) -> NodeCpu:
        status = await self.api.get(f"nodes/{node}/status", "node status")
        info = status.get("cpuinfo", {})
        raw = info.get("flags")  # real servers send it; the schema does not promise it
        flags = frozenset(str(raw).split()) if raw else None
        models: frozenset[str] = frozenset()
        if flags is None:
            offered = await self.api.get(f"nodes/{node}/capabilities/qemu/cpu", "CPU models")
            models = frozenset(str(m.get("name")) for m in offered)
        return NodeCpu(str(info.get("model", "unknown CPU")), flags, models)
