# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""vSphere backend: vCenter clones a template, a standalone ESXi host copies its disk.

`content.about.apiType` decides the path. `VirtualCenter`: `CloneVM_Task` into a resource
pool (vSphere picks the host under DRS) and datastore. `HostAgent` has no clone: make
the VM's folder, copy the template's disks (`CopyVirtualDisk_Task`), create a VM from the
template's hardware around them (`CreateVM_Task`, in `esxi`). `CloneVM_Task` is never
sent there.

* Identity: the VM's `config.instanceUuid`, chosen by `prepare_clone`, written into the
  clone/create spec and resolved with `FindByUuid(None, uuid, True, True)` at every
  operation. The job tag is a line of the annotation; a VM without it is never changed.
* The guest's identity travels as cloud-init documents in guestinfo keys
  (`guestinfo`), set with CPU and memory in the clone/create spec when the
  CloneSpec carries it; `apply_identity` then finds them in place (one property read)
  and reconfigures only a VM that lacks them. The metadata finds the NIC by its MAC:
  a created VM's MAC is set in its spec (ESXi generates one only at power-on), a
  clone's is vCenter's, read back after the clone, when the metadata is added.
* The SSH host key deploybot chose (`Identity.host_key`) travels in the user-data, with
  its host certificate when the core's CA signed one (`Identity.host_certificate`);
  `forget_host_key` blanks guestinfo.userdata once the VM is ready (ChoosesHostKeys).
* Session, thread pool, task waiting without polling and fault mapping:
  `session`; inventory lookups: `inventory`; specs: `specs`; what a deploy can choose
  (templates, datastores, networks, placements): `discovery`; template builds
  (issue 17): `building`.
