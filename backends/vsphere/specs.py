# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""The specs a deploy sends to vSphere: the clone spec (vCenter), and for a standalone
ESXi host the disk copy spec and a ConfigSpec built from the template's hardware; both
carry the guest's identity (`GuestConfig`) when the caller gave it.

ConfigInfo (what a template is) and ConfigSpec (what a new VM should be) do not map one
to one: a new VM gets its default devices (PCI, IDE, keyboard, video) by itself, new
devices take temporary negative keys that the devices hanging off them refer to, and a
disk whose file already exists is attached without a file operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyVmomi import vim

from backends.base import CloneSpec, Identity, VMRef
from backends.vsphere import guestinfo
from backends.vsphere.inventory import Net, Plan, disks
from backends.vsphere.session import Props

DeviceSpec = vim.vm.device.VirtualDeviceSpec
CORES_PER_SOCKET = "config.hardware.numCoresPerSocket"
# The properties `GuestConfig.missing` compares.
GUEST_PATHS = (
    "config.hardware.numCPU",
    CORES_PER_SOCKET,
    "config.hardware.memoryMB",
    "config.extraConfig",
)


def last_extra(props: Props, key: str) -> str | None:
    """An extraConfig value as the VM uses it: the last one (vcsim appends, vSphere replaces)."""
    values = [o.value for o in props.get("config.extraConfig") or [] if o.key == key]
    return str(values[-1]) if values else None


@dataclass(frozen=True)
class GuestConfig:
    """An `Identity` as a VM's configuration carries it: CPU count, memory and the
    guestinfo keys cloud-init reads.

    Built before anything is sent (`of` refuses an SSH key that would break the
    documents), written into the clone or create spec, and compared with what a VM has
    so that `apply_identity` reconfigures only a VM that lacks it.
    """

    cores: int
    memory_mib: int
    extra: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, instance_id: str, identity: Identity) -> GuestConfig:
        # The instance UUID is new for every deploy: cloud-init runs its per-instance
        # setup only when the instance-id differs from the one cached on disk.
        extra = guestinfo.extra_config(instance_id, identity)
        return cls(identity.cores, identity.memory_mib, tuple(extra.items()))

    def fields(self, cores_per_socket: int | None) -> dict[str, Any]:
        """ConfigSpec fields; one core per socket when the cores do not fill whole
        sockets of the VM's (the template's) size."""
        found: dict[str, Any] = {
            "numCPUs": self.cores,
            "memoryMB": self.memory_mib,
            "extraConfig": [vim.option.OptionValue(key=k, value=v) for k, v in self.extra],
        }
        if self.cores % (cores_per_socket or 1):
            found["numCoresPerSocket"] = 1
        return found

    def spec(self, cores_per_socket: int | None) -> Any:
        return vim.vm.ConfigSpec(**self.fields(cores_per_socket))

    def missing(self, props: Props) -> dict[str, Any]:
        """The `fields` a VM (its GUEST_PATHS read) lacks, only those; empty when it has
        them all."""
        wanted = self.fields(props.get(CORES_PER_SOCKET))
        have = {
            "numCPUs": props.get("config.hardware.numCPU"),
            "memoryMB": props.get("config.hardware.memoryMB"),
            "numCoresPerSocket": props.get(CORES_PER_SOCKET),
        }
        found = {k: v for k, v in wanted.items() if k in have and have[k] != v}
        extra = [o for o in wanted["extraConfig"] if last_extra(props, o.key) != o.value]
        if extra:
            found["extraConfig"] = extra
        return found


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


def clone_spec(
    plan: Plan, ref: VMRef, note: str, provisioning: Disks, guest: GuestConfig | None = None
) -> Any:
    """CloneVM_Task's spec: to the pool (vSphere picks the host under DRS) and datastore,
    disks in the configured format, our instance UUID, job tag and NIC, and the guest's
    CPU, memory and guestinfo when given."""
    hw = plan.template_config.hardware
    devices = hw.device
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
        **(guest.fields(hw.numCoresPerSocket) if guest else {}),
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
    guest: GuestConfig | None = None,
) -> Any:
    """CreateVM_Task's spec from the template's hardware, around the copied disks; the
    guest's CPU, memory and guestinfo instead of the template's when given."""
    config = plan.template_config
    hw = config.hardware
    changes = _disk_changes(hw.device, copies, provisioning)
    changes += nic_changes(hw.device, plan.network, edit=False)
    hardware: dict[str, Any] = {
        "numCPUs": hw.numCPU,
        "numCoresPerSocket": hw.numCoresPerSocket,
        "memoryMB": hw.memoryMB,
        **(guest.fields(hw.numCoresPerSocket) if guest else {}),
    }
    return vim.vm.ConfigSpec(
        name=spec.name,
        guestId=config.guestId,
        version=config.version,
        firmware=config.firmware,
        instanceUuid=ref.vm_id,
        annotation=note,
        files=vim.vm.FileInfo(vmPathName=vmx_path),
        deviceChange=changes,
        **hardware,
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
