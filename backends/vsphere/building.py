# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""Template builds on vCenter and standalone ESXi (`backends.building.BuildsTemplates`).

The prepared qcow2 becomes a stream-optimized VMDK on the bot host (`ovf`), is imported
with a minimal OVF descriptor (`ovfimport`) under `plan.versioned_name`, carrying the
instance UUID `prepare_build` chose and an annotation with the job tag and the build
mark (`buildmark`), and is marked as a template. The VMDK lives in a temporary folder
beside the image, named after the job (`deploybot-JOB-*`), and goes when the call ends
(a killed process leaves it: remove such folders when their job is over). The upload
lands in the VM's own disk, so nothing else is left on the datastore.

Publishing renames. vSphere refuses two VMs of one name in one folder (vcsim too), so
where the previous template shares the new one's folder it is renamed first, and for
the moment of one rename no template has the name; elsewhere the new one goes first.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pyVmomi import vim, vmodl

from backends.base import PermanentError, VMRef
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.vsphere import buildmark, cpu, ovf, ovfimport
from backends.vsphere.config import Config
from backends.vsphere.conn import Conn, Row
from backends.vsphere.inventory import Datacenter, Inventory
from backends.vsphere.session import Op, Session
from backends.vsphere.vms import POWERED_ON, KnownVMs, tags

FIRMWARE = "bios"  # cloud images boot either way; Proxmox's default is SeaBIOS too
DEFAULT_NETWORK = "VM Network"  # a NIC needs one; ESXi and vcsim have this one


