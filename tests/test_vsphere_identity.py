"""The guest's identity on vSphere, against vcsim in vCenter and ESXi mode: CPU, memory
and the cloud-init documents in guestinfo, carried by the clone or create spec where the
server allows it; the metadata names the NIC's MAC, which a created VM gets in its spec
and a clone gets from vCenter (read back after the clone)."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec, PermanentError, VMRef
from backends.vsphere import VSphereBackend
from backends.vsphere.guestinfo import extra_config, userdata_config
from backends.vsphere.inventory import Plan
from backends.vsphere.specs import Disks, GuestConfig, clone_spec, create_spec, static_mac
from tests.support.contract import IDENTITY
from tests.support.vsphere.pipeline import cloned
from tests.support.vsphere.simulator import (
    TEMPLATE,
    Simulated,
    decode,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)


@pytest.fixture(name="backend")
async def backend_fixture(vcenter: Simulated) -> AsyncIterator[VSphereBackend]:
    vsphere = vcenter.sim.backend()
    yield vsphere
    await vsphere.close()


def first_mac(vm: Any) -> str:
    card = vim.vm.device.VirtualEthernetCard
    return str(next(d for d in vm.config.hardware.device if isinstance(d, card)).macAddress)


GUESTINFO_KEYS = [
    "guestinfo.metadata",
    "guestinfo.metadata.encoding",
    "guestinfo.userdata",
    "guestinfo.userdata.encoding",
]


async def test_identity_goes_into_guestinfo_cpu_and_memory(
    vcenter: Simulated, backend: VSphereBackend
) -> None:
    """A clone made without the identity gets it from apply_identity, in one task."""
    first, second = await cloned(backend, "web01"), await cloned(backend, "web02", "jvs0004")
    before = backend.api_calls()
    await backend.apply_identity(first, IDENTITY)
    await backend.apply_identity(second, IDENTITY)
    assert (backend.api_calls() - before)["ReconfigVM_Task"] == 2
    # Applied again (a retried step), it is found in place: no second task.
    before = backend.api_calls()
    await backend.apply_identity(first, IDENTITY)
    assert (backend.api_calls() - before)["ReconfigVM_Task"] == 0
    vm = vcenter.sim.vm(first.vm_id)
    assert (vm.config.hardware.numCPU, vm.config.hardware.memoryMB) == (2, 2048)
    extra = vcenter.sim.extra(vm)
    metadata = decode(extra["guestinfo.metadata"])
    assert metadata["local-hostname"] == "contract01.lab.example"
    (nic,) = metadata["network"]["config"]
    assert nic["subnets"][0]["address"] == "10.0.0.77/24"
    assert nic["mac_address"] == first_mac(vm)  # read from the VM
    assert decode(extra["guestinfo.userdata"])["users"][0]["name"] == "ubuntu"
    # Every deploy is a new instance for cloud-init, even with the same identity.
    other = decode(vcenter.sim.extra(vcenter.sim.vm(second.vm_id))["guestinfo.metadata"])
    assert metadata["instance-id"] == first.vm_id != other["instance-id"] == second.vm_id


def reconfigured(sim: Simulated, since: Counter[str]) -> int:
    """ReconfigVM_Tasks the server ran since `since` (a Counter of its task history)."""
    return (Counter(sim.sim.task_history()) - since)["VirtualMachine.reconfigVm"]


def test_the_clone_and_create_specs_carry_the_identity() -> None:
    """What is sent, whatever a server keeps of it: CPU, memory, one core per socket when
    the cores do not fill the template's sockets, and the guestinfo keys: all four in a
    created VM's spec, whose NIC gets the MAC the metadata names; the user-data only in
    a clone's, whose MAC vCenter assigns (the metadata follows after the clone)."""
    template_nic = vim.vm.device.VirtualVmxnet3(key=4000, macAddress="00:0c:29:aa:bb:cc")
    hardware = vim.vm.VirtualHardware(
        numCPU=4, numCoresPerSocket=2, memoryMB=32, device=[template_nic]
    )
    template = vim.vm.ConfigInfo(hardware=hardware, guestId="ubuntu64Guest", version="vmx-19")
    plan = Plan(None, None, None, "DC0_C0", None, template, None, "LocalDS_0", None)
    ref, provisioning = VMRef("5029c9f2-0000-4000-8000-000000000001", "jvs0013"), Disks(True, False)
    spec = CloneSpec("jvs0013", "web01", TEMPLATE)
    mac = static_mac(ref.vm_id)
    for cores, per_socket in [(3, 1), (6, None)]:
        identity = dataclasses.replace(IDENTITY, cores=cores)
        guest = GuestConfig.of(ref.vm_id, identity)
        cloning = clone_spec(plan, ref, "note", provisioning, guest).config
        creating = create_spec(
            spec, ref, plan, "note", "[ds] x/x.vmx", {}, provisioning, guest, mac
        )
        for config in (cloning, creating):
            assert (config.numCPUs, config.memoryMB) == (cores, 2048)
        assert {o.key: o.value for o in cloning.extraConfig} == userdata_config(identity)
        assert {o.key: o.value for o in creating.extraConfig} == extra_config(
            ref.vm_id, identity, mac
        )
        (added,) = [c.device for c in creating.deviceChange if c.device.key == -300]
        assert isinstance(added, vim.vm.device.VirtualVmxnet3)  # the template's model
        assert (added.addressType, added.macAddress) == ("manual", mac)
        assert cloning.numCoresPerSocket == per_socket  # None: the clone keeps the template's
        assert creating.numCoresPerSocket == (per_socket or 2)
    # Without an identity: the template's hardware, no guestinfo.
    cloning = clone_spec(plan, ref, "note", provisioning).config
    creating = create_spec(spec, ref, plan, "note", "[ds] x/x.vmx", {}, provisioning)
    assert (cloning.numCPUs, cloning.memoryMB, list(cloning.extraConfig)) == (None, None, [])
    assert (creating.numCPUs, creating.numCoresPerSocket, creating.memoryMB) == (4, 2, 32)
    assert list(creating.extraConfig) == []


