# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""What a vSphere backend offers a deploy: templates, datastores, networks, placements,
the clone mode, and the privileges a deploy of a template lacks (`Discovery`, which
`VSphereBackend` holds and hands these calls to)."""

from __future__ import annotations

from collections.abc import Sequence

from pyVmomi import vim

from backends.base import (
    CloneMode,
    CloneSpec,
    MissingPrivilege,
    Network,
    PermanentError,
    Placement,
    Segment,
    Storage,
    Template,
)
from backends.vsphere import privileges
from backends.vsphere.config import Config
from backends.vsphere.inventory import Inventory, disks, os_family
from backends.vsphere.session import Op, Session

KIB_PER_GIB = 1024 * 1024


class Discovery:
    """The backend's discovery calls, through its session and inventory."""

    def __init__(self, config: Config, session: Session, inventory: Inventory) -> None:
        self.config = config
        self._session = session
        self._inventory = inventory

    async def templates(self) -> list[Template]:
        def work(op: Op) -> list[Template]:
            inv = self._inventory
            dc = inv.datacenter(op.conn)
            names = {o._moId: p["name"] for o, p in inv.datastore_names(op.conn, dc)}
            found = []
            for _obj, p in inv.templates(op.conn, dc):
                stores = [names.get(d._moId) for d in p.get("datastore") or []]
                size_kb = sum(d.capacityInKB for d in disks(p["config.hardware.device"]))
                family = os_family(str(p.get("config.guestId") or ""))
                store = next((s for s in stores if s), None)
                problem = inv.nic_fit(p["name"], p).problem  # refused at request time
                gib = size_kb // KIB_PER_GIB
                found.append(Template(p["name"], family, None, store, gib, problem=problem))
            return sorted(found, key=lambda t: t.name)

        return await self._session.run(work, changes=False)

    async def missing_privileges(
        self, template: str, segments: Sequence[Segment] = (), *, certificates: bool = False
    ) -> list[MissingPrivilege]:
        """What a deploy of `template` (with a NIC on each of `segments`; none: the
        configured network) needs and this session's user lacks (`certificates`: vSphere
        installs them with the cloud-config, which needs nothing more); a `PermanentError`
        when the clone cannot be planned (no such template, datastore, network: the
        objects whose privileges are asked)."""
        specs = [CloneSpec("check", "check", template, segment=s) for s in segments]

        def work(op: Op) -> list[MissingPrivilege]:
            found: list[MissingPrivilege] = []
            for spec in specs or [CloneSpec("check", "check", template)]:
                plan = self._inventory.plan(op.conn, spec)
                found += [m for m in privileges.missing(op.conn, plan) if m not in found]
            return found

        return await self._session.run(work, changes=False)

    async def segment_problems(self, segment: Segment) -> list[str]:
        """`ChecksSegments`: the network exists, is no uplink, and the configured
        cluster or host (`compute`) is on it."""

        def work(op: Op) -> list[str]:
            inv = self._inventory
            dc = inv.datacenter(op.conn)
            try:
                net = inv.network(op.conn, dc, segment.network)
                _pool, placement = inv.pool(op.conn, dc, None)
                inv.reaches(op.conn, dc, net, placement)
            except PermanentError as exc:
                return [exc.message]
            return []

        return await self._session.run(work, changes=False)

    async def storages(self, placement: str | None = None) -> list[Storage]:
        def work(op: Op) -> list[Storage]:
            dc = self._inventory.datacenter(op.conn)
            root = dc.obj
            if placement:
                pool, _name = self._inventory.pool(op.conn, dc, placement)
                root = op.conn.props(pool, vim.ResourcePool, ["owner"])["owner"]
            return [
                Storage(p["name"], placement, p["summary.capacity"], p["summary.freeSpace"])
                for _o, p in self._inventory.datastores(op.conn, root)
            ]

        return await self._session.run(work, changes=False)

    async def networks(self, placement: str | None = None) -> list[Network]:
        def work(op: Op) -> list[Network]:
            dc = self._inventory.datacenter(op.conn)
            pg_type = vim.dvs.DistributedVirtualPortgroup
            return [
                Network(p["name"], placement, isinstance(o, pg_type))
                for o, p in self._inventory.networks(op.conn, dc)
            ]

        return await self._session.run(work, changes=False)

    async def placements(self) -> list[Placement]:
        def work(op: Op) -> list[Placement]:
            found = []
            dc = self._inventory.datacenter(op.conn)
            # Every pool in one read; those whose parent is a compute's root pool count.
            pools = op.conn.contained(dc.host_folder, vim.ResourcePool, ["name", "parent"])
            for obj, p in self._inventory.computes(op.conn, dc):
                kind = "cluster" if isinstance(obj, vim.ClusterComputeResource) else "host"
                found.append(Placement(p["name"], kind))
                root = p["resourcePool"]._moId
                for _c, c in pools:
                    if getattr(c.get("parent"), "_moId", None) == root:
                        found.append(Placement(f"{p['name']}/{c['name']}", "pool"))
            return found

        return await self._session.run(work, changes=False)

    async def clone_mode(self, spec: CloneSpec) -> CloneMode:
        # A linked clone needs a snapshot on the template; deploybot always copies.
        target = spec.storage or self.config.datastore or "the template's datastore"
        return CloneMode(False, f"full copy to {target}, {self.config.disk_format}")
