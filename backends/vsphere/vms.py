# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""Finding VMs: by instance UUID (ours), by name, and the MACs in use (`KnownVMs`, held
by `VSphereBackend` and given to its inventory and builds).
Blocking; runs inside `Session.run`.

VMs are identified by instance UUID: managed object ids belong to one server's
database. The object each UUID was last found at is tried first (one read instead of a
FindByUuid and a read), and used only while it still has that UUID. Checks over every
VM (a name, the MACs of a standalone host) read the session's tracker, which learns
only what changed since it last looked (`Conn.tracked`).
"""

from __future__ import annotations

import threading
from typing import Any

from pyVmomi import vim, vmodl

from backends.base import NotOurVM, VMInfo, VMRef
from backends.tags import parse_tag
from backends.vsphere.addresses import ADDRESS_PATHS
from backends.vsphere.conn import Conn, Props, Row

VM_PATHS = ["name", "config.annotation", "runtime.powerState"]
POWERED_ON = "poweredOn"
# What the session's tracker keeps of every VM (`tracked_vms`): the name and template
# mark (name check, template list), the instance UUID and the addresses Tools reports
# (the address conflict check, backends/vsphere/addresses.py): a few hundred bytes each.
# One tracker for all of them: one look per check, not one per check and kind.
MAC_PATHS = ["name", "config.template", "config.instanceUuid", "config.hardware.device"]
TRACKED_PATHS = ["name", "config.template", "config.instanceUuid", *ADDRESS_PATHS]
# VMs whose object is remembered by instance UUID (oldest forgotten first).
MAX_FOUND = 1024


def tags(annotation: object) -> frozenset[str]:
    """The job tags on the lines of an annotation."""
    lines = (line.strip() for line in str(annotation or "").splitlines())
    return frozenset(line for line in lines if parse_tag(line) is not None)


def vm_info(vm_id: str, props: Props, placement: str | None = None) -> VMInfo:
    running = props.get("runtime.powerState") == POWERED_ON
    return VMInfo(
        vm_id, str(props.get("name")), running, tags(props.get("config.annotation")), placement
    )


class KnownVMs:
    """VM lookups, and which object each instance UUID was found at."""

    def __init__(self) -> None:
        self._vm_lock = threading.Lock()
        self._found: dict[str, Any] = {}  # instance UUID -> VM, checked at every use

    def tracked_vms(self, conn: Conn) -> dict[str, Row]:
        """Every VM the session can see, with the properties the checks need, kept up
        to date by one request that returns what changed (`Conn.tracked`): the names,
        template marks, instance UUIDs and reported addresses, and on a standalone host
        the devices (for their MACs)."""
        paths = TRACKED_PATHS if conn.vcenter else [*TRACKED_PATHS, "config.hardware.device"]
        return conn.tracked(conn.content.rootFolder, vim.VirtualMachine, paths)

    def macs(self, conn: Conn) -> frozenset[str]:
        """The MAC of every NIC of every VM the session can see (on a standalone host:
        all of its VMs), so that a MAC set by hand is not one of them."""
        card = vim.vm.device.VirtualEthernetCard
        return frozenset(
            str(d.macAddress).lower()
            for _o, p in self.tracked_vms(conn).values()
            for d in p.get("config.hardware.device") or []
            if isinstance(d, card) and d.macAddress
        )

    def macs_by_vm(self, conn: Conn) -> dict[str, str]:
        """`KnowsMacs`: each NIC's MAC of every VM the session can see (templates left
        out) -> "name (instance UUID)". On a standalone host from the tracker the name
        check keeps (it has the devices); on vCenter from a tracker of its own, so the
        name and address checks do not carry every VM's devices: its first look reads
        them all, each later one is one request with what changed."""
        if conn.vcenter:
            rows = conn.tracked(conn.content.rootFolder, vim.VirtualMachine, MAC_PATHS)
        else:
            rows = self.tracked_vms(conn)
        card = vim.vm.device.VirtualEthernetCard
        return {
            str(d.macAddress).lower(): f"{p.get('name')} ({p.get('config.instanceUuid')})"
            for _o, p in rows.values()
            if not p.get("config.template")
            for d in p.get("config.hardware.device") or []
            if isinstance(d, card) and d.macAddress
        }

    def vms(
        self, conn: Conn, name: str | None = None, tracked: dict[str, Row] | None = None
    ) -> list[VMInfo]:
        """Every VM the session can see (or those called `name`, found among the
        `tracked` rows when the caller has them), by instance UUID."""
        root, paths = conn.content.rootFolder, [*VM_PATHS, "config.instanceUuid"]
        if name is None:
            rows = conn.contained(root, vim.VirtualMachine, paths)
        else:  # names of all (what changed since the last look), details of matches
            named = (self.tracked_vms(conn) if tracked is None else tracked).values()
            matches = [obj for obj, p in named if p.get("name") == name]
            try:
                rows = conn.retrieve(matches, vim.VirtualMachine, paths)
            except vmodl.fault.ManagedObjectNotFound:  # one went meanwhile: look again
                rows = conn.retrieve(self._named(conn, name), vim.VirtualMachine, paths)
        return [vm_info(str(p.get("config.instanceUuid")), p) for _o, p in rows]

    def _named(self, conn: Conn, name: str) -> list[Any]:
        return [o for o, p in self.tracked_vms(conn).values() if p.get("name") == name]

    def lookup(self, conn: Conn, vm_id: str, paths: tuple[str, ...] = ()) -> Row | None:
        """The VM with this instance UUID and its properties; None when there is none.

        The object a UUID was last found at is tried first: one read instead of a
        FindByUuid and a read. It counts only if it still has that instance UUID (a
        managed object id may name another VM after a database rebuild)."""
        wanted = [*VM_PATHS, "config.instanceUuid", *paths]
        with self._vm_lock:
            known = self._found.get(vm_id)
        if known is not None:
            try:
                p = conn.props(known, vim.VirtualMachine, wanted)
            except vmodl.fault.ManagedObjectNotFound:
                p = {}
            if p.get("config.instanceUuid") == vm_id:
                return known, p
            self.remember(vm_id, None)
        vm = conn.find_vm(vm_id)
        if vm is None:
            return None
        try:
            found = vm, conn.props(vm, vim.VirtualMachine, wanted)
        except vmodl.fault.ManagedObjectNotFound:
            return None  # removed between the search and the read
        self.remember(vm_id, vm)
        return found

    def remembered(self, vm_id: str) -> Any | None:
        """The object last found for this instance UUID, unchecked: the caller checks."""
        with self._vm_lock:
            return self._found.get(vm_id)

    def remember(self, vm_id: str, vm: Any | None) -> None:
        """Note (or, with None, forget) the object a VM's instance UUID names."""
        with self._vm_lock:
            self._found.pop(vm_id, None)
            if vm is not None:
                self._found[vm_id] = vm
                while len(self._found) > MAX_FOUND:
                    self._found.pop(next(iter(self._found)))

    def ours(self, conn: Conn, ref: VMRef, paths: tuple[str, ...] = ()) -> Row | None:
        """Like `lookup`, but NotOurVM when the VM lacks the ref's job tag."""
        found = self.lookup(conn, ref.vm_id, paths)
        if found is not None:
            self.check_tag(ref, found[1])
        return found

    @staticmethod
    def check_tag(ref: VMRef, p: Props) -> None:
        """NotOurVM unless the VM (its name and annotation in `p`) has the ref's tag."""
        if ref.tag not in tags(p.get("config.annotation")):
            raise NotOurVM(
                f"VM {p.get('name')} (instance UUID {ref.vm_id}) does not carry tag "
                f"{ref.tag}: deploybot leaves it alone",
                vm_id=ref.vm_id,
            )