def test_a_static_mac_is_in_vmwares_range_stable_and_avoids_those_taken() -> None:
    """ESXi refuses a MAC set by hand outside 00:50:56:00:00:00-00:50:56:3f:ff:ff."""
    vm_id = "5029c9f2-0000-4000-8000-000000000002"
    mac = static_mac(vm_id)
    assert mac == static_mac(vm_id) and mac.startswith("00:50:56:")
    assert int(mac.split(":")[3], 16) <= 0x3F
    other = static_mac(vm_id, frozenset({mac}))
    assert other != mac and other.startswith("00:50:56:") and int(other.split(":")[3], 16) <= 0x3F


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_a_clone_that_carries_the_identity_leaves_apply_identity_one_read(
    mode: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """CPU, memory and guestinfo travel in CloneVM_Task's (vCenter) or CreateVM_Task's
    (ESXi) spec; apply_identity then reads the VM once and finds nothing to change."""
    lab: Simulated = request.getfixturevalue(mode)
    backend = lab.sim.backend()
    caplog.set_level(logging.INFO, logger="backends.vsphere")
    try:
        ref = await cloned(backend, "web01", "jvs0010", IDENTITY)
        # vcsim keeps the guestinfo of a clone but drops its annotation, CPU and memory,
        # which the clone's own check then sets; it keeps all of a created VM's spec.
        # After a clone, the metadata joins: it names the MAC vCenter gave the clone.
        messages = [r.getMessage() for r in caplog.records]
        settled = [m.rsplit(": ", 1)[1] for m in messages if "completing the new VM" in m]
        after_clone = "job tag, numCPUs, memoryMB, guestinfo.metadata, guestinfo.metadata.encoding"
        assert settled == ([] if lab.sim.esx else [after_clone])
        vm = lab.sim.vm(ref.vm_id)
        assert (vm.config.hardware.numCPU, vm.config.hardware.memoryMB) == (2, 2048)
        extra = lab.sim.extra(vm)
        metadata = decode(extra["guestinfo.metadata"])
        assert metadata["instance-id"] == ref.vm_id
        assert metadata["local-hostname"] == "contract01.lab.example"
        (nic,) = metadata["network"]["config"]
        assert nic["subnets"][0]["address"] == "10.0.0.77/24"
        assert nic["mac_address"] == first_mac(vm)
        assert decode(extra["guestinfo.userdata"])["users"][0]["name"] == "ubuntu"
        assert extra["guestinfo.metadata.encoding"] == "gzip+base64"
        # Each key once: the clone/create spec or the clone's completion wrote them,
        # nothing after it did again (vcsim appends extraConfig where vSphere replaces).
        keys = [o.key for o in vm.config.extraConfig if o.key.startswith("guestinfo.")]
        assert sorted(keys) == GUESTINFO_KEYS

        before, history = backend.api_calls(), Counter(lab.sim.task_history())
        await backend.apply_identity(ref, IDENTITY)
        # The clone's VM is remembered by its instance UUID: no FindByUuid either.
        assert backend.api_calls() - before == Counter(RetrievePropertiesEx=1)
        assert reconfigured(lab, history) == 0

        # An identity that differs in any part is still applied, in one task.
        other = dataclasses.replace(IDENTITY, hostname="web01b", memory_mib=1024)
        before, history = backend.api_calls(), Counter(lab.sim.task_history())
        await backend.apply_identity(ref, other)
        assert (backend.api_calls() - before)["ReconfigVM_Task"] == 1
        assert reconfigured(lab, history) == 1
        vm = lab.sim.vm(ref.vm_id)
        assert (vm.config.hardware.numCPU, vm.config.hardware.memoryMB) == (2, 1024)
        metadata = decode(lab.sim.extra(vm)["guestinfo.metadata"])
        assert metadata["local-hostname"] == "web01b.lab.example"
    finally:
        await backend.close()


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_cores_that_do_not_fill_the_templates_sockets_get_one_per_socket(
    mode: str, request: pytest.FixtureRequest
) -> None:
    lab: Simulated = request.getfixturevalue(mode)
    second = "ha-host_VM1" if lab.sim.esx else "DC0_H0_VM1"
    vm = next(v for v in lab.sim.datacenter.vmFolder.childEntity if v.name == second)
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(numCPUs=4, numCoresPerSocket=2)))
    lab.sim.make_template(second, "wide", "deploybot template: two cores a socket")
    backend = lab.sim.backend()
    try:
        for job, cores, per_socket in [("jvs0011", 3, 1), ("jvs0012", 6, 2)]:
            identity = dataclasses.replace(IDENTITY, cores=cores)
            ref = await cloned(backend, f"w{cores}", job, identity, template="wide")
            history = Counter(lab.sim.task_history())
            await backend.apply_identity(ref, identity)
            assert reconfigured(lab, history) == 0
            hardware = lab.sim.vm(ref.vm_id).config.hardware
            assert (hardware.numCPU, hardware.numCoresPerSocket) == (cores, per_socket)
    finally:
        await backend.close()


