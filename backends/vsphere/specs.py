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

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyVmomi import vim

from backends.base import CloneSpec, Identity, PermanentError, VMRef
from backends.vsphere import guestinfo, inherit, nic
from backends.vsphere.conn import Props
from backends.vsphere.inventory import Net, Plan, disks

DeviceSpec = vim.vm.device.VirtualDeviceSpec
CORES_PER_SOCKET = "config.hardware.numCoresPerSocket"
DEVICES = "config.hardware.device"
# The properties `GuestConfig.missing` compares.
GUEST_PATHS = (
    "config.hardware.numCPU",
    CORES_PER_SOCKET,
    "config.hardware.memoryMB",
    "config.extraConfig",
    DEVICES,
)
# VMware's range for MACs set by hand (a host refuses others at power-on), 22 bits wide.
STATIC_MAC_PREFIX = (0x00, 0x50, 0x56)
STATIC_MAC_BITS = 22


def last_extra(props: Props, key: str) -> str | None:
    """An extraConfig value as the VM uses it: the last one (vcsim appends, vSphere replaces)."""
    values = [o.value for o in props.get("config.extraConfig") or [] if o.key == key]
    return str(values[-1]) if values else None


def first_nic(devices: list[Any]) -> Any | None:
    """The NIC deploybot configures: the first one, as `nic_changes` edits it."""
    return next(iter(nic.nics(devices)), None)


def nic_mac(props: Props) -> str | None:
    """The first NIC's MAC as the VM has it; None without a NIC or before one is assigned."""
    nic = first_nic(props.get(DEVICES) or [])
    return str(nic.macAddress).lower() if nic is not None and nic.macAddress else None


def later_macs(props: Props, count: int) -> tuple[str, ...] | None:
    """The MACs of the `count` NICs a deploy added after the template's (the last ones:
    added devices come after the template's); None while one has none yet."""
    if not count:
        return ()
    cards = nic.nics(props.get(DEVICES) or [])
    added = cards[1:][-count:]
    if len(added) < count or not all(c.macAddress for c in added):
        return None
    return tuple(str(c.macAddress).lower() for c in added)


def static_mac(vm_id: str, taken: frozenset[str] = frozenset()) -> str:
    """A MAC in VMware's static range, derived from the VM's instance UUID, avoiding `taken`.

    For the ESXi create path: a standalone host assigns a generated MAC only when the VM
    first powers on, too late for the cloud-init metadata, which must name the MAC
    before that. Derived rather than random, so that the same VM id gives the same MAC.
    """
    for attempt in range(1 << 16):
        digest = hashlib.sha256(f"{vm_id}/{attempt}".encode()).digest()
        low = int.from_bytes(digest[:3], "big") & ((1 << STATIC_MAC_BITS) - 1)
        mac = ":".join(f"{b:02x}" for b in (*STATIC_MAC_PREFIX, *low.to_bytes(3, "big")))
        if mac not in taken:
            return mac
    raise PermanentError("no free MAC address left in VMware's static range")


