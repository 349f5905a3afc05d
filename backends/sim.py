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
* ``outage``: the hypervisor goes down at that call, before anything happens, and
  stays down (every call is refused) until the test brings it back: `down` set to
  False, or the file `<state_file>.down` removed, which the outage creates.

Queries (``templates``, ``find_by_name``, ``wait_for_address``, ``probe_ssh``,
``addresses_in_use``) have no
work to do, so for them ``hang``, ``error`` and ``crash`` act at once.

With a `state_file`, the VMs outlive the process and are shared by every process on
the host that names the file, as one Proxmox is shared (backends/simstate.py).

A guest whose address is in 127.0.0.0/8 gets a real TCP probe for SSH (tests start a
listener there); for any other address the simulator answers the probe itself, so no
packet ever leaves the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Iterator, Mapping
from pathlib import Path

from backends.base import (
    CloneMode,
    CloneSpec,
    Identity,
    IdTaken,
    Network,
    NotOurVM,
    PermanentError,
    Placement,
    RetryableError,
    Storage,
    Template,
    VMInfo,
    VMNotFound,
    VMRef,
)
from backends.config import BackendConfig, SshJump
from backends.simbuild import SimBuilds, _Built
from backends.simguest import SimGuests
from backends.simstate import SharedState, Snapshot, new_owner
from backends.simtasks import SimTasks
from backends.simvm import (
    DEFAULT_STORAGES,
    DEFAULT_TEMPLATES,
    OPERATIONS,
    Config,
    Effect,
    Fault,
    FaultKind,
    SimTiming,
    SimVM,
    gone,
    update_vm,
    vm_from_dict,
    vm_to_dict,
)
from backends.sshcheck import SshCheck
from backends.tags import job_marks


def create(config: BackendConfig, environ: Mapping[str, str]) -> SimBackend:
    assert isinstance(config, Config)
    sim = SimBackend(
        config.name,
        placements=config.placements,
        time_scale=config.time_scale,
        state_file=config.state_file,
        ssh_jump=config.ssh_jump,
    )
    for fault in config.faults:
        sim.inject(fault.op, fault.kind, fault.times)
    return sim