class TemplateBuilds:
    """The build moves of one vSphere backend (`VSphereBackend` holds one and hands the
    `BuildsTemplates` calls to it)."""

    def __init__(
        self,
        config: Config,
        endpoint: tuple[str, int],
        session: Session,
        inventory: Inventory,
        known: KnownVMs,
    ) -> None:
        self.name = config.name
        self.config = config
        self.endpoint = endpoint
        self._session = session
        self._inventory = inventory
        self._known = known  # the VMs by instance UUID, and the session's VM tracker

    async def build_preflight(self, plan: BuildPlan) -> BuildTarget:
        def work(op: Op) -> BuildTarget:
            ovf.check_models(plan.nic, plan.disk_bus)
            conn, inv = op.conn, self._inventory
            dc = inv.datacenter(conn)
            _pool, placement = inv.pool(conn, dc, plan.placement)
            compute = self._compute(conn, dc, placement)
            notes = self._check_cpu(conn, compute, placement, plan.cpu)
            store, note = self._datastore(conn, compute, plan.storage)
            notes += [note] if note else []
            network = self._network_name(conn, dc)
            notes.append(f"the template's NIC goes on {network}")
            self._check_names(conn, plan)
            return BuildTarget(placement, store, tuple(notes))

        return await self._session.run(work, changes=False)

    async def prepare_build(self, plan: BuildPlan, target: BuildTarget) -> VMRef:
        # The durable id, chosen before anything exists and written into the import
        # spec: a crash halfway through leaves the caller a UUID to find and remove.
        return plan.ref(str(uuid.uuid4()), target.placement)

    async def create_template(
        self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path | None
    ) -> str | None:
        if image is None or not await asyncio.to_thread(image.is_file):
            raise PermanentError(f"the prepared image {image} does not exist")
        # Beside the image (the image cache has room for one more copy; /tmp may not).
        folder = tempfile.TemporaryDirectory(prefix=f"deploybot-{plan.job_id}-", dir=image.parent)
        with folder as tmp:
            vmdk = Path(tmp) / f"{plan.job_id}.vmdk"
            capacity = await ovf.virtual_size(image)
            await ovf.to_stream_vmdk(image, vmdk)
            return await self._session.run(
                lambda op: self._import(op, plan, target, ref, vmdk, capacity), ref.vm_id
            )

    def _import(
        self, op: Op, plan: BuildPlan, target: BuildTarget, ref: VMRef, vmdk: Path, size: int
    ) -> str:
        conn, inv = op.conn, self._inventory
        found = self._known.ours(conn, ref, ("config.template",))
        if found is not None and found[1].get("config.template"):
            return "the template was already there (an earlier attempt finished)"
        if found is not None:  # half imported by an attempt that did not end: again
            op.wait(found[0].Destroy_Task())
        dc = inv.datacenter(conn)
        pool, placement = inv.pool(conn, dc, target.placement)
        compute = self._compute(conn, dc, placement)
        host = None
        if not isinstance(compute, vim.ClusterComputeResource):  # ESXi, or a lone host
            host = (conn.props(compute, vim.ComputeResource, ["host"]).get("host") or [None])[0]
        stores = [o for o, p in inv.datastore_names(conn, dc) if p["name"] == target.storage]
        if not stores:
            raise PermanentError(f"no datastore {target.storage!r} on {self.name}")
        net = inv.network(conn, dc, self._network_name(conn, dc))
        machine = ovf.Machine(
            plan.versioned_name,
            plan.os_family,
            plan.cores,
            plan.memory_mib,
            plan.nic,
            plan.disk_bus,
            net.name,
            vmdk.name,
            vmdk.stat().st_size,
            size,
            FIRMWARE,
        )
        host_name, port = self.endpoint
        server = f"[{host_name}]:{port}" if ":" in host_name else f"{host_name}:{port}"
        where = ovfimport.Target(
            pool,
            inv.folder(conn, dc, self.config.template_folder or self.config.vm_folder),
            host,
            stores[0],
            net,
            _provisioning(self.config),
            server,
            self._session.ssl_context(),
        )
        note = buildmark.annotation(plan, self.config.template_annotation)
        config = vim.vm.ConfigSpec(
            instanceUuid=ref.vm_id,
            annotation=note,
            firmware=FIRMWARE,
            numCPUs=plan.cores,
            memoryMB=plan.memory_mib,
        )
        try:
            vm = ovfimport.import_vm(
                op, where, plan.versioned_name, ovf.descriptor(machine), vmdk, config
            )
            self._known.remember(ref.vm_id, vm)
            self._complete(op, vm, ref, note)
            vm.MarkAsTemplate()
        finally:
            inv.forget_templates()
        gib = size / 1024**3
        return f"imported to {target.storage} ({gib:.1f} GiB disk), NIC on {net.name}; a template"

    def _complete(self, op: Op, vm: Any, ref: VMRef, note: str) -> None:
        """What a server dropped from the import spec, set again (one reconfiguration)."""
        p = op.conn.props(vm, vim.VirtualMachine, ["config.instanceUuid", "config.annotation"])
        fix = vim.vm.ConfigSpec()
        if p.get("config.instanceUuid") != ref.vm_id:
            fix.instanceUuid = ref.vm_id
        if ref.tag not in tags(p.get("config.annotation")):
            fix.annotation = note
        if fix.instanceUuid or fix.annotation:
            op.wait(vm.ReconfigVM_Task(fix))

    async def publish_template(self, plan: BuildPlan, ref: VMRef) -> str | None:
        def work(op: Op) -> str:
            conn, inv = op.conn, self._inventory
            found = self._known.ours(conn, ref, ("config.template", "parent"))
            if found is None:
                raise PermanentError(f"no template has instance UUID {ref.vm_id} on {self.name}")
            new, p = found
            if not p.get("config.template"):
                raise PermanentError(f"{p.get('name')} is not a template yet: build it again")
            holders = [r for r in self._named(conn, plan.name) if r[0]._moId != new._moId]
            renames = []  # (VM, new name, in the new one's folder)
            for obj, h in holders:
                held = buildmark.version(h)
                if held is None or not buildmark.ours(h, plan.installation):
                    raise PermanentError(
                        f"{plan.name} on {self.name} is not a template this installation "
                        f"built (instance UUID {h.get('config.instanceUuid')}): deploybot "
                        "leaves it alone; rename or remove it, then publish again"
                    )
                versioned = f"{plan.name}-v{held.version}"
                if any(o._moId != obj._moId for o, _p in self._named(conn, versioned)):
                    raise PermanentError(f"{versioned} exists already on {self.name}: remove it")
                same = getattr(h.get("parent"), "_moId", None) == getattr(p["parent"], "_moId", "")
                renames.append((obj, versioned, same))
            done = [f"{v} (was {plan.name})" for _o, v, _s in renames]
            try:
                for obj, versioned, _same in (r for r in renames if r[2]):
                    op.wait(obj.Rename_Task(versioned))
                if p.get("name") != plan.name:
                    op.wait(new.Rename_Task(plan.name))
                for obj, versioned, _same in (r for r in renames if not r[2]):
                    op.wait(obj.Rename_Task(versioned))
            finally:
                inv.forget_templates()
            if p.get("name") == plan.name and not done:
                return f"{plan.name} was published already"
            return f"{p.get('name')} is now {plan.name}" + (f"; {', '.join(done)}" if done else "")

        return await self._session.run(work, ref.vm_id)

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        def work(op: Op) -> list[TemplateVersion]:
            dc = self._inventory.datacenter(op.conn)
            rows = op.conn.contained(dc.vm_folder, vim.VirtualMachine, buildmark.VERSION_PATHS)
            found = [buildmark.version(p) for _o, p in rows]
            return sorted(
                (v for v in found if v is not None and name in (None, v.base_name)),
                key=lambda v: (v.base_name, v.version),
            )

        return await self._session.run(work, changes=False)

    async def destroy_template(self, ref: VMRef) -> None:
        def work(op: Op) -> None:
            inv = self._inventory
            found = self._known.ours(op.conn, ref)  # NotOurVM without the job's tag
            if found is None:
                return  # gone already
            vm, p = found
            if p.get("runtime.powerState") == POWERED_ON:
                op.wait(vm.PowerOffVM_Task())
            self._known.remember(ref.vm_id, None)
            try:
                op.wait(vm.Destroy_Task())
            except vmodl.fault.ManagedObjectNotFound:
                return
            finally:
                inv.forget_templates()

        await self._session.run(work, ref.vm_id)

    # --- helpers (blocking) ------------------------------------------------------

    def _compute(self, conn: Conn, dc: Datacenter, placement: str) -> Any:
        compute_name = placement.partition("/")[0]
        rows = self._inventory.computes(conn, dc)
        return next(o for o, p in rows if p["name"] == compute_name)

    def _check_cpu(self, conn: Conn, compute: Any, placement: str, baseline: str) -> list[str]:
        hosts = conn.props(compute, vim.ComputeResource, ["host"]).get("host") or []
        evc = None
        if isinstance(compute, vim.ClusterComputeResource):
            summary = conn.props(compute, vim.ClusterComputeResource, ["summary"]).get("summary")
            evc = getattr(summary, "currentEVCModeKey", None)
        read = [
            cpu.HostCpu(
                str(p.get("name")),
                cpu.leaves(p.get("hardware.cpuFeature") or []),
                p.get("summary.maxEVCModeKey") or None,
            )
            for _o, p in conn.retrieve(hosts, vim.HostSystem, cpu.HOST_PATHS)
        ]
        problem, notes = cpu.baseline_problem(baseline, placement, read, evc or None)
        if problem:
            raise PermanentError(f"{self.name}: {problem}")
        return notes

    def _datastore(self, conn: Conn, compute: Any, wanted: str | None) -> tuple[str, str]:
        """The datastore a build goes to (its name) and a note on the choice."""
        wanted = wanted or self.config.datastore
        refs = conn.props(compute, vim.ComputeResource, ["datastore"]).get("datastore") or []
        paths = ["name", "summary.accessible", "summary.freeSpace"]
        rows = conn.retrieve(refs, vim.Datastore, paths)
        usable = [p for _o, p in rows if p.get("summary.accessible", True)]
        if wanted is None:
            if not usable:
                raise PermanentError(f"{self.name}: no accessible datastore; set `datastore`")
            best = max(usable, key=lambda p: p.get("summary.freeSpace") or 0)
            free = (best.get("summary.freeSpace") or 0) / 1024**3
            return best["name"], f"datastore {best['name']} (the most free space: {free:.0f} GiB)"
        match = [p for _o, p in rows if p["name"] == wanted]
        if not match:
            known = ", ".join(sorted(p["name"] for p in usable)) or "none"
            raise PermanentError(
                f"{self.name}: no datastore {wanted!r} here (have: {known}); choose one"
            )
        if not match[0].get("summary.accessible", True):
            raise PermanentError(
                f"{self.name}: datastore {wanted} is not accessible: mount it again or "
                "choose another"
            )
        return wanted, ""

    def _network_name(self, conn: Conn, dc: Datacenter) -> str:
        wanted = self.config.network or DEFAULT_NETWORK
        self._inventory.network(conn, dc, wanted)  # refuses, naming those there are
        return wanted

    def _named(self, conn: Conn, name: str) -> list[Row]:
        """Every VM called `name`, with VERSION_PATHS and its folder."""
        objs = [o for o, p in self._known.tracked_vms(conn).values() if p.get("name") == name]
        return conn.retrieve(objs, vim.VirtualMachine, [*buildmark.VERSION_PATHS, "parent"])

    def _check_names(self, conn: Conn, plan: BuildPlan) -> None:
        for _o, p in self._named(conn, plan.versioned_name):
            if plan.tag not in tags(p.get("config.annotation")):
                raise PermanentError(
                    f"{plan.versioned_name} exists already on {self.name} (instance UUID "
                    f"{p.get('config.instanceUuid')}): remove it or build another version"
                )
        for _o, p in self._named(conn, plan.name):
            if not buildmark.ours(p, plan.installation):
                what = "a template" if p.get("config.template") else "a VM"
                raise PermanentError(
                    f"{plan.name} on {self.name} is {what} this installation did not build "
                    f"(instance UUID {p.get('config.instanceUuid')}): rename it, or build "
                    "under another name"
                )


def _provisioning(config: Config) -> str:
    if config.thin_provisioned:
        return "thin"
    return "eagerZeroedThick" if config.eagerly_scrub else "thick"