@dataclass(frozen=True)
class GuestConfig:
    """An `Identity` as a VM's configuration carries it: CPU count, memory and the
    guestinfo keys cloud-init reads.

    Built before anything is sent (`of` builds the user-data, refusing an SSH key that
    would break it); the metadata names the NIC's MAC, so it joins once the MAC is
    known: in a created VM's spec (the MAC is set there), after a clone (vCenter
    assigns it in the clone). `missing` compares all of it with what a VM has, so that
    `apply_identity` reconfigures only a VM that lacks some of it.
    """

    cores: int
    memory_mib: int
    instance_id: str
    identity: Identity
    userdata: tuple[tuple[str, str], ...]

    @classmethod
    def of(
        cls, instance_id: str, identity: Identity, manage_etc_hosts: guestinfo.EtcHosts = True
    ) -> GuestConfig:
        # The instance UUID is new for every deploy: cloud-init runs its per-instance
        # setup only when the instance-id differs from the one cached on disk.
        userdata = guestinfo.userdata_config(identity, manage_etc_hosts)
        return cls(
            identity.cores, identity.memory_mib, instance_id, identity, tuple(userdata.items())
        )

    def extra(self, mac: str | None, more_macs: Sequence[str] = ()) -> dict[str, str]:
        """The guestinfo keys: the user-data, and the metadata when the MACs are known
        (the first NIC's `mac`, the later ones' `more_macs`)."""
        meta = {}
        if mac:
            meta = guestinfo.metadata_config(self.instance_id, self.identity, mac, more_macs)
        return {**meta, **dict(self.userdata)}

    def fields(
        self, cores_per_socket: int | None, mac: str | None, more_macs: Sequence[str] = ()
    ) -> dict[str, Any]:
        """ConfigSpec fields; one core per socket when the cores do not fill whole
        sockets of the VM's (the template's) size."""
        found: dict[str, Any] = {
            "numCPUs": self.cores,
            "memoryMB": self.memory_mib,
            "extraConfig": [
                vim.option.OptionValue(key=k, value=v)
                for k, v in self.extra(mac, more_macs).items()
            ],
        }
        if self.cores % (cores_per_socket or 1):
            found["numCoresPerSocket"] = 1
        return found

    def missing(self, props: Props) -> dict[str, Any]:
        """The `fields` a VM (its GUEST_PATHS read) lacks, only those; empty when it has
        them all. A VM without a NIC cannot be given its network: PermanentError."""
        mac = nic_mac(props)
        if mac is None:
            raise PermanentError(
                "the VM has no network adapter with a MAC address, so cloud-init cannot "
                "give it its address: give the template a NIC, or set the backend's `network`"
            )
        more = later_macs(props, len(self.identity.more_nics))
        if more is None:
            raise PermanentError(
                f"the VM has fewer than {1 + len(self.identity.more_nics)} network adapters "
                "with a MAC address, so cloud-init cannot give each its address: deploy again"
            )
        wanted = self.fields(props.get(CORES_PER_SOCKET), mac, more)
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


def nic_changes(
    devices: list[Any],
    network: Net | None,
    *,
    edit: bool,
    mac: str | None = None,
    model: str | None = None,
) -> list[Any]:
    """The template's first NIC on `network`: edited in place for a clone (vCenter gives
    the clone's NIC a MAC of its own unless `mac`, a fixed one, is given), added anew for
    a created VM with the MAC `mac` set by hand (None: left for the host to generate at
    power-on); an e1000e, which every guest drives, when the template has no NIC. `model`
    (vmxnet3, e1000e, e1000; None: the template's class) is the adapter class: see
    `_replaced` for a clone."""
    nics = nic.nics(devices)
    cls = nic.CLASSES[model] if model else None
    if edit and nics and cls is not None and any(type(n) is not cls for n in nics):
        return _replaced(nics, cls, network, mac)
    if edit and nics and network is None and mac is not None:
        first = nics[0]
        first.addressType, first.macAddress = "manual", mac
        return [DeviceSpec(operation=DeviceSpec.Operation.edit, device=first)]
    if network is None and (edit or not nics):
        return []  # a clone keeps the template's NIC as it is
    backing = network.backing() if network else nics[0].backing
    connect = vim.vm.device.VirtualDevice.ConnectInfo(
        startConnected=True, allowGuestControl=True, connected=False
    )
    if nics and edit:
        first = nics[0]
        first.backing, first.connectable = backing, connect
        if mac is not None:
            first.addressType, first.macAddress = "manual", mac
        return [DeviceSpec(operation=DeviceSpec.Operation.edit, device=first)]
    card = cls or (type(nics[0]) if nics else nic.CLASSES[nic.FALLBACK])
    address = {"addressType": "manual", "macAddress": mac} if mac else {"addressType": "generated"}
    added = card(key=-300, backing=backing, connectable=connect, **address)
    return [DeviceSpec(operation=DeviceSpec.Operation.add, device=added)]


