"""The files of a template import on the bot host: the disk as a stream-optimized VMDK
(`qemu-img convert`), a minimal OVF 1.0 descriptor around it, and the descriptor of an
OVA read from its head alone.

Nothing here talks to vSphere: `ovfimport` hands the descriptor to
`OvfManager.CreateImportSpec` and uploads the VMDK to the lease's device URL.
"""

from __future__ import annotations

import asyncio
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from xml.sax.saxutils import escape, quoteattr

from backends.base import PermanentError

# Guest ids every vSphere since 6.5 (the API version the session pins) knows; the
# inventory's `os_family` reads the family back from them.
GUEST_IDS = {
    "debian": "debian10_64Guest",
    "ubuntu": "ubuntu64Guest",
    "el": "rhel7_64Guest",
}
OTHER_LINUX = "other3xLinux64Guest"
# OVF names of the NIC models (vcsim and vCenter lower-case them). virtio is Proxmox's
# and becomes e1000e, which every guest drives: a vmxnet3 template is refused for deploys
# until vSphere has seen VMware Tools run in it (`nic`), and an imported one never ran.
NIC_TYPES = {"vmxnet3": "VmxNet3", "e1000": "E1000", "e1000e": "E1000e", "virtio": "E1000e"}
# Disk controllers: (CIM resource type, OVF subtype). SCSI and virtio become
# paravirtual SCSI; SATA and IDE become IDE (every vSphere reads that from an OVF).
CONTROLLERS = {
    "scsi": (6, "VirtualSCSI"),
    "virtio": (6, "VirtualSCSI"),
    "sata": (5, "PIIX4"),
    "ide": (5, "PIIX4"),
}
HARDWARE_VERSION = "vmx-13"  # ESXi 6.5
STREAM_VMDK = "http://www.vmware.com/interfaces/specifications/vmdk.html#streamOptimized"


def guest_id(os_family: str) -> str:
    return GUEST_IDS.get(os_family, OTHER_LINUX)


@dataclass(frozen=True)
class Machine:
    """What the descriptor says: one disk, one NIC, CPU, memory, guest, firmware."""

    name: str
    os_family: str
    cores: int
    memory_mib: int
    nic: str
    disk_bus: str
    network: str  # the name the NIC's connection carries (mapped at import)
    disk_file: str  # the VMDK's name in the descriptor's References
    disk_file_size: int
    disk_capacity: int  # bytes the guest sees
    firmware: str = "bios"  # or "efi"


def check_models(nic: str, disk_bus: str) -> None:
    """PermanentError for a NIC model or disk bus that vSphere has no equivalent of."""
    if nic not in NIC_TYPES:
        raise PermanentError(
            f"NIC model {nic!r} has no vSphere equivalent (choose one of {', '.join(NIC_TYPES)})"
        )
    if disk_bus not in CONTROLLERS:
        raise PermanentError(
            f"disk bus {disk_bus!r} has no vSphere equivalent "
            f"(choose one of {', '.join(CONTROLLERS)})"
        )


