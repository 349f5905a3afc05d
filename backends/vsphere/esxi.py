# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""The standalone ESXi path of a clone: a host without vCenter has no CloneVM_Task.

Make the VM's folder, copy the template's disks into it (`CopyVirtualDisk_Task`), then
create a VM around the copies (`CreateVM_Task`) from the template's hardware and the
settings a clone would keep (`inherit`). The NIC's MAC is set in that spec: the host
would generate one only at the first power-on, and the cloud-init metadata, written in
the same spec, must name it before that.
"""

from __future__ import annotations

import logging
from typing import Any

from backends.base import CloneSpec, VMRef
from backends.vsphere import specs
from backends.vsphere.inventory import Inventory, Plan, annotation, disks
from backends.vsphere.session import Op
from backends.vsphere.vms import KnownVMs

log = logging.getLogger(__name__)


def copy_and_create(
    op: Op,
    spec: CloneSpec,
    ref: VMRef,
    plan: Plan,
    guest: specs.GuestConfig | None,
    provisioning: specs.Disks,
    inventory: Inventory,
    known: KnownVMs,
) -> Any:
    """Copy the template's disks into a new folder, then create a VM around them; on any
    failure the folder goes again. Returns the new VM."""
    content = op.conn.content
    # The UUID in the folder name keeps it unique and traceable to the VM.
    folder = f"[{plan.datastore_name}] {spec.name}-{ref.vm_id[:8]}"
    content.fileManager.MakeDirectory(folder, plan.datacenter, False)
    try:
        devices = plan.template_config.hardware.device
        copies = {}
        for index, disk in enumerate(disks(devices)):
            op.check()
            target = f"{folder}/{spec.name}{f'_{index}' if index else ''}.vmdk"
            task = content.virtualDiskManager.CopyVirtualDisk_Task(
                sourceName=disk.backing.fileName,
                sourceDatacenter=plan.datacenter,
                destName=target,
                destDatacenter=plan.datacenter,
                destSpec=provisioning.copy_spec(devices, disk),
                force=False,
            )
            op.wait(task)
            copies[disk.key] = target
        op.check()
        vmx = f"{folder}/{spec.name}.vmx"
        # Unique among the host's VMs (a standalone host sees all of its own).
        taken = known.macs(op.conn)
        mac = spec.mac or specs.static_mac(ref.vm_id, taken)
        more: list[str] = []
        for index, (_net, fixed) in enumerate(plan.more, start=1):
            chosen = taken | {mac, *more}
            more.append(fixed or specs.static_mac(f"{ref.vm_id}/nic{index}", frozenset(chosen)))
        config = specs.create_spec(
            spec, ref, plan, annotation(spec), vmx, copies, provisioning, guest, mac, more
        )
        return op.wait(plan.folder.CreateVM_Task(config=config, pool=plan.pool))
    except BaseException:
        _remove_folder(op, ref, folder, plan.datacenter, inventory.name)
        raise


def _remove_folder(op: Op, ref: VMRef, folder: str, datacenter: Any, backend: str) -> None:
    """Undo a half-done copy: the folder goes, unless a VM was created in it (the
    rollback's destroy removes that VM with its files)."""
    try:
        if op.conn.find_vm(ref.vm_id) is None:
            manager = op.conn.content.fileManager
            # An Op of its own: the clean-up must not be cancelled with the copy.
            Op(op.conn, op.grace_s).wait(manager.DeleteDatastoreFile_Task(folder, datacenter))
    except Exception:
        log.warning("backend %s: could not remove %s", backend, folder, exc_info=True)