def _replaced(nics: list[Any], cls: Any, network: Net | None, mac: str | None) -> list[Any]:
    """A clone's NICs in another class. vSphere cannot change a device's class by an
    edit: each NIC is removed and added again as `cls`, carrying its MAC (address type
    and address), backing (the first one's: `network` when given), connection settings
    and PCI slot (the guest names the interface after the slot). All of them, in order,
    so that the first NIC stays the first (`first_nic`: the one cloud-init configures)
    and no NIC of the old class is left for a guest that cannot drive it. A fixed `mac`
    replaces the first one's."""
    changes = [DeviceSpec(operation=DeviceSpec.Operation.remove, device=n) for n in nics]
    for index, old in enumerate(nics):
        backing = network.backing() if network and index == 0 else old.backing
        connect = old.connectable
        if network and index == 0:
            connect = vim.vm.device.VirtualDevice.ConnectInfo(
                startConnected=True, allowGuestControl=True, connected=False
            )
        fixed = mac is not None and index == 0
        new = cls(
            key=-300 - index,
            backing=backing,
            connectable=connect,
            addressType="manual" if fixed else old.addressType,
            macAddress=mac if fixed else old.macAddress,
            slotInfo=old.slotInfo,
            wakeOnLanEnabled=old.wakeOnLanEnabled,
        )
        changes.append(DeviceSpec(operation=DeviceSpec.Operation.add, device=new))
    return changes


def more_nics(devices: list[Any], plan: Plan, macs: Sequence[str | None]) -> list[Any]:
    """The NICs after the first (`plan.more`), added after the template's: each on its
    network (None: the first NIC's), in the first NIC's class (the profile's model, else
    the template's), with its MAC in `macs` set by hand (None: generated by vCenter)."""
    own = nic.nics(devices)
    model = _model(plan)
    card = nic.CLASSES[model] if model else type(own[0]) if own else nic.CLASSES[nic.FALLBACK]
    first = plan.network.backing() if plan.network else own[0].backing if own else None
    changes = []
    for index, ((network, _fixed), mac) in enumerate(zip(plan.more, macs, strict=True), 1):
        backing = network.backing() if network else first
        if backing is None:
            raise PermanentError(
                "the template has no network adapter and the backend no `network`, so a "
                "second NIC has no network to join: set the backend's `network`"
            )
        connect = vim.vm.device.VirtualDevice.ConnectInfo(
            startConnected=True, allowGuestControl=True, connected=False
        )
        address = (
            {"addressType": "manual", "macAddress": mac} if mac else {"addressType": "generated"}
        )
        added = card(key=-400 - index, backing=backing, connectable=connect, **address)
        changes.append(DeviceSpec(operation=DeviceSpec.Operation.add, device=added))
    return changes


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
    fixed = [mac for _net, mac in plan.more]
    first = nic_changes(devices, plan.network, edit=True, mac=plan.mac, model=_model(plan))
    config = vim.vm.ConfigSpec(
        instanceUuid=ref.vm_id,
        annotation=note,
        deviceChange=first + more_nics(devices, plan, fixed),
        # The MAC is vCenter's to assign in the clone: the metadata follows it (_settle).
        **(guest.fields(hw.numCoresPerSocket, None) if guest else {}),
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
    mac: str | None = None,
    more_macs: Sequence[str] = (),
) -> Any:
    """CreateVM_Task's spec from the template's settings and hardware, around the copied
    disks, its NIC with the MAC `mac` and the later ones (`plan.more`) with `more_macs`;
    the guest's CPU, memory and guestinfo (its metadata naming those MACs) instead of
    the template's when given."""
    config = plan.template_config
    hw = config.hardware
    nic_add = nic_changes(hw.device, plan.network, edit=False, mac=mac, model=_model(plan))
    more_add = more_nics(hw.device, plan, more_macs)
    changes = _disk_changes(hw.device, copies, provisioning) + nic_add + more_add
    # What a clone would keep of the template: guest OS, version, firmware, boot
    # options, flags, extraConfig but the template's own keys (`inherit`).
    fields = inherit.settings(config)
    hardware: dict[str, Any] = {
        "numCPUs": hw.numCPU,
        "numCoresPerSocket": hw.numCoresPerSocket,
        "memoryMB": hw.memoryMB,
    }
    if guest:
        identity = guest.fields(hw.numCoresPerSocket, mac if nic_add else None, more_macs)
        identity["extraConfig"] = fields.pop("extraConfig") + identity["extraConfig"]
        hardware |= identity
    return vim.vm.ConfigSpec(
        **fields,
        name=spec.name,
        instanceUuid=ref.vm_id,
        annotation=note,
        files=vim.vm.FileInfo(vmPathName=vmx_path),
        deviceChange=changes,
        **hardware,
    )


def _model(plan: Plan) -> str | None:
    return plan.nic.model if plan.nic is not None else None


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
