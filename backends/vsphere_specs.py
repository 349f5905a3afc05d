# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""The specs a deploy sends to vSphere: the clone spec (vCenter), and for a standalone
ESXi host the disk copy spec and a ConfigSpec built from the template's hardware.

ConfigInfo (what a template is) and ConfigSpec (what a new VM should be) do not map one
to one: a new VM gets its default devices (PCI, IDE, keyboard, video) by itself, new
devices take temporary negative keys that the devices hanging off them refer to, and a
disk whose file already exists is attached without a file operation.
"""

from __future__ import annotations

from typing import Any

from pyVmomi import vim

from backends.base import CloneSpec, VMRef
from backends.vsphere_inventory import Net, Plan, disks

DeviceSpec = vim.vm.device.VirtualDeviceSpec


class Disks:
    """vSphere's two provisioning flags; thin excludes eager (validated by the config)."""

    def __init__(self, thin: bool, eager: bool) -> None:
        self.thin = thin
        self.eager = eager

    def backing(self, file_name: str, disk_mode: str = "persistent") -> Any:
        return vim.vm.device.VirtualDisk.FlatVer2BackingInfo(
            fileName=file_name,
            diskMode=disk_mode,
            thinProvisioned=self.thin,
            eagerlyScrub=self.eager,
        )

    def copy_spec(self, devices: list[Any], disk: Any) -> Any:
        """The destination spec of CopyVirtualDisk_Task (which only ESXi implements)."""
        controller = next((d for d in devices if d.key == disk.controllerKey), None)
        ide = isinstance(controller, vim.vm.device.VirtualIDEController)
        disk_type = "thin" if self.thin else "eagerZeroedThick" if self.eager else "preallocated"
        adapter = "ide" if ide else "lsiLogic"
        return vim.VirtualDiskManager.VirtualDiskSpec(diskType=disk_type, adapterType=adapter)


def nic_changes(devices: list[Any], network: Net | None, *, edit: bool) -> list[Any]:
    """The template's first NIC on `network`: edited in place for a clone, added anew
    (same model, fresh MAC) for a created VM; an e1000e, which every guest drives, when
    the template has no NIC."""
    nics = [d for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard)]
    if network is None and (edit or not nics):
        return []  # a clone keeps the template's NIC as it is
    backing = network.backing() if network else nics[0].backing
    connect = vim.vm.device.VirtualDevice.ConnectInfo(
        startConnected=True, allowGuestControl=True, connected=False
    )
    if nics and edit:
        nic = nics[0]
        nic.backing, nic.connectable = backing, connect
        return [DeviceSpec(operation=DeviceSpec.Operation.edit, device=nic)]
    model = type(nics[0]) if nics else vim.vm.device.VirtualE1000e
    nic = model(key=-300, backing=backing, connectable=connect, addressType="generated")
    return [DeviceSpec(operation=DeviceSpec.Operation.add, device=nic)]


def clone_spec(plan: Plan, ref: VMRef, note: str, provisioning: Disks) -> Any:
    """CloneVM_Task's spec: to the pool (vSphere picks the host under DRS) and datastore,
    disks in the configured format, our instance UUID, job tag and NIC."""
    devices = plan.template_config.hardware.device
    locators = [
        vim.vm.RelocateSpec.DiskLocator(
            diskId=disk.key, datastore=plan.datastore, diskBackingInfo=provisioning.backing("")
        )
        for disk in disks(devices)
        if isinstance(disk.backing, vim.vm.device.VirtualDisk.FlatVer2BackingInfo)
    ]
    config = vim.vm.ConfigSpec(
        instanceUuid=ref.vm_id,
        annotation=note,
        deviceChange=nic_changes(devices, plan.network, edit=True),
    )
    location = vim.vm.RelocateSpec(pool=plan.pool, datastore=plan.datastore, disk=locators)
    return vim.vm.CloneSpec(location=location, powerOn=False, template=False, config=config)


def create_spec(
    spec: CloneSpec,
    ref: VMRef,
    plan: Plan,
    note: str,
    vmx_path: str,
    copies: dict[int, str],
    provisioning: Disks,
) -> Any:
    """CreateVM_Task's spec from the template's hardware, around the copied disks."""
    config = plan.template_config
    hw = config.hardware
    changes = _disk_changes(hw.device, copies, provisioning)
    changes += nic_changes(hw.device, plan.network, edit=False)
    return vim.vm.ConfigSpec(
        name=spec.name,
        guestId=config.guestId,
        version=config.version,
        firmware=config.firmware,
        numCPUs=hw.numCPU,
        numCoresPerSocket=hw.numCoresPerSocket,
        memoryMB=hw.memoryMB,
        instanceUuid=ref.vm_id,
        annotation=note,
        files=vim.vm.FileInfo(vmPathName=vmx_path),
        deviceChange=changes,
    )


def _disk_changes(devices: list[Any], copies: dict[int, str], provisioning: Disks) -> list[Any]:
    by_key = {d.key: d for d in devices}
    controllers: dict[int, int] = {}  # template key -> key in the new VM
    changes = []
    for index, disk in enumerate(disks(devices)):
        controller = by_key[disk.controllerKey]
        if isinstance(controller, vim.vm.device.VirtualIDEController):
            controllers[controller.key] = controller.key  # every new VM has both IDE ones
        elif controller.key not in controllers:
            controllers[controller.key] = -100 - len(controllers)
            changes.append(_controller(controller, controllers[controller.key]))
        copy = vim.vm.device.VirtualDisk(
            key=-200 - index,
            controllerKey=controllers[controller.key],
            unitNumber=disk.unitNumber,
            capacityInKB=disk.capacityInKB,
            backing=provisioning.backing(copies[disk.key], disk.backing.diskMode),
        )
        # No file operation: the disk file exists, it is the copy.
        changes.append(DeviceSpec(operation=DeviceSpec.Operation.add, device=copy))
    return changes


def _controller(template: Any, key: int) -> Any:
    fresh = type(template)(key=key, busNumber=template.busNumber)
    if isinstance(template, vim.vm.device.VirtualSCSIController):
        fresh.sharedBus = template.sharedBus
    return DeviceSpec(operation=DeviceSpec.Operation.add, device=fresh)
