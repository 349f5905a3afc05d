"""Several NICs and MACs in the simulator (issue 29): each NIC's segment is checked
before anything exists, each NIC gets a MAC (the fixed one, else its own), the guest
reports every address, `macs_in_use` and `addresses_in_use` list them all, and the
state file keeps them (another process reads the same VM)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json

import pytest

from backends.abilities import KnowsMacs
from backends.base import CloneSpec, Identity, Nic, PermanentError, Segment
from backends.sim import SimBackend
from backends.sim.vm import vm_from_dict, vm_to_dict
from tests.support.contract import IDENTITY

SECOND = Nic(
    ipaddress.IPv4Interface("127.0.20.5/24"),
    ipaddress.IPv4Address("127.0.20.1"),
    Segment("vmbr1", 20),
    "bc:24:11:aa:bb:cc",
)
THIRD = Nic(ipaddress.IPv4Interface("127.0.30.7/24"))
TWO = dataclasses.replace(IDENTITY, mac="52:54:00:12:34:56", more_nics=(SECOND, THIRD))


async def deployed(sim: SimBackend, identity: Identity, job: str = "jsimnic1") -> str:
    spec = CloneSpec(
        job, f"web-{job}", "ubuntu-24.04", more_nics=identity.more_nics, mac=identity.mac
    )
    ref = await sim.prepare_clone(spec)
    await sim.clone(spec, ref)
    await sim.apply_identity(ref, identity)
    return ref.vm_id


async def test_every_nic_gets_a_mac_and_is_known() -> None:
    sim = SimBackend("sim", time_scale=0.001)
    vm_id = await deployed(sim, TWO)
    vm = sim.vms[vm_id]
    assert vm.macs[:2] == ("52:54:00:12:34:56", "bc:24:11:aa:bb:cc")
    assert len(set(vm.macs)) == 3 and vm.macs[2].startswith("bc:24:11:")
    assert isinstance(sim, KnowsMacs)
    assert await sim.macs_in_use() == {m: f"web-jsimnic1 ({vm_id})" for m in vm.macs}
    used = {u.address: u.source for u in await sim.addresses_in_use() if u.vm_id == vm_id}
    assert used == {
        IDENTITY.address.ip: "identity",
        SECOND.address.ip: "identity, NIC 2",
        THIRD.address.ip: "identity, NIC 3",
    }
    # Another deploy's MACs are its own.
    other = await deployed(sim, dataclasses.replace(TWO, mac=None), "jsimnic2")
    assert not set(sim.vms[other].macs) & {vm.macs[0], vm.macs[2]}


async def test_a_later_nics_segment_is_checked_before_anything_exists() -> None:
    sim = SimBackend("sim", time_scale=0.001)
    bad = dataclasses.replace(SECOND, segment=Segment("vmbr0", 20))  # not VLAN-aware
    with pytest.raises(PermanentError, match="bridge vmbr0 on node1 of sim is not VLAN-aware"):
        await deployed(sim, dataclasses.replace(TWO, more_nics=(bad,)))
    assert sim.vms == {}


async def test_the_state_file_keeps_the_nics_and_macs() -> None:
    sim = SimBackend("sim", time_scale=0.001)
    vm = sim.vms[await deployed(sim, dataclasses.replace(TWO, search_domains=("lab20.test",)))]
    again = vm_from_dict(json.loads(json.dumps(vm_to_dict(vm))))
    assert again.identity is not None and vm.identity is not None
    assert again.identity == vm.identity
    assert again.macs == vm.macs
