"""Several NICs and fixed MACs on vSphere (issue 29), against vcsim in vCenter and ESXi
mode: the NICs after the first are added in the clone (create) spec, each on its
subnet's network (a standard one by name, a distributed portgroup by switch UUID and
key), a fixed MAC is set by hand, and the guestinfo metadata lists every NIC by the MAC
it has, the gateway on the first only; `macs_in_use` reads them through the property
collector."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import pytest
from pyVmomi import vim

from backends.abilities import KnowsMacs
from backends.base import CloneSpec, Identity, Nic, PermanentError, Segment, VMRef
from backends.vsphere import VSphereBackend
from tests.support.contract import IDENTITY
from tests.support.vsphere.simulator import (
    TEMPLATE,
    Simulated,
    decode,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

Card = vim.vm.device.VirtualEthernetCard
SECOND = Nic(ipaddress.IPv4Interface("127.0.20.5/24"), segment=Segment("DC0_DVPG0"))
TWO = dataclasses.replace(
    IDENTITY, segment=Segment("VM Network"), more_nics=(SECOND,), search_domains=("lab20.test",)
)


async def deployed(backend: VSphereBackend, job: str, identity: Identity) -> VMRef:
    spec = CloneSpec(
        job,
        f"web-{job}",
        TEMPLATE,
        segment=identity.segment,
        identity=identity,
        more_nics=identity.more_nics,
        mac=identity.mac,
    )
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.apply_identity(ref, identity)
    return ref


def cards(sim: Simulated, vm_id: str) -> list[Any]:
    vm = sim.sim.vm(vm_id)
    assert vm is not None
    return [d for d in vm.config.hardware.device if isinstance(d, Card)]


def network_of(sim: Simulated, vm_id: str) -> list[dict[str, Any]]:
    vm = sim.sim.vm(vm_id)
    config: list[dict[str, Any]] = decode(sim.sim.extra(vm)["guestinfo.metadata"])["network"][
        "config"
    ]
    return config


async def test_two_nics_on_a_standard_network_and_a_distributed_portgroup(
    vcenter: Simulated,
) -> None:
    backend = vcenter.sim.backend()
    try:
        ref = await deployed(backend, "jnic101", TWO)
        before = backend.api_calls()
        await backend.apply_identity(ref, TWO)  # a retry finds it all in place
        assert (backend.api_calls() - before)["ReconfigVM_Task"] == 0
    finally:
        await backend.close()
    first, second = cards(vcenter, ref.vm_id)
    assert isinstance(first.backing, Card.NetworkBackingInfo)
    assert first.backing.deviceName == "VM Network"
    pg = next(n for n in vcenter.sim.datacenter.network if n.name == "DC0_DVPG0")
    assert isinstance(second.backing, Card.DistributedVirtualPortBackingInfo)
    assert second.backing.port.portgroupKey == pg.key
    assert second.backing.port.switchUuid == pg.config.distributedVirtualSwitch.uuid
    assert type(second) is type(first)  # the first NIC's class
    eth0, eth1 = network_of(vcenter, ref.vm_id)
    assert (eth0["name"], eth0["mac_address"]) == ("eth0", first.macAddress.lower())
    assert (eth1["name"], eth1["mac_address"]) == ("eth1", second.macAddress.lower())
    assert first.macAddress != second.macAddress
    assert eth0["subnets"][0]["gateway"] == str(IDENTITY.gateway)
    assert eth0["subnets"][0]["dns_search"] == [IDENTITY.search_domain, "lab20.test"]
    assert eth1["subnets"] == [{"type": "static", "address": "127.0.20.5/24"}]


async def test_fixed_macs_are_set_by_hand_and_known(vcenter: Simulated) -> None:
    fixed = dataclasses.replace(
        TWO,
        mac="00:50:56:01:02:03",
        more_nics=(dataclasses.replace(SECOND, mac="00:50:56:01:02:04"),),
    )
    backend = vcenter.sim.backend()
    try:
        ref = await deployed(backend, "jnic102", fixed)
        assert isinstance(backend, KnowsMacs)
        macs = await backend.macs_in_use()
    finally:
        await backend.close()
    first, second = cards(vcenter, ref.vm_id)
    assert (first.addressType, first.macAddress) == ("manual", "00:50:56:01:02:03")
    assert (second.addressType, second.macAddress) == ("manual", "00:50:56:01:02:04")
    assert [n["mac_address"] for n in network_of(vcenter, ref.vm_id)] == [
        "00:50:56:01:02:03",
        "00:50:56:01:02:04",
    ]
    assert macs["00:50:56:01:02:03"] == f"web-jnic102 ({ref.vm_id})"
    assert macs["00:50:56:01:02:04"] == f"web-jnic102 ({ref.vm_id})"


async def test_a_mac_outside_vmwares_manual_range_is_refused_before_cloning(
    vcenter: Simulated,
) -> None:
    before = vcenter.sim.vms()
    backend = vcenter.sim.backend()
    try:
        with pytest.raises(PermanentError, match="outside VMware's range for MACs set by hand"):
            await deployed(backend, "jnic103", dataclasses.replace(TWO, mac="52:54:00:12:34:56"))
    finally:
        await backend.close()
    assert vcenter.sim.vms() == before


async def test_an_uplink_for_the_second_nic_is_refused(vcenter: Simulated) -> None:
    uplink = next(n for n in vcenter.sim.network_names() if "-DVUplinks-" in n)
    bad = dataclasses.replace(SECOND, segment=Segment(uplink))
    backend = vcenter.sim.backend()
    try:
        with pytest.raises(PermanentError, match="is an uplink portgroup"):
            await deployed(backend, "jnic104", dataclasses.replace(TWO, more_nics=(bad,)))
    finally:
        await backend.close()


async def test_one_nic_costs_no_more_requests(vcenter: Simulated) -> None:
    """The one-NIC deploy's calls, as before several NICs: no extra reconfigure or read
    (both after a first deploy that read the inventory's shape, both networks included)."""
    backend = vcenter.sim.backend()
    try:
        await deployed(backend, "jnic108", TWO)
        before = backend.api_calls()
        await deployed(backend, "jnic105", dataclasses.replace(IDENTITY, segment=TWO.segment))
        one = backend.api_calls() - before
        before = backend.api_calls()
        await deployed(backend, "jnic106", TWO)
        two = backend.api_calls() - before
    finally:
        await backend.close()
    assert one == two  # a second NIC costs no request either: it rides in the clone spec
    assert one["ReconfigVM_Task"] == 1  # the metadata, once the MACs are known


async def test_a_standalone_esxi_gives_each_nic_a_static_mac(esxi: Simulated) -> None:
    two = dataclasses.replace(TWO, segment=Segment("VM Network"), more_nics=(
        dataclasses.replace(SECOND, segment=None),
    ))  # fmt: skip
    backend = esxi.sim.backend()
    try:
        ref = await deployed(backend, "jnic107", two)
    finally:
        await backend.close()
    first, second = cards(esxi, ref.vm_id)
    assert first.addressType == second.addressType == "manual"
    assert first.macAddress.startswith("00:50:56:") and second.macAddress.startswith("00:50:56:")
    assert first.macAddress != second.macAddress
    assert second.backing.deviceName == "VM Network"  # no segment: the first NIC's network
    assert [n["mac_address"] for n in network_of(esxi, ref.vm_id)] == [
        first.macAddress,
        second.macAddress,
    ]