# --- the NIC the metadata names ----------------------------------------------------------


def _strip_nics(lab: Simulated, vm_name: str) -> None:
    """Take every NIC off one of vcsim's VMs (to make a template without one)."""
    vm = next(v for v in lab.sim.datacenter.vmFolder.childEntity if v.name == vm_name)
    card, remove = vim.vm.device.VirtualEthernetCard, vim.vm.device.VirtualDeviceSpec.Operation
    changes = [
        vim.vm.device.VirtualDeviceSpec(operation=remove.remove, device=d)
        for d in vm.config.hardware.device
        if isinstance(d, card)
    ]
    WaitForTask(vm.ReconfigVM_Task(vim.vm.ConfigSpec(deviceChange=changes)))


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_a_vm_without_a_nic_is_refused_with_the_reason(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """A template without a NIC and no `network` configured make a VM that cloud-init
    could give no address: the clone says so instead of waiting for an address."""
    lab: Simulated = request.getfixturevalue(mode)
    second = "ha-host_VM1" if lab.sim.esx else "DC0_H0_VM1"
    _strip_nics(lab, second)
    lab.sim.make_template(second, "bare", "deploybot template: no NIC")
    backend = lab.sim.backend(network=None)
    try:
        with pytest.raises(PermanentError, match="no network adapter"):
            await cloned(backend, "web09", "jvs0020", IDENTITY, template="bare")
    finally:
        await backend.close()


async def test_the_esxi_mac_is_not_one_the_host_already_has(esxi: Simulated) -> None:
    """The MAC derived from the new VM's id is taken by another VM on the host: the
    create path picks the next candidate."""
    backend = esxi.sim.backend()
    try:
        spec = CloneSpec("jvs0021", "web10", TEMPLATE, identity=IDENTITY)
        ref = await backend.prepare_clone(spec)
        taken = static_mac(ref.vm_id)
        other = next(v for v in esxi.sim.datacenter.vmFolder.childEntity if v.name == "ha-host_VM1")
        nic = next(
            d
            for d in other.config.hardware.device
            if isinstance(d, vim.vm.device.VirtualEthernetCard)
        )
        nic.addressType, nic.macAddress = "manual", taken
        edit = vim.vm.device.VirtualDeviceSpec(operation="edit", device=nic)
        WaitForTask(other.ReconfigVM_Task(vim.vm.ConfigSpec(deviceChange=[edit])))
        await backend.clone(spec, ref)
    finally:
        await backend.close()
    vm = esxi.sim.vm(ref.vm_id)
    mac = first_mac(vm)
    assert mac == static_mac(ref.vm_id, frozenset({taken})) != taken
    (configured,) = decode(esxi.sim.extra(vm)["guestinfo.metadata"])["network"]["config"]
    assert configured["mac_address"] == mac
