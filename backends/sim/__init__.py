"""An in-process hypervisor with the semantics of the real ones, for the demo and the tests.

It is deliberately not a happy-path stub. Operations run as hypervisor-side tasks that
take time (scaled by `time_scale`), a clone is locked until it finishes, a running VM
cannot be destroyed, the guest reports its address only after it has booted, and its
agent reports loopback, link-local and container-bridge addresses next to the real one.

Faults are injected per operation (the Backend method's name):

* ``error``: the hypervisor task fails; side effects are those of the real systems
  (a failed clone leaves no VM, as Proxmox removes it itself).
* ``hang``: the hypervisor does the work but the answer never arrives, like a request
  lost on the way back; only the caller's timeout ends the wait.
* ``crash``: the work is done, then the call dies with an unexpected, unmapped exception
  (a bug or a dropped connection), so the caller must clean up without an answer.
* ``flaky``: the call fails with a retryable error before anything happens (an API
  that is briefly unreachable); the next call works.
* ``impostor`` (``probe_ssh``): another host answers on the guest's address, with a
  host key that is not the guest's (an address conflict, an interceptor).
* ``rekeyed`` (``host_keys``): the guest agent reads keys the guest replaced right
  after (cloud-init's first boot), so they differ from what its sshd then presents.
* ``outage``: the hypervisor goes down at that call, before anything happens, and
  stays down (every call is refused) until the test brings it back: `down` set to
  False, or the file `<state_file>.down` removed, which the outage creates.

Queries (``templates``, ``find_by_name``, ``wait_for_address``, ``probe_ssh``,
``addresses_in_use``) have no
work to do, so for them ``hang``, ``error`` and ``crash`` act at once.

With a `state_file`, the VMs outlive the process and are shared by every process on
the host that names the file, as one Proxmox is shared (backends/sim/state.py).

A guest whose address is in 127.0.0.0/8 gets a real TCP probe for SSH (tests start a
listener there); for any other address the simulator answers the probe itself, so no
packet ever leaves the machine.

Each guest has its own ed25519 host key, made at clone (its public line is kept in the
state). How deploybot may confirm it is the `host_keys` setting (issue 28): "agent"
(`SimBackend`, the default: its guest agent reads the keys, `ReadsHostKeys`), "chosen"
(`ChoosingSim`: it installs the key deploybot chose and keeps the private key in the
VM's stored user-data until deploybot forgets it, `ChoosesHostKeys`), or "none"
(`Simulator`: the key is only seen over SSH). `sim_backend` picks the class. A host
certificate (deploybot's host CA) goes in with the chosen key (`Identity.host_certificate`),
or through the agent mode's guest agent (`InstallsHostCertificates`); either way the
VM keeps it (`SimVM.host_certificate`) as its sshd's HostCertificate.

`SimBackend` is the Backend; it holds its parts, each owning its own state: the
`Inventory` (inventory.py: VMs, templates, the state file), the `Tasks` (tasks.py: the
outage, planned faults, hypervisor-side tasks and their locks), the `Guests` (guest.py:
the guest agent's addresses and SSH) and the `TemplateBuilds` (building.py); their data
(VMs, timings, faults, the `[[backends]]` model) is in vm.py, the state file in state.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backends.base import (
    AddressUse,
    CloneMode,
    CloneSpec,
    Identity,
    IdTaken,
    Network,
    PermanentError,
    Placement,
    Segment,
    Storage,
    Template,
    VMInfo,
    VMRef,
)
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.config import BackendConfig, SshJump
from backends.sim.building import TemplateBuilds
from backends.sim.guest import Guests
from backends.sim.inventory import Inventory
from backends.sim.state import new_owner
from backends.sim.tasks import Tasks
from backends.sim.vm import (
    DEFAULT_NETWORKS,
    DEFAULT_STORAGES,
    DEFAULT_TEMPLATES,
    Config,
    Effect,
    Fault,
    FaultKind,
    HostKeyMode,
    SimNetwork,
    SimTiming,
    SimVM,
    sim_mac,
)
from backends.sshcheck import new_host_key
from backends.tags import job_marks


def create(config: BackendConfig, environ: Mapping[str, str]) -> Simulator:
    assert isinstance(config, Config)
    sim = sim_backend(
        config.name,
        host_keys=config.host_keys,
        placements=config.placements,
        time_scale=config.time_scale,
        state_file=config.state_file,
        ssh_jump=config.ssh_jump,
        networks=config.networks,
    )
    for fault in config.faults:
        sim.inject(fault.op, fault.kind, fault.times)
    return sim


class Simulator:
    """A simulated hypervisor. Construct it, optionally inject faults, use it as a Backend
    (and as `BuildsTemplates`). Its guests' host keys are only seen over SSH: the
    subclasses below confirm them as the real backends do."""

    image_platform: str | None = None  # the simulator builds without an image

    def __init__(
        self,
        name: str = "sim",
        *,
        placements: tuple[str, ...] = ("node1", "node2"),
        time_scale: float = 1.0,
        timing: SimTiming | None = None,
        ssh_port: int = 22,
        state_file: Path | None = None,
        ssh_jump: SshJump | None = None,
        templates: tuple[Template, ...] = DEFAULT_TEMPLATES,
        networks: tuple[SimNetwork, ...] = DEFAULT_NETWORKS,
    ) -> None:
        self.name = name
        self.default_network: str | None = None
        self._networks = networks
        self.timing = timing or SimTiming()
        self.ssh_port = ssh_port
        self._placements = placements
        self.inventory = Inventory(templates, state_file, new_owner())
        self.tasks = Tasks(name, self.inventory, time_scale)
        self.guests = Guests(self.inventory, self.tasks, self.timing, ssh_jump)
        self.builds = TemplateBuilds(name, placements, self.inventory, self.tasks)

    # --- test and demo controls ---------------------------------------------------

    @property
    def vms(self) -> dict[str, SimVM]:
        return self.inventory.vms

    @property
    def state_file(self) -> Path | None:
        return self.inventory.state_file

    @state_file.setter
    def state_file(self, path: Path | None) -> None:
        self.inventory.state_file = path

    @property
    def faults(self) -> list[Fault]:
        return self.tasks.faults

    @property
    def task_log(self) -> list[tuple[str, str]]:
        return self.tasks.log

    @property
    def down(self) -> bool:
        return self.tasks.down

    @down.setter
    def down(self, down: bool) -> None:
        self.tasks.down = down

    @property
    def without_avx2(self) -> set[str]:
        return self.builds.without_avx2

    @without_avx2.setter
    def without_avx2(self, nodes: set[str]) -> None:
        self.builds.without_avx2 = nodes

    def inject(self, op: str, kind: FaultKind, times: int = 1) -> None:
        self.tasks.inject(op, kind, times)

    def add_vm(
        self,
        name: str,
        *,
        tags: set[str] | None = None,
        running: bool = True,
        address: ipaddress.IPv4Address | None = None,
        macs: tuple[str, ...] = (),
    ) -> str:
        """Put a VM on the simulator that deploybot did not create (or an orphan), with
        the `address` and NIC `macs` its owner gave it, if any."""
        inventory = self.inventory
        vm_id = inventory.new_id()
        with inventory.transaction():
            inventory.vms[vm_id] = SimVM(
                vm_id, name, "ubuntu-24.04", self._placements[0], "local-lvm", 4,
                tags or set(), running,
            )  # fmt: skip
            inventory.vms[vm_id].address = address
            inventory.vms[vm_id].macs = tuple(m.lower() for m in macs)
            inventory.vms[vm_id].host_key = new_host_key().public
            if running:
                inventory.vms[vm_id].booted.set()
        return vm_id

    # --- discovery ----------------------------------------------------------------

    async def templates(self) -> list[Template]:
        self.tasks.answer()
        await self.tasks.query_fault("templates")
        return list(self.inventory.templates)

    async def storages(self, placement: str | None = None) -> list[Storage]:
        self.tasks.answer()
        return [Storage(n, placement, t, f, linked) for n, t, f, linked in DEFAULT_STORAGES]

    async def networks(self, placement: str | None = None) -> list[Network]:
        self.tasks.answer()
        return [
            Network(n.name, placement, n.kind == "distributed")
            for n in self._networks
            if n.on(placement) and n.kind != "uplink"
        ]

    async def placements(self) -> list[Placement]:
        self.tasks.answer()
        return [Placement(p) for p in self._placements]

    def _template(self, name: str) -> Template:
        template = self.inventory.template_named(name)
        if template is None:
            known = ", ".join(t.name for t in self.inventory.templates)
            raise PermanentError(f"template {name!r} does not exist on {self.name} (have: {known})")
        return template

    async def clone_mode(self, spec: CloneSpec) -> CloneMode:
        self.tasks.answer()
        template = self._template(spec.template)
        target = spec.storage or template.storage
        if target != template.storage:
            return CloneMode(False, f"{target} is not the template's storage: full copy")
        linked = any(n == target and lk for n, _t, _f, lk in DEFAULT_STORAGES)
        if linked:
            return CloneMode(True, f"linked clone on {target}")
        return CloneMode(False, f"{target} cannot hold linked clones: full copy")

    async def find_vm(self, ref: VMRef) -> VMInfo | None:
        self.tasks.answer()
        vm = self.vms.get(ref.vm_id)
        return vm.info() if vm else None

    async def find_by_name(self, name: str) -> list[VMInfo]:
        self.tasks.answer()
        await self.tasks.query_fault("find_by_name")
        return [vm.info() for vm in self.vms.values() if vm.name == name]

    async def find_tagged(self) -> list[VMInfo]:
        self.tasks.answer()
        return [vm.info() for vm in self.vms.values() if job_marks(vm.tags)]

    # --- the deploy moves ---------------------------------------------------------

    async def prepare_clone(self, spec: CloneSpec) -> VMRef:
        self.tasks.answer()
        self._template(spec.template)
        placement = spec.placement or self._placements[0]
        if placement not in self._placements:
            raise PermanentError(
                f"{placement!r} is not a node of {self.name} (have: {', '.join(self._placements)})"
            )
        for nic in (spec.nic, *(n.segment for n in spec.more_nics)):
            self._check_nic(nic, placement)
        return VMRef(self.inventory.new_id(), spec.job_id, placement, spec.installation)

    async def segment_problems(self, segment: Segment) -> list[str]:
        """`ChecksSegments`: the segment on every placement."""
        self.tasks.answer()
        problems = []
        for placement in self._placements:
            try:
                self._check_nic(segment, placement)
            except PermanentError as exc:
                problems.append(exc.message)
        return problems

    def _check_nic(self, segment: Segment | None, placement: str) -> None:
        """Refuse, before anything exists, a NIC the placement cannot plug in: an
        unknown network, an uplink portgroup, a VLAN tag on a bridge that is not
        VLAN-aware (or on a portgroup, which carries its own VLAN)."""
        if segment is None:
            return
        here = [n for n in self._networks if n.on(placement)]
        net = next((n for n in here if n.name == segment.network), None)
        if net is None:
            have = ", ".join(n.name for n in here if n.kind != "uplink") or "none"
            raise PermanentError(
                f"network {segment.network} does not exist on {placement} of {self.name} "
                f"(there: {have})"
            )
        if net.kind == "uplink":
            raise PermanentError(
                f"{net.name} on {self.name} is an uplink portgroup: it carries the hosts' "
                "physical NICs, not VMs; name a VM portgroup"
            )
        if segment.vlan is not None and not (net.kind == "bridge" and net.vlan_aware):
            what = "bridge" if net.kind == "bridge" else "portgroup"
            raise PermanentError(
                f"{what} {net.name} on {placement} of {self.name} is not VLAN-aware, so a "
                f"NIC tagged VLAN {segment.vlan} there would reach nothing"
            )

    async def clone(self, spec: CloneSpec, ref: VMRef) -> str | None:
        self.tasks.answer()
        template = self._template(spec.template)
        if ref.vm_id in self.vms:
            # Another client took the id between prepare_clone and clone.
            raise IdTaken(f"unable to create VM {ref.vm_id}: config file already exists")
        mode = await self.clone_mode(spec)
        fault = self.tasks.fault("clone", ref.vm_id)
        vm = SimVM(
            ref.vm_id,
            spec.name,
            template.name,
            ref.placement or self._placements[0],
            spec.storage or template.storage or "local-lvm",
            template.disk_gib,
            {spec.tag},
            lock="clone",
            lock_owner=self.inventory.owner,
            host_key=new_host_key().public,  # its own, as a guest makes one at first boot
            macs=(spec.mac or sim_mac(ref.vm_id, 0),),
        )
        with self.inventory.transaction():  # and again where it is taken, under the file's lock
            if ref.vm_id in self.vms:
                raise IdTaken(f"unable to create VM {ref.vm_id}: config file already exists")
            self.vms[vm.vm_id] = vm
            if mode.linked:
                self.inventory.note_linked(template.name, vm.vm_id)
        seconds = self.timing.clone_linked_s if mode.linked else self.timing.clone_full_s
        await self.tasks.run("clone", vm.vm_id, seconds, Effect(vm, self.vms, remove=True), fault)
        return None

    async def apply_identity(self, ref: VMRef, identity: Identity) -> str | None:
        self.tasks.answer()
        vm = self.inventory.vm(ref)

        def set_identity() -> None:
            # The private key stays only in the stored user-data (as vSphere's guestinfo);
            # cloud-init installs the pair, so its sshd presents the chosen key.
            vm.identity = dataclasses.replace(identity, host_key=None)
            first = identity.mac or (vm.macs[0] if vm.macs else sim_mac(vm.vm_id, 0))
            more = [n.mac or sim_mac(vm.vm_id, i) for i, n in enumerate(identity.more_nics, 1)]
            vm.macs = (first.lower(), *(m.lower() for m in more))
            if identity.host_key is not None:
                vm.host_key = identity.host_key.public
                vm.user_data_key = identity.host_key.private_openssh
                vm.host_certificate = identity.host_certificate

        fault = self.tasks.fault("apply_identity", vm.vm_id)
        effect = Effect(vm, self.vms, set_identity)
        await self.tasks.run("apply_identity", vm.vm_id, self.timing.config_s, effect, fault)
        return None

    async def grow_disk(self, ref: VMRef, grow_gib: int) -> str | None:
        self.tasks.answer()
        if grow_gib < 0:
            raise PermanentError("shrinking disks is not supported")
        vm = self.inventory.vm(ref)
        target = vm.grow_target_gib or vm.disk_gib + grow_gib
        if vm.disk_gib >= target:
            return None  # grown already, by an attempt whose answer was lost
        vm.grow_target_gib = target  # saved with the task's lock

        def grow() -> None:
            vm.disk_gib = target

        fault = self.tasks.fault("grow_disk", vm.vm_id)
        effect = Effect(vm, self.vms, grow)
        await self.tasks.run("grow_disk", vm.vm_id, self.timing.resize_s, effect, fault)
        return None

    async def power_on(self, ref: VMRef) -> str | None:
        self.tasks.answer()
        vm = self.inventory.vm(ref)
        if vm.running:
            raise PermanentError(f"VM {vm.vm_id} already running", vm_id=vm.vm_id)

        def start() -> None:
            vm.running = True
            vm.booted.clear()
            vm.stopped.clear()
            vm.boot_task = asyncio.create_task(self._boot(vm))

        fault = self.tasks.fault("power_on", vm.vm_id)
        effect = Effect(vm, self.vms, start)
        await self.tasks.run("power_on", vm.vm_id, self.timing.start_s, effect, fault)
        return None

    async def _boot(self, vm: SimVM) -> None:
        await self.tasks.sleep(self.timing.boot_s)
        vm.booted.set()

    async def power_off(self, ref: VMRef) -> None:
        self.tasks.answer()
        vm = self.vms.get(ref.vm_id)
        if vm is None:
            return
        vm = self.inventory.vm(ref)
        if not vm.running:
            return

        def stop() -> None:
            vm.running = False
            vm.booted.clear()
            vm.stopped.set()
            if vm.boot_task:
                vm.boot_task.cancel()

        fault = self.tasks.fault("power_off", vm.vm_id)
        effect = Effect(vm, self.vms, stop)
        await self.tasks.run("power_off", vm.vm_id, self.timing.stop_s, effect, fault)

    async def destroy(self, ref: VMRef) -> None:
        self.tasks.answer()
        if ref.vm_id not in self.vms:
            return
        vm = self.inventory.vm(ref)
        if vm.running:
            raise PermanentError(f"VM {vm.vm_id} is running - destroy failed", vm_id=vm.vm_id)

        def remove() -> None:
            self.vms.pop(vm.vm_id, None)

        fault = self.tasks.fault("destroy", vm.vm_id)
        effect = Effect(vm, self.vms, remove)
        await self.tasks.run("destroy", vm.vm_id, self.timing.destroy_s, effect, fault)

    async def macs_in_use(self) -> dict[str, str]:
        """`KnowsMacs`: every NIC's MAC of every VM -> "name (id)"."""
        self.tasks.answer()
        return {m: f"{vm.name} ({vm.vm_id})" for vm in self.vms.values() for m in vm.macs}

    # --- the guests (guest.py) ----------------------------------------------------

    async def addresses_in_use(self, ours: str | None = None) -> list[AddressUse]:
        return await self.guests.addresses_in_use(ours)

    async def wait_for_address(
        self, ref: VMRef, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        return await self.guests.wait_for_address(ref, expected)

    async def probe_ssh(self, ref: VMRef, address: ipaddress.IPv4Address, port: int) -> str | None:
        return await self.guests.probe_ssh(ref, address, port)

    # --- template builds (building.py) --------------------------------------------

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

    async def close(self) -> None:
        self.tasks.cancel()
        for vm in self.vms.values():
            if vm.boot_task:
                vm.boot_task.cancel()
        await self.guests.close()


class SimBackend(Simulator):
    """The simulator whose guest agent reads its guests' host keys (`ReadsHostKeys`) and
    installs a host certificate (`InstallsHostCertificates`), as Proxmox's QEMU guest
    agent does: the default."""

    host_keys_through = "the simulator's guest agent"
    certificates_through = "the simulator's guest agent"

    async def host_keys(self, ref: VMRef) -> list[str]:
        return await self.guests.host_keys(ref)

    async def install_host_certificate(self, ref: VMRef, certificate: str) -> str | None:
        return await self.guests.install_host_certificate(ref, certificate)


class ChoosingSim(Simulator):
    """The simulator that installs the host key deploybot chose (`ChoosesHostKeys`), as
    vSphere does through guestinfo.userdata, keeping the private key in the VM's stored
    user-data until it is forgotten."""

    async def forget_host_key(self, ref: VMRef) -> None:
        self.tasks.answer()
        if ref.vm_id not in self.vms:
            return
        vm = self.inventory.vm(ref)
        if vm.user_data_key is None:
            return

        def forget() -> None:
            vm.user_data_key = None

        fault = self.tasks.fault("forget_host_key", vm.vm_id)
        effect = Effect(vm, self.vms, forget)
        await self.tasks.run("forget_host_key", vm.vm_id, self.timing.config_s, effect, fault)

    async def holds_host_key(self, ref: VMRef) -> bool:
        self.tasks.answer()
        vm = self.vms.get(ref.vm_id)
        return vm is not None and vm.user_data_key is not None


def sim_backend(
    name: str = "sim", *, host_keys: HostKeyMode = "agent", **options: Any
) -> Simulator:
    """The simulator of that host key mode (the module docstring)."""
    kind = {"agent": SimBackend, "chosen": ChoosingSim, "none": Simulator}[host_keys]
    return kind(name, **options)
