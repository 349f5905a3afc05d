# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)
"""VSphereBackend.addresses_in_use against vcsim: after the session's VM tracker read
every VM once, one small request whatever the number of VMs, which still sees an
address a VM took since the last look, and one it gave up; templates left out; what of
VMware Tools' `guest.net` counts. (The contract tests cover a VM built by hand and our
own VM, on vCenter and on a standalone host; tests/test_vsphere_scale.py the cost of
whole deploys, the check among them.)"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.vsphere.addresses import _uses
from tests.support.vsphere.simulator import (
    Simulated,
    TlsFiles,
    esxi_fixture,  # noqa: F401
    simulator,
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

EXTRA = 200  # VMs more than vcsim's default inventory (2 per resource pool)


async def sweep_calls(binary: Path, tls: TlsFiles, tmp: Path, esx: bool, extra: int) -> Any:
    """SOAP calls and bytes of one addresses_in_use after a first one (the tracker's
    full read), and how many VMs it listed."""
    pools = 1 if esx else 2  # vcsim makes its VMs per resource pool
    with simulator(binary, tls, tmp, esx=esx, vms_per_pool=2 + extra // pools) as lab:
        for i, vm in enumerate(lab.sim.datacenter.vmFolder.childEntity):
            if not vm.config.template:
                lab.sim.set_guest_address(vm, f"10.1.{i // 250}.{i % 250 + 1}")
        backend = lab.sim.backend()
        try:
            await backend.addresses_in_use()
            calls, sent = backend.api_calls(), backend.api_bytes()
            uses = await backend.addresses_in_use()
            return backend.api_calls() - calls, backend.api_bytes() - sent, len(uses)
        finally:
            await backend.close()


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_one_small_request_whatever_the_number_of_vms(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path, mode: str
) -> None:
    esx = mode == "esxi"
    small, small_bytes, small_listed = await sweep_calls(vcsim_binary, vcsim_tls, tmp_path, esx, 0)
    large, large_bytes, large_listed = await sweep_calls(
        vcsim_binary, vcsim_tls, tmp_path, esx, EXTRA
    )
    assert large_listed >= small_listed + EXTRA  # every VM's address
    # One look of the tracker, which found nothing changed: the same bytes either way.
    assert small == large == Counter(WaitForUpdatesEx=1)
    assert large_bytes == small_bytes, (small_bytes, large_bytes)


async def test_an_address_taken_since_the_last_look_is_seen(vcenter: Simulated) -> None:
    """The tracker answers only what changed, so a VM that took an address after its
    first read, or gave one up, shows at the next check."""
    sim = vcenter.sim
    backend = sim.backend()
    try:
        assert await backend.addresses_in_use() == []  # the tracker's first, full read
        vm_id = await asyncio.to_thread(sim.build_by_hand, "legacy01", "10.0.0.81")
        before = backend.api_calls()
        assert [(str(u.address), u.vm_id, u.vm_name) for u in await backend.addresses_in_use()] == [
            ("10.0.0.81", vm_id, "legacy01")
        ]
        assert backend.api_calls() - before == Counter(WaitForUpdatesEx=1)
        await asyncio.to_thread(sim.set_guest_address, sim.vm(vm_id), "10.0.0.82")
        assert [str(u.address) for u in await backend.addresses_in_use()] == ["10.0.0.82"]
    finally:
        await backend.close()


async def test_templates_are_left_out(vcenter: Simulated) -> None:
    sim = vcenter.sim
    vm_id = await asyncio.to_thread(sim.build_by_hand, "golden01", "10.0.0.81")
    backend = sim.backend()
    try:
        assert [u.vm_id for u in await backend.addresses_in_use()] == [vm_id]
    finally:
        await backend.close()
    vm = sim.vm(vm_id)
    await asyncio.to_thread(lambda: (WaitForTask(vm.PowerOffVM_Task()), vm.MarkAsTemplate()))
    # A new session: vcsim's MarkAsTemplate announces no change to the tracker of one
    # that is open (vCenter does; tests/test_vsphere_scale.py makes a template by a clone).
    backend = sim.backend()
    try:
        assert await backend.addresses_in_use() == []
    finally:
        await backend.close()


def nic(device: int, *addresses: str) -> Any:
    configured = [vim.net.IpConfigInfo.IpAddress(ipAddress=a, prefixLength=24) for a in addresses]
    return vim.vm.GuestInfo.NicInfo(
        deviceConfigId=device,
        ipAddress=list(addresses),
        ipConfig=vim.net.IpConfigInfo(ipAddress=configured),
    )


def test_what_of_guest_net_counts() -> None:
    props = {
        "name": "web01",
        "config.instanceUuid": "5003a1b2-0000-0000-0000-000000000001",
        "guest.ipAddress": "10.0.0.5",
        "guest.net": [
            nic(4000, "10.0.0.5", "fe80::250:56ff:fe00:1", "169.254.3.4"),
            nic(4001, "192.168.7.9"),
            nic(-1, "172.17.0.1"),  # docker0 inside the guest: no virtual NIC
        ],
    }
    uses = _uses(vim.VirtualMachine("vm-42"), props)
    assert [(str(u.address), u.vm_id, u.vm_name, u.source) for u in uses] == [
        ("10.0.0.5", "5003a1b2-0000-0000-0000-000000000001", "web01", "guest.net"),
        ("192.168.7.9", "5003a1b2-0000-0000-0000-000000000001", "web01", "guest.net"),
    ]
    # Without guest.net (older Tools), the primary address alone; without a config
    # (an inaccessible VM), its managed object id names it.
    only = _uses(vim.VirtualMachine("vm-43"), {"name": "old01", "guest.ipAddress": "10.0.0.6"})
    assert [(str(u.address), u.vm_id, u.source) for u in only] == [
        ("10.0.0.6", "vm-43", "guest.ipAddress")
    ]
