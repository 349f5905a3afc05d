"""What the simulated hypervisor holds: its VMs, its next VM id, its templates (those it
shipped with and those it built), and the state file that shares them with every other
process on the host that names it, as one Proxmox is shared (backends/sim/state.py).

Every other part of the simulator reads and changes the hypervisor through this one
object: a change inside `transaction()` is merged with what the other processes did and
written back under the file's lock; `pull()` sees their changes before a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from backends.base import NotOurVM, RetryableError, Template, VMNotFound, VMRef
from backends.building import BuildPlan
from backends.sim.state import SharedState, Snapshot
from backends.sim.vm import SimVM, gone, update_vm, vm_from_dict, vm_to_dict


@dataclass
class Built:
    """A template the simulator built (backends/sim/building.py)."""

    plan: BuildPlan
    name: str  # as it is called now
    placement: str
    linked: set[str] = field(default_factory=set)  # linked clones: they need it
    storage: str = "local-lvm"

    def template(self) -> Template:
        return Template(self.name, self.plan.os_family, None, self.storage, 4, self.plan.user)


class Inventory:
    """The hypervisor's contents, in memory and (with a `state_file`) in the shared file."""

    def __init__(self, shipped: tuple[Template, ...], state_file: Path | None, owner: str) -> None:
        self.vms: dict[str, SimVM] = {}
        self.built: dict[str, Built] = {}  # by VM id
        self.next_id = 101
        self.state_file = state_file
        self.owner = owner  # on the task locks this simulator takes (state.py)
        self._shipped = shipped
        self._shared: SharedState | None = None
        if state_file is not None and state_file.exists():
            self.save()  # tasks that were running when the bot died finished meanwhile

    def new_id(self) -> str:
        with self.transaction():  # no other process takes the same id
            vm_id = str(self.next_id)
            self.next_id += 1
        return vm_id

    def vm(self, ref: VMRef, *, change: bool = True) -> SimVM:
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

    # --- the templates --------------------------------------------------------------

    @property
    def templates(self) -> tuple[Template, ...]:
        """The shipped templates, then the built ones as they are called now: derived
        from `built` (keyed by VM id), so a rename touches one template even while two
        share a name (publishing, between its two renames)."""
        return (*self._shipped, *(b.template() for b in self.built.values()))

    def template_named(self, name: str) -> Template | None:
        return next((t for t in self.templates if t.name == name), None)

    def add_built(self, vm_id: str, built: Built) -> None:
        self.built[vm_id] = built

    def remove_built(self, vm_id: str) -> Built:
        return self.built.pop(vm_id)

    def note_linked(self, template: str, vm_id: str) -> None:
        """A linked clone of `template` was made: it needs the template while it lives."""
        for built in self.built.values():
            if built.name == template:
                built.linked.add(vm_id)

    def holders(self, name: str) -> list[str]:
        """What holds a name: templates (shipped or built) and VMs."""
        held = [f"template {t.name}" for t in self.templates if t.name == name]
        return held + [f"VM {v.vm_id}" for v in self.vms.values() if v.name == name]

    def _built_rows(self) -> list[dict[str, Any]]:
        """The built templates, for the state file."""
        rows = []
        for vm_id, b in self.built.items():
            plan = {**asdict(b.plan), "built_at": b.plan.built_at.isoformat()}
            rows.append(
                {"vm_id": vm_id, "plan": plan, "name": b.name, "placement": b.placement,
                 "linked": sorted(b.linked), "storage": b.storage}
            )  # fmt: skip
        return rows

    def _restore_built(self, rows: list[dict[str, Any]]) -> None:
        """The built templates as the state file has them, in place of those known."""
        self.built.clear()
        for row in sorted(rows, key=lambda r: int(r["vm_id"])):
            fields = dict(row["plan"])
            fields["built_at"] = datetime.fromisoformat(fields["built_at"])
            plan = BuildPlan(**fields)
            built = Built(plan, row["name"], row["placement"], set(row["linked"]), row["storage"])
            self.built[str(row["vm_id"])] = built

    # --- persistence: a hypervisor outlives the bot, and is shared by processes ----

    def save(self) -> None:
        """Write the inventory, merged with the other processes' changes, when a state
        file is configured."""
        with self.transaction():
            pass

    def pull(self) -> None:
        """See what the other processes on the state file changed (every call does)."""
        shared = self._state()
        if shared is not None:
            self._sync(shared, unless_unchanged=True)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
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
            self._shared = SharedState(self.state_file, self.owner)
        return self._shared

    def _snapshot(self) -> Snapshot:
        vms = {vm.vm_id: vm_to_dict(vm) for vm in self.vms.values()}
        return Snapshot(self.next_id, vms, {str(r["vm_id"]): r for r in self._built_rows()})

    def _sync(self, shared: SharedState, *, unless_unchanged: bool = False) -> None:
        """Memory becomes the merge of ours and the file; VM objects change in place,
        since tasks and waiters hold them."""
        synced = shared.sync(self._snapshot, unless_unchanged=unless_unchanged)
        if synced is None:
            return
        ours, merged = synced
        self.next_id = merged.next_id
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
            self._restore_built(list(merged.built.values()))
