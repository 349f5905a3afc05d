"""A subnet's segment on vSphere (issue 29), against vcsim in vCenter mode: a standard
network is backed by name, a distributed portgroup by its switch's UUID and its key
(vcsim's `DC0_DVS` with `DC0_DVPG0` and an uplink portgroup); an uplink portgroup and a
network the clone's cluster has no host on are refused before anything is built, and
`deploybot check` says so per subnet."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

from typing import Any

import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec, PermanentError, Segment
from backends.vsphere import VSphereBackend
from bot.operations.check import check_backend
from tests.support.vsphere.simulator import (
    TEMPLATE,
    Simulated,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

Card = vim.vm.device.VirtualEthernetCard


async def clone_on(backend: VSphereBackend, job: str, segment: Segment) -> str:
    spec = CloneSpec(job, f"web-{job}", TEMPLATE, segment=segment)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    return ref.vm_id


def nic_of(vcenter: Simulated, vm_id: str) -> Any:
    vm = vcenter.sim.vm(vm_id)
    assert vm is not None
    (nic,) = [d for d in vm.config.hardware.device if isinstance(d, Card)]
    return nic


def only_on_one_host(vcenter: Simulated, name: str) -> None:
    """A distributed portgroup on a new switch whose only member is the stand-alone host
    DC0_H0: no host of the cluster DC0_C0 is on it. (vcsim fills a portgroup's `host`
    when a host joins its switch by a reconfigure, not at the switch's creation, and
    leaves standard networks' `host` empty: those are never refused for it.)"""
    content, dc = vcenter.sim.content, vcenter.sim.datacenter
    view = content.viewManager.CreateContainerView
    h0 = next(
        h for h in view(content.rootFolder, [vim.HostSystem], True).view if h.name == "DC0_H0"
    )
    spec = vim.DistributedVirtualSwitch.CreateSpec(
        configSpec=vim.DistributedVirtualSwitch.ConfigSpec(name="DVS-H0")
    )
    WaitForTask(dc.networkFolder.CreateDVS_Task(spec))
    switches = view(content.rootFolder, [vim.DistributedVirtualSwitch], True).view
    dvs = next(d for d in switches if d.name == "DVS-H0")
    portgroup = vim.dvs.DistributedVirtualPortgroup.ConfigSpec(name=name, type="earlyBinding")
    WaitForTask(dvs.AddDVPortgroup_Task([portgroup]))
    member = vim.dvs.HostMember.ConfigSpec(operation="add", host=h0)
    version = dvs.config.configVersion
    change = vim.DistributedVirtualSwitch.ConfigSpec(configVersion=version, host=[member])
    WaitForTask(dvs.ReconfigureDvs_Task(change))


async def test_each_subnets_portgroup_backs_the_nic_as_its_kind_needs(vcenter: Simulated) -> None:
    """The backend's own `network` is DC0_DVPG0: each segment wins over it."""
    backend = vcenter.sim.backend()
    try:
        standard = nic_of(vcenter, await clone_on(backend, "jseg001", Segment("VM Network")))
        distributed = nic_of(vcenter, await clone_on(backend, "jseg002", Segment("DC0_DVPG0")))
    finally:
        await backend.close()
    assert isinstance(standard.backing, Card.NetworkBackingInfo)
    assert standard.backing.deviceName == "VM Network"
    pg = next(n for n in vcenter.sim.datacenter.network if n.name == "DC0_DVPG0")
    assert isinstance(distributed.backing, Card.DistributedVirtualPortBackingInfo)
    assert distributed.backing.port.portgroupKey == pg.key
    assert distributed.backing.port.switchUuid == pg.config.distributedVirtualSwitch.uuid
    assert pg.config.distributedVirtualSwitch.name == "DVS0"  # vcsim's, uplinks DVS0-DVUplinks-N


async def test_an_uplink_or_a_network_the_cluster_lacks_is_refused_and_checked(
    vcenter: Simulated,
) -> None:
    uplink = next(n for n in vcenter.sim.network_names() if "-DVUplinks-" in n)
    only_on_one_host(vcenter, "pg-h0-only")
    assert "pg-h0-only" in vcenter.sim.network_names(), "vcsim no longer adds the network"
    before = vcenter.sim.vms()
    backend = vcenter.sim.backend()  # its compute: the first cluster, DC0_C0
    try:
        with pytest.raises(PermanentError, match=f"'{uplink}' on vcenter is an uplink portgroup"):
            await clone_on(backend, "jseg003", Segment(uplink))
        with pytest.raises(PermanentError) as lacking:
            await clone_on(backend, "jseg004", Segment("pg-h0-only"))
        results = await check_backend(
            "vcenter",
            backend,
            TEMPLATE,
            [("10.0.20.0/24", Segment("DC0_DVPG0")), ("10.0.30.0/24", Segment(uplink))],
        )
    finally:
        await backend.close()
    assert vcenter.sim.vms() == before  # nothing was built
    assert lacking.value.message.startswith(
        "distributed portgroup pg-h0-only on vcenter is not on any host of DC0_C0: add "
        "DC0_C0's hosts"
    )
    found = {r.name: r for r in results}
    assert found["vcenter: subnet 10.0.20.0/24 on DC0_DVPG0"].ok
    bad = found[f"vcenter: subnet 10.0.30.0/24 on {uplink}"]
    assert not bad.ok and "is an uplink portgroup" in bad.detail


async def test_a_standalone_esxi_puts_the_nic_on_the_subnets_network(esxi: Simulated) -> None:
    """ESXi builds the VM itself (no CloneVM_Task): the segment reaches its NIC too, and a
    network the host does not have is refused before anything is built."""
    backend = esxi.sim.backend()
    before = esxi.sim.vms()
    try:
        nic = nic_of(esxi, await clone_on(backend, "jseg005", Segment("VM Network")))
        with pytest.raises(PermanentError, match="no network 'dvpg-20' on esxi"):
            await clone_on(backend, "jseg006", Segment("dvpg-20"))
    finally:
        await backend.close()
    assert isinstance(nic.backing, Card.NetworkBackingInfo)
    assert nic.backing.deviceName == "VM Network"
    assert len(esxi.sim.vms()) == len(before) + 1
