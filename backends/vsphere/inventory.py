# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""Finding things in a vSphere inventory: datacenter, placement, templates, datastores,
networks, and our VMs by instance UUID. Blocking; runs inside `Session.run`.

Kept between operations: a clone's plan (from `prepare_clone` to `clone`); which VM
each template name was, checked at every use (its name and template mark are read
again) so that a deploy reads one template instead of every VM; the template list,
until the tracker sees a template come, go or change its name; the datacenter,
networks, clusters/hosts and datastores (the inventory's shape), for SHAPE_TTL_S or
until a plan fails on them; which object each instance UUID was found at, used only
while it still has that UUID. The name, template-mark and (ESXi) MAC checks read the
session's tracker (`Conn.tracked`), which learns only what changed since it last
looked. VMs are always identified by instance UUID: managed object ids belong to one
server's database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pyVmomi import vim, vmodl

from backends.base import CloneSpec, PermanentError, Segment
from backends.vsphere import nic
from backends.vsphere.conn import Conn, Props, Row
from backends.vsphere.vms import KnownVMs

if TYPE_CHECKING:
    from backends.vsphere.config import Config

# How long the inventory's shape (datacenter, networks, clusters and hosts, datastores)
# and the template list are trusted without reading them again (a plan that fails on
# them reads them again at once).
SHAPE_TTL_S = 300.0
TEMPLATE_PATHS = [
    "name",
    "config.template",
    "config.annotation",
    "config.guestId",
    "datastore",
    "config.hardware.device",
    *nic.TOOLS_PATHS,  # whether its guest can drive a vmxnet NIC
]

# A remembered template is read whole in one request: `config` holds the parts above
# and is what the clone or create spec copies.
KNOWN_TEMPLATE_PATHS = ["name", "datastore", "config", "guest.toolsVersionStatus2"]


def _with_config_parts(p: Props) -> Props:
    """TEMPLATE_PATHS' config parts taken from a whole `config`."""
    config = p.get("config")
    if config is None:
        return p
    parts = {
        "config.template": config.template,
        "config.annotation": config.annotation,
        "config.guestId": config.guestId,
        "config.hardware.device": config.hardware.device,
        "config.tools.toolsVersion": config.tools.toolsVersion if config.tools else None,
    }
    return {**p, **parts}


# VMware's range for MACs set by hand: 00:50:56:00:00:00 to 00:50:56:3f:ff:ff.
MANUAL_MACS = "00:50:56:00:00:00 to 00:50:56:3F:FF:FF"


def manual_mac(mac: str) -> bool:
    """Whether a MAC (aa:bb:cc:dd:ee:ff) is in VMware's range for MACs set by hand."""
    octets = mac.lower().split(":")
    return octets[:3] == ["00", "50", "56"] and int(octets[3], 16) <= 0x3F


@dataclass(frozen=True)
class Net:
    """A network as a NIC must name it: a standard one by name, a distributed portgroup
    by its switch's UUID and its key."""

    name: str
    obj: Any
    distributed: bool
    portgroup_key: str = ""
    switch_uuid: str = ""
    hosts: frozenset[str] = frozenset()  # the hosts it is on (moIds): a clone's host must be

    def __str__(self) -> str:
        return f"distributed portgroup {self.name}" if self.distributed else f"network {self.name}"

    def backing(self) -> Any:
        card = vim.vm.device.VirtualEthernetCard
        if self.distributed:
            # Naming a distributed portgroup like a standard network is accepted, and
            # leaves the NIC connected to nothing.
            port = vim.dvs.PortConnection(
                portgroupKey=self.portgroup_key, switchUuid=self.switch_uuid
            )
            return card.DistributedVirtualPortBackingInfo(port=port)
        return card.NetworkBackingInfo(network=self.obj, deviceName=self.name)


@dataclass(frozen=True)
class Plan:
    """Where a clone goes and what it copies, found once by `prepare_clone`."""

    datacenter: Any
    folder: Any
    pool: Any
    placement: str
    template: Any
    template_config: Any
    datastore: Any
    datastore_name: str
    network: Net | None
    nic: nic.NicFit | None = None  # the NIC model a deploy of the template sets
    # The NICs after the first (`CloneSpec.more_nics`), each with its network (None: the
    # first NIC's) and its fixed MAC (None: vCenter's, or on ESXi one chosen in `specs`).
    more: tuple[tuple[Net | None, str | None], ...] = ()
    mac: str | None = None  # the first NIC's fixed MAC (None: vCenter's or the host's)


@dataclass(frozen=True)
class Datacenter:
    obj: Any
    name: str
    vm_folder: Any
    host_folder: Any


def _uplink(props: Props) -> bool:
    return bool(props.get("config.uplink") or _uplink_tag(props))


def _uplink_tag(props: Props) -> bool:
    # The system tag is the marker some vCenter versions set where config.uplink is unset.
    return any(getattr(t, "key", "") == "SYSTEM/DVS.UPLINKPG" for t in props.get("tag") or [])


def annotation(spec: CloneSpec) -> str:
    return f"{spec.tag}\nDeployed by deploybot job {spec.job_id} from template {spec.template}."


def disks(devices: list[Any]) -> list[Any]:
    return [d for d in devices if isinstance(d, vim.vm.device.VirtualDisk)]


def os_family(guest_id: str) -> str:
    guest = guest_id.lower()
    for family in ("ubuntu", "debian", "windows", "sles", "photon", "coreos"):
        if family in guest:
            return family
    if any(el in guest for el in ("rhel", "centos", "rocky", "alma", "oracle")):
        return "el"
    return "other"


class Inventory:
    """Lookups under the configured datacenter, folders and filters; the VMs themselves
    are looked up by `known` (vms.py), whose tracker also shows the templates' marks."""

    def __init__(self, name: str, config: Config, known: KnownVMs) -> None:
        self.name = name
        self._known = known
        self.config = config
        self._lock = threading.Lock()
        self._templates: dict[str, Any] = {}  # name -> VM, checked at every use
        # The inventory's shape, which changes rarely: (when read, what).
        self._dc: tuple[float, Datacenter] | None = None
        self._nets: dict[str, tuple[float, Net]] = {}
        self._rows: dict[str, tuple[float, list[Row]]] = {}  # computes, datastores
        # The last template list: (when read, which VMs and names it was, rows).
        self._template_rows: tuple[float, frozenset[tuple[str, str]], list[Row]] | None = None

    def datacenter(self, conn: Conn) -> Datacenter:
        """The configured datacenter, read again after SHAPE_TTL_S or a `forget`."""
        with self._lock:
            cached = self._dc
        if cached is not None and time.monotonic() - cached[0] < SHAPE_TTL_S:
            return cached[1]
        dc = self._read_datacenter(conn)
        with self._lock:
            self._dc = (time.monotonic(), dc)
        return dc

    def forget(self) -> bool:
        """Drop the remembered inventory shape; True when there was some."""
        with self._lock:
            had = self._dc is not None or bool(self._nets) or bool(self._rows)
            self._dc, self._nets, self._rows = None, {}, {}
            self._template_rows = None
        return had

    def forget_templates(self) -> None:
        """Drop the template list and names: a build added, renamed or removed one."""
        with self._lock:
            self._templates, self._template_rows = {}, None

    def _read_datacenter(self, conn: Conn) -> Datacenter:
        paths = ["name", "vmFolder", "hostFolder"]
        rows = conn.contained(conn.content.rootFolder, vim.Datacenter, paths)
        wanted = self.config.datacenter
        found = [(o, p) for o, p in rows if wanted is None or p["name"] == wanted]
        if len(found) != 1:
            names = ", ".join(sorted(p["name"] for _o, p in rows)) or "none"
            problem = f"no datacenter {wanted!r}" if wanted else "several datacenters"
            raise PermanentError(f"{self.name}: {problem} (have: {names}); set `datacenter`")
        obj, p = found[0]
        return Datacenter(obj, p["name"], p["vmFolder"], p["hostFolder"])

    def computes(self, conn: Conn, dc: Datacenter) -> list[Row]:
        """Clusters and hosts, remembered for SHAPE_TTL_S (a plan failing reads again)."""
        return self._shape("computes", lambda: self._read_computes(conn, dc))

    def _read_computes(self, conn: Conn, dc: Datacenter) -> list[Row]:
        paths = ["name", "resourcePool", "host"]
        rows = conn.contained(dc.host_folder, vim.ComputeResource, paths)
        # Clusters first: under DRS, vSphere chooses the host.
        return sorted(rows, key=lambda r: not isinstance(r[0], vim.ClusterComputeResource))

    def datastore_names(self, conn: Conn, dc: Datacenter) -> list[Row]:
        """The datastores a plan chooses from, remembered like `computes` (the space
        figures in these rows are not kept up to date: `datastores` has fresh ones)."""
        return self._shape("datastores", lambda: self.datastores(conn, dc.obj))

    def _shape(self, key: str, read: Callable[[], list[Row]]) -> list[Row]:
        with self._lock:
            cached = self._rows.get(key)
        if cached is not None and time.monotonic() - cached[0] < SHAPE_TTL_S:
            return cached[1]
        rows = read()
        with self._lock:
            self._rows[key] = (time.monotonic(), rows)
        return rows

    def pool(self, conn: Conn, dc: Datacenter, placement: str | None) -> tuple[Any, str]:
        """The resource pool for "COMPUTE" or "COMPUTE/POOL/...", and that name."""
        configured = "/".join(p for p in (self.config.compute, self.config.resource_pool) if p)
        compute_name, _, pool_path = (placement or configured).partition("/")
        computes = self.computes(conn, dc)
        chosen = [r for r in computes if not compute_name or r[1]["name"] == compute_name]
        if not chosen:
            names = ", ".join(p["name"] for _o, p in computes)
            raise PermanentError(
                f"{compute_name!r} is not a cluster or host of {self.name} (have: {names})"
            )
        name = chosen[0][1]["name"]
        if not pool_path:
            return chosen[0][1]["resourcePool"], name
        pool = conn.find_path(f"{dc.name}/host/{name}/Resources/{pool_path}")
        if not isinstance(pool, vim.ResourcePool):
            raise PermanentError(f"no resource pool {pool_path!r} in {name} on {self.name}")
        return pool, f"{name}/{pool_path}"

    def folder(self, conn: Conn, dc: Datacenter, path: str | None) -> Any:
        if not path:
            return dc.vm_folder
        folder = conn.find_path(f"{dc.name}/vm/{path}")
        if not isinstance(folder, vim.Folder):
            raise PermanentError(f"no VM folder {path!r} in {dc.name} on {self.name}")
        return folder

    def templates(self, conn: Conn, dc: Datacenter) -> list[Row]:
        """VMs marked as templates, in `template_folder`, whose annotation contains
        `template_annotation` (each filter only when configured).

        The template marks come from the session's tracker (what changed since its
        last look; with `template_folder`, a read of that folder's VMs' marks); the
        heavier properties (devices, annotation) are read for the templates alone, and
        only when the set of templates or their names changed, or after SHAPE_TTL_S
        (an annotation edited on a template shows then). Reading the devices of every
        VM cost megabytes per lookup in an inventory of a few hundred VMs.
        """
        if self.config.template_folder:
            root = self.folder(conn, dc, self.config.template_folder)
            marks = conn.contained(root, vim.VirtualMachine, ["config.template"])
        else:  # the marks of every VM: what changed since the last look
            marks = list(self._known.tracked_vms(conn).values())
        found = [obj for obj, p in marks if p.get("config.template")]
        # Read again only when the templates changed (one came, went, was renamed,
        # or was turned into a VM, as editing one needs), or after SHAPE_TTL_S.
        key = frozenset((o._moId, str(p.get("name"))) for o, p in marks if p.get("config.template"))
        with self._lock:
            cached = self._template_rows
        if cached is not None and cached[1] == key and time.monotonic() - cached[0] < SHAPE_TTL_S:
            return cached[2]
        rows = conn.retrieve(found, vim.VirtualMachine, TEMPLATE_PATHS)
        chosen = [r for r in rows if self._is_template(r[1])]
        with self._lock:
            self._templates = {p["name"]: obj for obj, p in chosen}
            self._template_rows = (time.monotonic(), key, chosen)
        return chosen

    def _is_template(self, p: Props) -> bool:
        needle = self.config.template_annotation or ""
        return bool(p.get("config.template")) and needle in str(p.get("config.annotation") or "")

    def template(self, conn: Conn, dc: Datacenter, name: str) -> Row:
        """The template called `name`. Which VM that is is remembered from the last
        lookup, so a deploy reads one VM's properties, not every VM's; a remembered
        VM that went, was renamed or is no longer a template means a fresh lookup."""
        with self._lock:
            known = self._templates.get(name)
        if known is not None:
            try:
                rows = conn.retrieve([known], vim.VirtualMachine, KNOWN_TEMPLATE_PATHS)
            except vmodl.fault.ManagedObjectNotFound:
                rows = []
            p = _with_config_parts(rows[0][1]) if rows else {}
            if p.get("name") == name and self._is_template(p):
                return known, p
        rows = self.templates(conn, dc)
        for obj, p in rows:
            if p["name"] == name:
                return obj, p
        names = ", ".join(sorted(p["name"] for _o, p in rows)) or "none"
        raise PermanentError(f"template {name!r} does not exist on {self.name} (have: {names})")

    def datastores(self, conn: Conn, root: Any) -> list[Row]:
        paths = ["name", "summary.capacity", "summary.freeSpace", "summary.accessible"]
        rows = conn.contained(root, vim.Datastore, paths)
        return [r for r in rows if r[1].get("summary.accessible", True)]

    def network(self, conn: Conn, dc: Datacenter, name: str) -> Net:
        """The network a NIC names, remembered for SHAPE_TTL_S: four reads otherwise."""
        with self._lock:
            cached = self._nets.get(name)
        if cached is not None and time.monotonic() - cached[0] < SHAPE_TTL_S:
            return cached[1]
        net = self._read_network(conn, dc, name)
        with self._lock:
            self._nets[name] = (time.monotonic(), net)
        return net

    def _read_network(self, conn: Conn, dc: Datacenter, name: str) -> Net:
        every = self.networks(conn, dc, uplinks=True)
        rows = [(o, p) for o, p in every if not _uplink(p)]
        if any(p["name"] == name and _uplink(p) for _o, p in every):
            raise PermanentError(
                f"{name!r} on {self.name} is an uplink portgroup: it carries the hosts' "
                "physical NICs, not VMs (vCenter would refuse the VM at power-on): name a "
                "VM portgroup of that switch instead (the subnet's [subnets.segments] "
                "network, or the backend's network)"
            )
        match = [(obj, p) for obj, p in rows if p["name"] == name]
        if not match:
            known = ", ".join(sorted(p["name"] for _o, p in rows))
            raise PermanentError(f"no network {name!r} on {self.name} (have: {known})")
        obj, props = match[0]
        hosts = frozenset(h._moId for h in props.get("host") or [])
        if not isinstance(obj, vim.dvs.DistributedVirtualPortgroup):
            return Net(name, obj, distributed=False, hosts=hosts)
        pg_paths = ["key", "config.distributedVirtualSwitch"]
        pg = conn.props(obj, vim.dvs.DistributedVirtualPortgroup, pg_paths)
        switch = pg["config.distributedVirtualSwitch"]
        switch_uuid = conn.props(switch, vim.DistributedVirtualSwitch, ["uuid"])["uuid"]
        return Net(name, obj, True, pg["key"], switch_uuid, hosts)

    def networks(self, conn: Conn, dc: Datacenter, *, uplinks: bool = False) -> list[Row]:
        """The networks a NIC may use: every one but the uplink portgroups of distributed
        switches, which carry the hosts' physical NICs and no VM (vCenter refuses such
        a NIC only when the VM powers on); with `uplinks`, those too."""
        pg_paths = (vim.dvs.DistributedVirtualPortgroup, ["config.uplink", "tag"])
        rows = conn.contained(dc.obj, vim.Network, ["name", "host"], (pg_paths,))  # one read
        return [(o, p) for o, p in rows if uplinks or not _uplink(p)]

    def reaches(self, conn: Conn, dc: Datacenter, net: Net, placement: str) -> None:
        """Refuse a network that no host of the clone's cluster (or host) is on: the
        clone would be refused, or its NIC left connected to nothing."""
        compute = placement.split("/", 1)[0]
        rows = [p for _o, p in self.computes(conn, dc) if p["name"] == compute]
        hosts = {h._moId for p in rows for h in p.get("host") or []}
        if not hosts or not net.hosts or hosts & net.hosts:
            return
        raise PermanentError(
            f"{net} on {self.name} is not on any host of {compute}: add {compute}'s hosts "
            "to its switch, deploy to a cluster or host that has it (on=), or give the "
            "subnet a network there"
        )

    def plan(self, conn: Conn, spec: CloneSpec) -> Plan:
        try:
            found = self._plan(conn, spec)
        except (vmodl.fault.ManagedObjectNotFound, PermanentError):
            # Perhaps the remembered shape is out of date (a datacenter or portgroup
            # removed or renamed): once more, with everything read afresh.
            if not self.forget():
                raise
            found = self._plan(conn, spec)
        if found.nic is not None and found.nic.problem:  # the template's, not a stale shape
            raise PermanentError(found.nic.problem)
        return found

    def _plan(self, conn: Conn, spec: CloneSpec) -> Plan:
        dc = self.datacenter(conn)
        template, t_props = self.template(conn, dc, spec.template)
        pool, placement = self.pool(conn, dc, spec.placement)
        stores = self.datastore_names(conn, dc)
        wanted = spec.storage or self.config.datastore
        if wanted:
            chosen = [r for r in stores if r[1]["name"] == wanted]
        else:
            own = {d._moId for d in t_props.get("datastore") or []}
            chosen = [r for r in stores if r[0]._moId in own]
        if not chosen:
            known = ", ".join(sorted(p["name"] for _o, p in stores))
            raise PermanentError(f"no datastore {wanted!r} on {self.name} (have: {known})")
        config = t_props.get("config")
        if config is None:  # found by a fresh lookup, which does not read it all
            config = conn.props(template, vim.VirtualMachine, ["config"])["config"]
        wanted_net = spec.nic.network if spec.nic else self.config.network
        network = self.network(conn, dc, wanted_net) if wanted_net else None
        if network is not None and spec.segment is not None:
            self.reaches(conn, dc, network, placement)
        more = tuple(
            (self._more_net(conn, dc, n.segment, placement), n.mac) for n in spec.more_nics
        )
        for mac in (spec.mac, *(n.mac for n in spec.more_nics)):
            if mac is not None and not manual_mac(mac):
                raise PermanentError(
                    f"MAC {mac} is outside VMware's range for MACs set by hand "
                    f"({MANUAL_MACS}), which {self.name}'s hosts refuse at power-on: choose "
                    "one in that range, or leave mac= out (vSphere then generates one)"
                )
        folder = self.folder(conn, dc, self.config.vm_folder)
        store, store_props = chosen[0]
        plan = Plan(
            dc.obj, folder, pool, placement, template, config, store, store_props["name"], network
        )
        return replace(plan, nic=self.nic_fit(spec.template, t_props), more=more, mac=spec.mac)

    def _more_net(
        self, conn: Conn, dc: Datacenter, segment: Segment | None, placement: str
    ) -> Net | None:
        """A later NIC's network: its subnet's segment, checked as the first NIC's is;
        None (no segment): on the first NIC's network."""
        if segment is None:
            return None
        network = self.network(conn, dc, segment.network)
        self.reaches(conn, dc, network, placement)
        return network

    def nic_fit(self, name: str, props: Props) -> nic.NicFit:
        """The NIC model for template `name` (its TEMPLATE_PATHS) and whether it fits."""
        family = os_family(str(props.get("config.guestId") or ""))
        c = self.config
        return nic.fit(self.name, c.os_profiles, c.template_os, name, family, props)