def descriptor(m: Machine) -> str:
    """A minimal, valid OVF 1.0 envelope for `m`."""
    check_models(m.nic, m.disk_bus)
    kind, subtype = CONTROLLERS[m.disk_bus]
    guest = guest_id(m.os_family)
    name, net = escape(m.name), escape(m.network)
    items = [
        _item(1, "Virtual CPUs", 3, f"<rasd:VirtualQuantity>{m.cores}</rasd:VirtualQuantity>"),
        _item(
            2,
            "Memory",
            4,
            "<rasd:AllocationUnits>byte * 2^20</rasd:AllocationUnits>"
            f"<rasd:VirtualQuantity>{m.memory_mib}</rasd:VirtualQuantity>",
        ),
        _item(
            3, "Disk controller", kind, f"<rasd:ResourceSubType>{subtype}</rasd:ResourceSubType>"
        ),
        _item(
            4,
            "Hard disk 1",
            17,
            "<rasd:AddressOnParent>0</rasd:AddressOnParent>"
            "<rasd:HostResource>ovf:/disk/disk1</rasd:HostResource>"
            "<rasd:Parent>3</rasd:Parent>",
        ),
        _item(
            5,
            "Network adapter 1",
            10,
            "<rasd:AutomaticAllocation>true</rasd:AutomaticAllocation>"
            f"<rasd:Connection>{net}</rasd:Connection>"
            f"<rasd:ResourceSubType>{NIC_TYPES[m.nic]}</rasd:ResourceSubType>",
        ),
    ]
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<Envelope xmlns="http://schemas.dmtf.org/ovf/envelope/1"
 xmlns:ovf="http://schemas.dmtf.org/ovf/envelope/1"
 xmlns:rasd="http://schemas.dmtf.org/wbem/wscim/1/cim-schema/2/CIM_ResourceAllocationSettingData"
 xmlns:vssd="http://schemas.dmtf.org/wbem/wscim/1/cim-schema/2/CIM_VirtualSystemSettingData"
 xmlns:vmw="http://www.vmware.com/schema/ovf">
  <References>
    <File ovf:id="file1" ovf:href={quoteattr(m.disk_file)} ovf:size="{m.disk_file_size}"/>
  </References>
  <DiskSection>
    <Info>Virtual disks</Info>
    <Disk ovf:diskId="disk1" ovf:fileRef="file1" ovf:capacity="{m.disk_capacity}"
     ovf:capacityAllocationUnits="byte" ovf:format="{STREAM_VMDK}"/>
  </DiskSection>
  <NetworkSection>
    <Info>Networks</Info>
    <Network ovf:name="{net}"><Description>The template's network</Description></Network>
  </NetworkSection>
  <VirtualSystem ovf:id="{name}">
    <Info>A deploybot template</Info>
    <Name>{name}</Name>
    <OperatingSystemSection ovf:id="101" vmw:osType="{guest}">
      <Info>Guest operating system</Info>
    </OperatingSystemSection>
    <VirtualHardwareSection>
      <Info>Virtual hardware</Info>
      <System>
        <vssd:ElementName>Virtual Hardware Family</vssd:ElementName>
        <vssd:InstanceID>0</vssd:InstanceID>
        <vssd:VirtualSystemType>{HARDWARE_VERSION}</vssd:VirtualSystemType>
      </System>
      {"".join(items)}
      <vmw:Config ovf:required="false" vmw:key="firmware" vmw:value="{escape(m.firmware)}"/>
    </VirtualHardwareSection>
  </VirtualSystem>
</Envelope>
"""


def _item(instance: int, label: str, kind: int, rest: str) -> str:
    return (
        f"<Item><rasd:ElementName>{label}</rasd:ElementName>"
        f"<rasd:InstanceID>{instance}</rasd:InstanceID>"
        f"<rasd:ResourceType>{kind}</rasd:ResourceType>{rest}</Item>\n      "
    )


def ova_descriptor(ova: Path | IO[bytes]) -> str:
    """The .ovf descriptor of an OVA, read from the archive's first member alone: the
    tar is read as a stream and left after that member (the disks follow, gigabytes
    that need not be read)."""
    try:
        if isinstance(ova, Path):
            with ova.open("rb") as stream:
                return _first_member(stream, str(ova))
        return _first_member(ova, "the OVA")
    except (tarfile.TarError, UnicodeDecodeError, OSError) as exc:
        raise PermanentError(f"cannot read the OVF descriptor of {ova}: {exc}") from None


def _first_member(stream: IO[bytes], what: str) -> str:
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # a stream: never seeks
        member = tar.next()
        if member is None or not member.isfile() or not member.name.endswith(".ovf"):
            found = member.name if member is not None else "nothing"
            raise PermanentError(f"{what} does not start with its .ovf descriptor ({found})")
        handle = tar.extractfile(member)
        assert handle is not None  # a regular file
        return handle.read().decode("utf-8")


async def _run(*args: str) -> bytes:
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await process.communicate()
    except BaseException:  # cancelled: the conversion stops with us
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    if process.returncode != 0:
        text = err.decode(errors="replace").strip()[-500:]
        raise PermanentError(f"{args[0]} {args[1]} failed ({process.returncode}): {text}")
    return out


async def virtual_size(image: Path) -> int:
    """The size in bytes the guest sees of a disk image (`qemu-img info`)."""
    out = await _run("qemu-img", "info", "--output=json", str(image))
    return int(json.loads(out)["virtual-size"])


async def to_stream_vmdk(image: Path, vmdk: Path) -> None:
    """Convert a disk image (qcow2) into a stream-optimized VMDK, the format an OVF
    import takes over HTTP."""
    await _run(
        "qemu-img",
        "convert",
        "-O",
        "vmdk",
        "-o",
        "subformat=streamOptimized",
        str(image),
        str(vmdk),
    )