class SimBackend(SimTasks, SimGuests, SimBuilds):
    """A simulated hypervisor. Construct it, optionally inject faults, use it as a Backend."""

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
    ) -> None:
        self.name = name
        self.default_network: str | None = None
        self._shipped = templates
        self._templates = templates
        self._ssh = SshCheck(ssh_jump)  # for the guests the check really connects to
        self.time_scale = time_scale
        self.timing = timing or SimTiming()
        self.ssh_port = ssh_port
        self._placements = placements
        self.vms: dict[str, SimVM] = {}
        self.built: dict[str, _Built] = {}  # templates it built (backends/simbuild.py)
        self.without_avx2: set[str] = set()
        self.faults: list[Fault] = []
        self.task_log: list[tuple[str, str]] = []
        self._next_id = 101
        self._tasks: set[asyncio.Task[None]] = set()
        self.state_file = state_file
        self.down = False
        self._owner = new_owner()  # on the task locks it takes (backends/simstate.py)
        self._shared: SharedState | None = None
        if state_file is not None and state_file.exists():
            self._save()  # tasks that were running when the bot died finished meanwhile

    def _new_id(self) -> str:
        with self._transaction():  # no other process takes the same id
            vm_id = str(self._next_id)
            self._next_id += 1
        return vm_id

    # --- persistence: a hypervisor outlives the bot, and is shared by processes ----

    def _save(self) -> None:
        """Write the inventory, merged with the other processes' changes, when a state
        file is configured (backends/simstate.py)."""
        with self._transaction():
            pass

    def _pull(self) -> None:
        """See what the other processes on the state file changed (every call does)."""
        shared = self._state()
        if shared is not None:
            self._sync(shared, unless_unchanged=True)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A change: under the state file's lock, read and merge it, change, write it.
        The lock is held for synchronous file I/O on the event loop: about 1 ms with 10
        VMs, 10 ms with 200 (a simulator can afford it)."""
        shared = self._state()
        if shared is None:
            yield
            return
        with shared.locked():
            self._sync(shared)
            yield
            shared.write(self._snapshot())

    def _state(self) -> SharedState | None:
        if self.state_file is None:
            return None
        if self._shared is None or self._shared.path != self.state_file:
            self._shared = SharedState(self.state_file, self._owner)
        return self._shared

    def _snapshot(self) -> Snapshot:
        vms = {vm.vm_id: vm_to_dict(vm) for vm in self.vms.values()}
        return Snapshot(self._next_id, vms, {str(r["vm_id"]): r for r in self.built_rows()})

    def _sync(self, shared: SharedState, *, unless_unchanged: bool = False) -> None:
        """Memory becomes the merge of ours and the file; VM objects change in place,
        since tasks and waiters hold them."""
        synced = shared.sync(self._snapshot, unless_unchanged=unless_unchanged)
        if synced is None:
            return
        ours, merged = synced
        self._next_id = merged.next_id
        for vm_id in [v for v in self.vms if v not in merged.vms]:
            gone(self.vms.pop(vm_id))
        for vm_id, row in merged.vms.items():
            if vm_id not in self.vms:
                vm = self.vms[vm_id] = vm_from_dict(row)
                if vm.running:
                    vm.booted.set()
            elif row != ours.vms[vm_id]:
                update_vm(self.vms[vm_id], row)
        if merged.built != ours.built:
            self.restore_built(list(merged.built.values()))

    # --- test and demo controls ---------------------------------------------------

    def inject(self, op: str, kind: FaultKind, times: int = 1) -> None:
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPERATIONS)}")
        self.faults.append(Fault(op, kind, times))

    def add_vm(
        self,
        name: str,
        *,
        tags: set[str] | None = None,
        running: bool = True,
        address: ipaddress.IPv4Address | None = None,
    ) -> str:
        """Put a VM on the simulator that deploybot did not create (or an orphan), with
        the `address` its owner gave it, if any."""
        vm_id = self._new_id()
        with self._transaction():
            self.vms[vm_id] = SimVM(
                vm_id, name, "ubuntu-24.04", self._placements[0], "local-lvm", 4,
                tags or set(), running,
            )  # fmt: skip
            self.vms[vm_id].address = address
            if running:
                self.vms[vm_id].booted.set()
        return vm_id

    def _vm(self, ref: VMRef, *, change: bool = True) -> SimVM:
        """The VM behind a ref, if it carries the ref's job tag; a change also needs it
        unlocked (every task holds the VM's lock while it runs, as on Proxmox)."""
        vm = self.vms.get(ref.vm_id)
        if vm is None:
            raise VMNotFound(f"VM {ref.vm_id} does not exist", vm_id=ref.vm_id)
        if ref.tag not in vm.tags:
            raise NotOurVM(
                f"VM {ref.vm_id} ({vm.name}) does not carry tag {ref.tag}", vm_id=vm.vm_id
            )
        if change and vm.lock:
            raise RetryableError(f"VM {vm.vm_id} is locked ({vm.lock})", vm_id=vm.vm_id)
        return vm

    # --- discovery ----------------------------------------------------------------

    async def templates(self) -> list[Template]:
        self._answer()
        await self._query_fault("templates")
        return list(self._templates)

    async def storages(self, placement: str | None = None) -> list[Storage]:
        self._answer()
        return [Storage(n, placement, t, f, linked) for n, t, f, linked in DEFAULT_STORAGES]

    async def networks(self, placement: str | None = None) -> list[Network]:
        self._answer()
        return [Network("vmbr0", placement), Network("vmbr1", placement)]

    async def placements(self) -> list[Placement]:
        self._answer()
        return [Placement(p) for p in self._placements]

    async def _template(self, name: str) -> Template:
        for template in self._templates:
            if template.name == name:
                return template
        known = ", ".join(t.name for t in self._templates)
        raise PermanentError(f"template {name!r} does not exist on {self.name} (have: {known})")

    async def clone_mode(self, spec: CloneSpec) -> CloneMode:
        self._answer()
        template = await self._template(spec.template)
        target = spec.storage or template.storage
        if target != template.storage:
            return CloneMode(False, f"{target} is not the template's storage: full copy")
        linked = any(n == target and lk for n, _t, _f, lk in DEFAULT_STORAGES)
        if linked:
            return CloneMode(True, f"linked clone on {target}")
        return CloneMode(False, f"{target} cannot hold linked clones: full copy")

    async def find_vm(self, ref: VMRef) -> VMInfo | None:
        self._answer()
        vm = self.vms.get(ref.vm_id)
        return vm.info() if vm else None

    async def find_by_name(self, name: str) -> list[VMInfo]:
        self._answer()
        await self._query_fault("find_by_name")
        return [vm.info() for vm in self.vms.values() if vm.name == name]

    async def find_tagged(self) -> list[VMInfo]:
        self._answer()
        return [vm.info() for vm in self.vms.values() if job_marks(vm.tags)]

    # --- the deploy moves ---------------------------------------------------------

    async def prepare_clone(self, spec: CloneSpec) -> VMRef:
        self._answer()
        await self._template(spec.template)
        placement = spec.placement or self._placements[0]
        if placement not in self._placements:
            raise PermanentError(
                f"{placement!r} is not a node of {self.name} (have: {', '.join(self._placements)})"
            )
        return VMRef(self._new_id(), spec.job_id, placement, spec.installation)

    async def clone(self, spec: CloneSpec, ref: VMRef) -> str | None:
        self._answer()
        template = await self._template(spec.template)
        if ref.vm_id in self.vms:
            # Another client took the id between prepare_clone and clone.
            raise IdTaken(f"unable to create VM {ref.vm_id}: config file already exists")
        mode = await self.clone_mode(spec)
        fault = self._fault("clone", ref.vm_id)
        vm = SimVM(
            ref.vm_id,
            spec.name,
            template.name,
            ref.placement or self._placements[0],
            spec.storage or template.storage or "local-lvm",
            template.disk_gib,
            {spec.tag},
            lock="clone",
            lock_owner=self._owner,
        )
        with self._transaction():  # and again where it is taken, under the file's lock
            if ref.vm_id in self.vms:
                raise IdTaken(f"unable to create VM {ref.vm_id}: config file already exists")
            self.vms[vm.vm_id] = vm
            if mode.linked:
                self.note_linked(template.name, vm.vm_id)
        seconds = self.timing.clone_linked_s if mode.linked else self.timing.clone_full_s
        await self._run("clone", vm.vm_id, seconds, Effect(vm, self.vms, remove=True), fault)
        return None

    async def apply_identity(self, ref: VMRef, identity: Identity) -> str | None:
        self._answer()
        vm = self._vm(ref)

        def set_identity() -> None:
            vm.identity = identity

        fault = self._fault("apply_identity", vm.vm_id)
        effect = Effect(vm, self.vms, set_identity)
        await self._run("apply_identity", vm.vm_id, self.timing.config_s, effect, fault)
        return None

    async def grow_disk(self, ref: VMRef, grow_gib: int) -> str | None:
        self._answer()
        if grow_gib < 0:
            raise PermanentError("shrinking disks is not supported")
        vm = self._vm(ref)
        target = vm.grow_target_gib or vm.disk_gib + grow_gib
        if vm.disk_gib >= target:
            return None  # grown already, by an attempt whose answer was lost
        vm.grow_target_gib = target  # saved with the task's lock

        def grow() -> None:
            vm.disk_gib = target

        fault = self._fault("grow_disk", vm.vm_id)
        await self._run(
            "grow_disk", vm.vm_id, self.timing.resize_s, Effect(vm, self.vms, grow), fault
        )
        return None

    async def power_on(self, ref: VMRef) -> str | None:
        self._answer()
        vm = self._vm(ref)
        if vm.running:
            raise PermanentError(f"VM {vm.vm_id} already running", vm_id=vm.vm_id)

        def start() -> None:
            vm.running = True
            vm.booted.clear()
            vm.stopped.clear()
            vm.boot_task = asyncio.create_task(self._boot(vm))

        fault = self._fault("power_on", vm.vm_id)
        await self._run(
            "power_on", vm.vm_id, self.timing.start_s, Effect(vm, self.vms, start), fault
        )
        return None

    async def _boot(self, vm: SimVM) -> None:
        await self._sleep(self.timing.boot_s)
        vm.booted.set()

    async def power_off(self, ref: VMRef) -> None:
        self._answer()
        vm = self.vms.get(ref.vm_id)
        if vm is None:
            return
        vm = self._vm(ref)
        if not vm.running:
            return

        def stop() -> None:
            vm.running = False
            vm.booted.clear()
            vm.stopped.set()
            if vm.boot_task:
                vm.boot_task.cancel()

        fault = self._fault("power_off", vm.vm_id)
        await self._run(
            "power_off", vm.vm_id, self.timing.stop_s, Effect(vm, self.vms, stop), fault
        )

    async def destroy(self, ref: VMRef) -> None:
        self._answer()
        if ref.vm_id not in self.vms:
            return
        vm = self._vm(ref)
        if vm.running:
            raise PermanentError(f"VM {vm.vm_id} is running - destroy failed", vm_id=vm.vm_id)

        def remove() -> None:
            self.vms.pop(vm.vm_id, None)

        fault = self._fault("destroy", vm.vm_id)
        await self._run(
            "destroy", vm.vm_id, self.timing.destroy_s, Effect(vm, self.vms, remove), fault
        )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for vm in self.vms.values():
            if vm.boot_task:
                vm.boot_task.cancel()
        await self._ssh.close()
