"""A VM created on a standalone ESXi host keeps its template's settings, as a vCenter
clone of the same template does: one template configured the same way in two vcsims,
deployed through the vCenter backend (clone) and through the ESXi path (create)."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

from typing import Any

from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec
from backends.vsphere.inherit import inherited_extra
from tests.support.contract import IDENTITY
from tests.support.vsphere.simulator import (
    TEMPLATE,
    TOOLS_VERSION,
    Simulated,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

Change = vim.vm.device.VirtualDeviceSpec
# The template's settings that differ from vcsim's defaults (bios, vmx-13, otherGuest,
# e1000, pvscsi), so that a VM which does not copy one shows it.
EXTRA = {"disk.EnableUUID": "TRUE", "mks.enable3d": "TRUE"}
# The template's own keys, which a new VM must not inherit (inherit.NOT_INHERITED).
OWN = {
    "uuid.bios": "42 0d 11 22 33 44 55 66-77 88 99 aa bb cc dd ee",
    "ethernet0.generatedAddress": "00:50:56:01:02:03",
    "guestinfo.metadata": "the template's own, stale",
}
# What vcsim (govmomi 0.24.2) cannot express: its CloneVM_Task builds the clone from a
# fresh ConfigSpec with the name, guest OS, CPU, memory and devices only, so the clone
# lacks the template's extraConfig, firmware, boot options and version, which a real
# vCenter clone (a copy of the .vmx) keeps. For these the created VM is compared with
# the template itself; every other setting with the clone.
VCSIM_CLONE_DROPS = {
    "extraConfig disk.EnableUUID",
    "extraConfig mks.enable3d",
    "firmware",
    "secure boot",
    "hardware version",
}


def configure_template(lab: Simulated) -> None:
    """Give the template the settings above: extraConfig, EFI with secure boot, version,
    guest OS, a vmxnet3 NIC (and the Tools it needs) and its disk on an LSI Logic SAS controller."""
    template = next(v for v in lab.sim.datacenter.vmFolder.childEntity if v.name == TEMPLATE)
    devices = template.config.hardware.device
    nic = next(d for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard))
    disk = next(d for d in devices if isinstance(d, vim.vm.device.VirtualDisk))
    on_controller = [d for d in devices if getattr(d, "controllerKey", None) == disk.controllerKey]
    controller = next(d for d in devices if d.key == disk.controllerKey)
    sas = vim.vm.device.VirtualLsiLogicSASController(key=-1, busNumber=0, sharedBus="noSharing")
    moved = vim.vm.device.VirtualDisk(
        key=-2,
        controllerKey=-1,
        unitNumber=0,
        capacityInKB=disk.capacityInKB,
        backing=disk.backing,  # the same file: no file operation
    )
    vmxnet3 = vim.vm.device.VirtualVmxnet3(key=-3, backing=nic.backing, addressType="generated")
    remove = [Change(operation="remove", device=d) for d in [nic, *on_controller, controller]]
    add = [Change(operation="add", device=d) for d in (sas, moved, vmxnet3)]
    spec = vim.vm.ConfigSpec(
        firmware="efi",
        bootOptions=vim.vm.BootOptions(efiSecureBootEnabled=True),
        version="vmx-19",
        guestId="ubuntu64Guest",
        extraConfig=[vim.option.OptionValue(key=k, value=v) for k, v in {**EXTRA, **OWN}.items()],
        deviceChange=remove + add,
        # A vmxnet3 template has VMware Tools (else deploybot refuses it): a version
        # vSphere saw, as a template that ran open-vm-tools keeps while off.
        tools=vim.vm.ToolsConfigInfo(toolsVersion=TOOLS_VERSION),
    )
    # A template takes only a new name or annotation: back to a VM for the change.
    host = template.runtime.host
    template.MarkAsVirtualMachine(pool=host.parent.resourcePool, host=host)
    WaitForTask(template.ReconfigVM_Task(spec))
    template.MarkAsTemplate()


def extra(vm: Any, key: str) -> str | None:
    values = [o.value for o in vm.config.extraConfig if o.key == key]
    return str(values[-1]) if values else None  # vcsim appends: the last one counts


def settings(vm: Any) -> dict[str, Any]:
    """The compared settings of a VM, as its properties say."""
    devices = vm.config.hardware.device
    nic = next(d for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard))
    disk = next(d for d in devices if isinstance(d, vim.vm.device.VirtualDisk))
    controller = next(d for d in devices if d.key == disk.controllerKey)
    return {
        **{f"extraConfig {key}": extra(vm, key) for key in EXTRA},
        "firmware": vm.config.firmware,
        "secure boot": bool(vm.config.bootOptions and vm.config.bootOptions.efiSecureBootEnabled),
        "hardware version": vm.config.version,
        "guest OS": vm.config.guestId,
        "NIC model": type(nic).__name__,
        "disk controller model": type(controller).__name__,
    }


async def deployed(lab: Simulated, name: str, job: str) -> Any:
    backend = lab.sim.backend()
    try:
        spec = CloneSpec(job, name, TEMPLATE, identity=IDENTITY)
        ref = await backend.prepare_clone(spec)
        await backend.clone(spec, ref)
    finally:
        await backend.close()
    return lab.sim.vm(ref.vm_id)


async def test_the_created_vm_has_the_settings_of_a_clone(
    vcenter: Simulated, esxi: Simulated
) -> None:
    for lab in (vcenter, esxi):
        configure_template(lab)
    template = next(v for v in esxi.sim.datacenter.vmFolder.childEntity if v.name == TEMPLATE)
    wanted = settings(template)
    assert wanted == {
        "extraConfig disk.EnableUUID": "TRUE",
        "extraConfig mks.enable3d": "TRUE",
        "firmware": "efi",
        "secure boot": True,
        "hardware version": "vmx-19",
        "guest OS": "ubuntu64Guest",
        "NIC model": "vim.vm.device.VirtualVmxnet3",
        "disk controller model": "vim.vm.device.VirtualLsiLogicSASController",
    }
    clone = settings(await deployed(vcenter, "web01", "jset001"))
    created_vm = await deployed(esxi, "web02", "jset002")
    created = settings(created_vm)
    reference = {s: wanted[s] if s in VCSIM_CLONE_DROPS else clone[s] for s in wanted}
    # Every setting that differs, as (created, reference): all of them show at once.
    differing = {s: (created[s], reference[s]) for s in wanted if created[s] != reference[s]}
    assert differing == {}
    # Nothing of the template's own identity came along; the guestinfo is the deploy's.
    assert extra(created_vm, "uuid.bios") is None
    assert extra(created_vm, "ethernet0.generatedAddress") is None
    assert extra(created_vm, "guestinfo.metadata") != OWN["guestinfo.metadata"]


def test_the_templates_own_keys_are_not_inherited() -> None:
    """The filter alone, on keys a real ESXi template shows (vmx keys ignore case)."""
    kept = {
        "disk.EnableUUID": "TRUE",
        "ethernet0.pciSlotNumber": "192",  # the guest's interface name (ens192) follows it
        "svga.present": "TRUE",
        "sched.cpu.latencySensitivity": "normal",
        "tools.guest.desktop.autolock": "FALSE",
    }
    dropped = {
        "guestinfo.userdata": "x",
        "GuestInfo.metadata": "x",
        "uuid.bios": "42 0d",
        "uuid.location": "56 4d",
        "vc.uuid": "50 1c",
        "ethernet0.generatedAddress": "00:50:56:01:02:03",
        "ethernet1.addressType": "generated",
        "ethernet0.generatedAddressOffset": "0",
        "nvram": "ubuntu.nvram",
        "sched.swap.derivedName": "/vmfs/volumes/x/ubuntu/ubuntu-1.vswp",
        "migrate.hostLog": "ubuntu-1.hlog",
        "cpuid.coresPerSocket": "2",
        "numa.autosize.vcpu.maxPerVirtualNode": "2",
        "toolsInstallManager.updateCounter": "3",
    }
    options = [vim.option.OptionValue(key=k, value=v) for k, v in {**kept, **dropped}.items()]
    inherited = inherited_extra(vim.vm.ConfigInfo(extraConfig=options))
    assert {o.key: o.value for o in inherited} == kept