"""

from __future__ import annotations

import ipaddress
import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pyVmomi import vim, vmodl

from backends.base import (
    AddressUse,
    CloneMode,
    CloneSpec,
    Identity,
    MissingPrivilege,
    Network,
    PermanentError,
    Placement,
    RetryableError,
    Segment,
    Storage,
    Template,
    VMInfo,
    VMNotFound,
    VMRef,
)
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.config import BackendConfig
from backends.guestaddr import pick_address
from backends.sshcheck import SshCheck
from backends.vsphere import addresses, esxi, guestinfo, specs
from backends.vsphere.building import TemplateBuilds
from backends.vsphere.config import Config, endpoint_of, password_of
from backends.vsphere.conn import Conn, Props, Row
from backends.vsphere.discovery import KIB_PER_GIB, Discovery
from backends.vsphere.inventory import Inventory, Plan, annotation, disks
from backends.vsphere.session import (
    RETRYABLE_FAULTS,
    Op,
    Session,
    fault_text,
)
from backends.vsphere.vms import POWERED_ON, KnownVMs, tags, vm_info
from bot.models.errors import InternalSignal

log = logging.getLogger(__name__)
# Plans kept from prepare_clone for clone; an older one is simply looked up again.
MAX_PLANS = 256
# Records the size grow_disk aimed at, so a retried grow does not grow twice.
GROW_TARGET_KEY = "deploybot.grow.target_kb"


def create(config: BackendConfig, environ: Mapping[str, str]) -> VSphereBackend:
    assert isinstance(config, Config)
    return VSphereBackend(config, password_of(config, environ))


# What the wait for the guest's address watches.
ADDRESS_PATHS = ["runtime.powerState", "guest.ipAddress", "guest.net"]


class _Moved(InternalSignal):
    """The object remembered for an instance UUID now has another one (or none)."""


def _interfaces(props: Props) -> list[tuple[str, str]]:
    """(interface, address) pairs from VMware Tools, for `pick_address`.

    Entries with deviceConfigId -1 are no virtual NIC (docker bridges and the like).
    """
    pairs: list[tuple[str, str]] = []
    for nic in props.get("guest.net") or []:
        if nic.deviceConfigId == -1:
            continue
        label = f"nic{nic.deviceConfigId}"
        configured = nic.ipConfig.ipAddress if nic.ipConfig else None
        pairs += [(label, a.ipAddress) for a in configured or []]
        pairs += [(label, a) for a in nic.ipAddress or []]
    if props.get("guest.ipAddress"):
        pairs.append(("guest", props["guest.ipAddress"]))
    return pairs


def _holds_host_key(props: Props) -> bool:
    """Whether the VM's guestinfo.userdata (in `props`' extraConfig) holds a private key;
    one that does not decode counts as holding one, so that `forget_host_key` blanks it."""
    value = specs.last_extra(props, guestinfo.USERDATA_KEY)
    if not value:
        return False
    encoding = specs.last_extra(props, f"{guestinfo.USERDATA_KEY}.encoding")
    try:
        return guestinfo.holds_private_key(guestinfo.read(value, encoding))
    except ValueError:
        return True


class VSphereBackend:
    """A vCenter or a standalone ESXi host behind the Backend Protocol; it builds
    templates too. It holds its parts: the session, the inventory, the discovery calls
    (`discovery`) and the template builds (`building`), and hands them their calls."""

    # bot/images prepares the image for VMware's datasource (guestinfo).
    image_platform: str | None = "vsphere"

    def __init__(self, config: Config, password: str) -> None:
        self.name = config.name
        self.default_network = config.network
        self.endpoint = (config.host, config.port)
        self.default_storage = config.datastore
        self.config = config
        self._ssh = SshCheck(config.ssh_jump)
        self._session = Session(endpoint_of(config), password)
        self._known = KnownVMs()  # VMs by instance UUID, and the session's VM tracker
        self._inventory = Inventory(config.name, config, self._known)
        self.discovery = Discovery(config, self._session, self._inventory)
        self.builds = TemplateBuilds(
            config, self.endpoint, self._session, self._inventory, self._known
        )
        self._disks = specs.Disks(config.thin_provisioned, config.eagerly_scrub)
        self._plans: dict[str, Plan] = {}

    # --- discovery (discovery.py) ---------------------------------------------------

    async def templates(self) -> list[Template]:
        return await self.discovery.templates()

    async def missing_privileges(
        self, template: str, segments: Sequence[Segment] = (), *, certificates: bool = False
    ) -> list[MissingPrivilege]:
        # A host certificate travels in the cloud-config the clone's reconfigure writes
        # (guestinfo): it needs no privilege beyond the deploy's own.
        return await self.discovery.missing_privileges(template, segments)

    async def segment_problems(self, segment: Segment) -> list[str]:
        return await self.discovery.segment_problems(segment)

    async def storages(self, placement: str | None = None) -> list[Storage]:
        return await self.discovery.storages(placement)

    async def networks(self, placement: str | None = None) -> list[Network]:
        return await self.discovery.networks(placement)

    async def placements(self) -> list[Placement]:
        return await self.discovery.placements()

    async def clone_mode(self, spec: CloneSpec) -> CloneMode:
        return await self.discovery.clone_mode(spec)

    # --- template builds (building.py) ----------------------------------------------

    async def build_preflight(self, plan: BuildPlan) -> BuildTarget:
        return await self.builds.build_preflight(plan)

    async def prepare_build(self, plan: BuildPlan, target: BuildTarget) -> VMRef:
        return await self.builds.prepare_build(plan, target)

    async def create_template(
        self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path | None
    ) -> str | None:
        return await self.builds.create_template(plan, target, ref, image)

    async def publish_template(self, plan: BuildPlan, ref: VMRef) -> str | None:
        return await self.builds.publish_template(plan, ref)

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        return await self.builds.template_versions(name)

    async def destroy_template(self, ref: VMRef) -> None:
        await self.builds.destroy_template(ref)

    def api_calls(self) -> Counter[str]:
        """SOAP calls so far by method name (`Fetch` is one single property read)."""
        return self._session.api_calls()

    def api_bytes(self) -> Counter[str]:
        """SOAP bytes so far: request bodies "sent", response bodies "received"."""
        return self._session.api_bytes()

    async def is_vcenter(self) -> bool:
        return (await self._session.connection()).vcenter

    def _existing(self, conn: Conn, ref: VMRef, paths: tuple[str, ...] = ()) -> Row:
        found = self._known.ours(conn, ref, paths)
        if found is None:
            raise VMNotFound(f"no VM has instance UUID {ref.vm_id} on {self.name}", vm_id=ref.vm_id)
        return found

    # --- finding VMs ----------------------------------------------------------------

    async def find_vm(self, ref: VMRef) -> VMInfo | None:
        def work(op: Op) -> VMInfo | None:
            found = self._known.lookup(op.conn, ref.vm_id)
            return vm_info(ref.vm_id, found[1], ref.placement) if found else None

        return await self._session.run(work, ref.vm_id, changes=False)

    async def find_by_name(self, name: str) -> list[VMInfo]:
        return await self._session.run(lambda op: self._known.vms(op.conn, name), changes=False)

    async def find_tagged(self) -> list[VMInfo]:
        return await self._session.run(
            lambda op: [v for v in self._known.vms(op.conn) if v.tags], changes=False
        )

    async def addresses_in_use(self, ours: str | None = None) -> list[AddressUse]:
        """See `Backend.addresses_in_use`: one look of the session's VM tracker, which
        returns only what changed (`addresses`), whoever built the VMs (leaving ours
        out would save nothing)."""
        return await self._session.run(
            lambda op: addresses.in_use(self._known.tracked_vms(op.conn).values()),
            changes=False,
        )

    async def named_with_addresses(self, name: str) -> tuple[list[VMInfo], list[AddressUse]]:
        """See `NamesWithAddresses`: the VMs called `name` and every VM's addresses,
        from one look of the tracker (two checks, one request)."""

        def work(op: Op) -> tuple[list[VMInfo], list[AddressUse]]:
            tracked = self._known.tracked_vms(op.conn)
            named = self._known.vms(op.conn, name, tracked)
            return named, addresses.in_use(tracked.values())

        return await self._session.run(work, changes=False)

    async def macs_in_use(self) -> dict[str, str]:
        """`KnowsMacs`: every NIC's MAC of every VM (`KnownVMs.macs_by_vm`)."""
        return await self._session.run(lambda op: self._known.macs_by_vm(op.conn), changes=False)

    # --- the deploy moves -----------------------------------------------------------

    async def prepare_clone(self, spec: CloneSpec) -> VMRef:
        plan = await self._session.run(
            lambda op: self._inventory.plan(op.conn, spec), changes=False
        )
        # The durable id, chosen before anything exists and written into the clone spec:
        # a crash halfway through still leaves the caller a UUID to find and remove.
        vm_id = str(uuid.uuid4())
        self._plans[vm_id] = plan
        while len(self._plans) > MAX_PLANS:  # clones that never came (cancelled, failed)
            self._plans.pop(next(iter(self._plans)))
        return VMRef(vm_id, spec.job_id, plan.placement, spec.installation)

    async def clone(self, spec: CloneSpec, ref: VMRef) -> str | None:
        plan = self._plans.pop(ref.vm_id, None)
        # Built first: an identity that cannot be written fails before anything exists.
        guest = self._guest(ref, spec.identity) if spec.identity else None

        def work(op: Op) -> str:
            # With the plan prepare_clone made, this is the first attempt for a UUID
            # that prepare_clone has just drawn: no VM can have it yet. A retry (or a
            # resumed job) looks first.
            if plan is None and self._known.ours(op.conn, ref) is not None:
                return "the VM was already there (an earlier attempt finished)"
            use = plan or self._inventory.plan(op.conn, spec)
            note = annotation(spec)
            try:
                if op.conn.vcenter:
                    clone = specs.clone_spec(use, ref, note, self._disks, guest)
                    task = use.template.CloneVM_Task(folder=use.folder, name=spec.name, spec=clone)
                    vm = op.wait(task)
                else:
                    inv, disks = self._inventory, self._disks
                    vm = esxi.copy_and_create(op, spec, ref, use, guest, disks, inv, self._known)
            except vmodl.MethodFault:
                # The plan may have named a pool, datastore or network that went since
                # the inventory's shape was remembered: a retry plans from a fresh read.
                self._inventory.forget()
                raise
            self._known.remember(ref.vm_id, vm)  # later steps: no FindByUuid
            self._settle(op, vm, ref, note, guest)
            how = "cloned" if op.conn.vcenter else "disk copied"
            net = f", NIC on {use.network.name}" if use.network else ""
            return f"{how} to {use.datastore_name} ({self.config.disk_format}){net}"

        return await self._session.run(work, ref.vm_id)

    def _settle(
        self, op: Op, vm: Any, ref: VMRef, note: str, guest: specs.GuestConfig | None
    ) -> None:
        """Make sure the new VM carries our instance UUID, job tag and the guest's
        identity, in one reconfiguration: what a server dropped from the spec (vcsim
        drops the annotation, and from a clone the CPU and memory), and after a clone
        the cloud-init metadata, which names the MAC vCenter gave the clone's NIC."""
        paths = ["config.instanceUuid", "config.annotation"]
        p = op.conn.props(vm, vim.VirtualMachine, [*paths, *(specs.GUEST_PATHS if guest else ())])
        fix = vim.vm.ConfigSpec()
        missing: list[str] = []
        if p.get("config.instanceUuid") != ref.vm_id:
            fix.instanceUuid = ref.vm_id
            missing.append("instance UUID")
        if ref.tag not in tags(p.get("config.annotation")):
            fix.annotation = note
            missing.append("job tag")
        for key, value in (guest.missing(p) if guest else {}).items():
            setattr(fix, key, value)
            missing += [o.key for o in value] if key == "extraConfig" else [key]
        if missing:
            log.info("backend %s: completing the new VM: %s", self.name, ", ".join(missing))
            op.wait(vm.ReconfigVM_Task(fix))

    def _guest(self, ref: VMRef, identity: Identity) -> specs.GuestConfig:
        return specs.GuestConfig.of(ref.vm_id, identity, self.config.manage_etc_hosts)

    async def apply_identity(self, ref: VMRef, identity: Identity) -> str | None:
        guest = self._guest(ref, identity)

        def work(op: Op) -> None:
            # Read with the lookup: a VM whose clone carried the identity costs no task.
            vm, p = self._existing(op.conn, ref, specs.GUEST_PATHS)
            fix = guest.missing(p)
            if fix:
                op.wait(vm.ReconfigVM_Task(vim.vm.ConfigSpec(**fix)))

        await self._session.run(work, ref.vm_id)
        return None

    async def grow_disk(self, ref: VMRef, grow_gib: int) -> str | None:
        if grow_gib < 0:
            raise PermanentError("shrinking disks is not supported")
        if grow_gib == 0:
            return None

        def work(op: Op) -> str:
            paths = ("config.hardware.device", "config.extraConfig")
            vm, p = self._existing(op.conn, ref, paths)
            found = disks(p.get("config.hardware.device") or [])
            if not found:
                raise PermanentError(f"VM {p['name']} has no disk to grow", vm_id=ref.vm_id)
            disk = found[0]
            # The target this job's first try wrote with its growth; a clone inherits
            # its template's extraConfig, so one written for another job is not ours.
            job, _, recorded = (specs.last_extra(p, GROW_TARGET_KEY) or "").partition(":")
            if job == ref.job_id and recorded.isdigit():
                target_kb = int(recorded)
            else:
                target_kb = disk.capacityInKB + grow_gib * KIB_PER_GIB
            if disk.capacityInKB < target_kb:
                disk.capacityInKB, disk.capacityInBytes = target_kb, target_kb * 1024
                edit = vim.vm.device.VirtualDeviceSpec(operation="edit", device=disk)
                mark = f"{ref.job_id}:{target_kb}"
                marker = vim.option.OptionValue(key=GROW_TARGET_KEY, value=mark)
                spec = vim.vm.ConfigSpec(deviceChange=[edit], extraConfig=[marker])
                op.wait(vm.ReconfigVM_Task(spec))
            return f"first disk now {target_kb / KIB_PER_GIB:.1f} GiB"

        return await self._session.run(work, ref.vm_id)

    async def power_on(self, ref: VMRef) -> str | None:
        def work(op: Op) -> str | None:
            vm, p = self._existing(op.conn, ref)
            if p.get("runtime.powerState") == POWERED_ON:
                return "already running"
            op.wait(vm.PowerOnVM_Task())
            return None

        return await self._session.run(work, ref.vm_id)

    async def wait_for_address(
        self, ref: VMRef, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        def found(p: Props) -> ipaddress.IPv4Address | None:
            if p.get("config.instanceUuid") != ref.vm_id:
                raise _Moved()
            self._known.check_tag(ref, p)
            if p.get("runtime.powerState") != POWERED_ON:
                raise PermanentError(f"VM {ref.vm_id} is not running", vm_id=ref.vm_id)
            # Empty means VMware Tools has not said yet, never "no address".
            return pick_address(_interfaces(p), expected)

        def work(op: Op) -> ipaddress.IPv4Address:
            # The VM found by an earlier step is watched at once; the first answer has
            # its instance UUID and tag, checked before anything else (one read less).
            vm = self._known.remembered(ref.vm_id)
            paths = [*ADDRESS_PATHS, "config.instanceUuid", "config.annotation", "name"]
            if vm is not None:
                try:
                    return op.watch(vm, vim.VirtualMachine, paths, found)
                except (_Moved, vmodl.fault.ManagedObjectNotFound):
                    self._known.remember(ref.vm_id, None)  # gone, or another VM now
            vm, _p = self._existing(op.conn, ref)
            return op.watch(vm, vim.VirtualMachine, paths, found)

        return await self._session.run(work, ref.vm_id)

    async def probe_ssh(self, ref: VMRef, address: ipaddress.IPv4Address, port: int) -> str | None:
        # The address came through the hypervisor, not the network: only a connection
        # proves that the guest is reachable.
        return await self._ssh.probe(address, port)

    # --- the host key deploybot chose (ChoosesHostKeys) ------------------------------

    async def forget_host_key(self, ref: VMRef) -> None:
        """Blank guestinfo.userdata and its encoding when they hold a private key: the
        guest wrote its host key at first boot, and the key must not stay readable to
        whoever may read the VM's configuration. A VM without the job tag: NotOurVM."""

        def work(op: Op) -> None:
            found = self._known.ours(op.conn, ref, ("config.extraConfig",))
            if found is None or not _holds_host_key(found[1]):
                return  # gone, or nothing to remove: forgetting is idempotent
            vm, p = found
            blank = [vim.option.OptionValue(key=k, value=v) for k, v in guestinfo.FORGOTTEN.items()]
            try:
                op.wait(vm.ReconfigVM_Task(vim.vm.ConfigSpec(extraConfig=blank)))
            except vmodl.fault.ManagedObjectNotFound:
                return  # removed meanwhile: no key left behind
            log.info(
                "backend %s: removed the host key from VM %s's guestinfo", self.name, p["name"]
            )

        await self._session.run(work, ref.vm_id)

    async def holds_host_key(self, ref: VMRef) -> bool:
        def work(op: Op) -> bool:
            found = self._known.lookup(op.conn, ref.vm_id, ("config.extraConfig",))
            return found is not None and _holds_host_key(found[1])

        return await self._session.run(work, ref.vm_id, changes=False)

    async def power_off(self, ref: VMRef) -> None:
        def work(op: Op) -> None:
            found = self._known.ours(op.conn, ref)
            if found is None or found[1].get("runtime.powerState") == "poweredOff":
                return
            try:
                op.wait(found[0].PowerOffVM_Task())
            except (vim.fault.InvalidPowerState, vmodl.fault.ManagedObjectNotFound):
                return  # it stopped, or went, meanwhile

        await self._session.run(work, ref.vm_id)

    async def destroy(self, ref: VMRef) -> None:
        def work(op: Op) -> None:
            found = self._known.ours(op.conn, ref)
            if found is None:
                return  # gone already: rollback is idempotent
            vm, p = found
            left = f"VM {p.get('name')} is still there (instance UUID {ref.vm_id})"
            if p.get("runtime.powerState") == POWERED_ON:
                raise PermanentError(f"{left}: it is running; stop it first", vm_id=ref.vm_id)
            self._known.remember(ref.vm_id, None)
            try:
                op.wait(vm.Destroy_Task())
            except vmodl.fault.ManagedObjectNotFound:
                return
            except vmodl.MethodFault as fault:
                kind = RetryableError if isinstance(fault, RETRYABLE_FAULTS) else PermanentError
                raise kind(f"{left}: {fault_text(fault)}", vm_id=ref.vm_id) from None

        await self._session.run(work, ref.vm_id)

    async def close(self) -> None:
        await self._ssh.close()
        await self._session.close()
