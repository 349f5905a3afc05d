"""Several NICs and fixed MACs on Proxmox (issue 29), against the fake API, which checks
every request against the real schema (`net[n]` and `ipconfig[n]` property strings
included): `net1` and `ipconfig1` are written exactly in the identity step's one config
change, a fixed MAC goes on `net0`, each NIC's segment is checked before anything is
cloned, and `macs_in_use` reads every VM's MACs reusing the address sweep's configs."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import pytest

from backends.abilities import KnowsMacs
from backends.base import CloneSpec, Identity, Nic, PermanentError, Segment
from tests.support.fakepve import testing
from tests.support.fakepve.realvm import more_lans
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend
from tests.support.proxmox import IDENTITY
from tests.support.realguest.qemu import MoreNic

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

CLONE = "/nodes/{node}/qemu/{vmid}/clone"
CONFIG = "/nodes/{node}/qemu/{vmid}/config"
SECOND = Nic(ipaddress.IPv4Interface("127.0.20.5/24"), segment=Segment("vmbr0", 20))


async def deployed(fake: FakePVE, identity: Identity, **backend: Any) -> dict[str, Any]:
    """Clone and give `identity` (its NICs' segments in the spec too); the VM's config."""
    proxmox = make_backend(fake, **backend)
    try:
        spec = CloneSpec(
            "jnic002",
            "web01",
            "ubuntu-24.04",
            segment=identity.segment,
            more_nics=identity.more_nics,
            mac=identity.mac,
        )
        ref = await proxmox.prepare_clone(spec)
        await proxmox.clone(spec, ref)
        await proxmox.apply_identity(ref, identity)
        await proxmox.apply_identity(ref, identity)  # a retry after a lost answer
    finally:
        await proxmox.close()
    config: dict[str, Any] = fake.cluster.vms[int(ref.vm_id)].config
    return config


def mac_of(line: str) -> str:
    return line.split(",")[0].split("=")[1]


async def test_two_nics_write_net1_and_ipconfig1_exactly(pve: FakePVE) -> None:
    pve.cluster.vms[9000].config["net0"] = "virtio=BC:24:11:00:00:AA,bridge=vmbr1"
    third = Nic(
        ipaddress.IPv4Interface("127.0.30.7/24"),
        gateway=ipaddress.IPv4Address("127.0.30.1"),
        segment=Segment("vmbr1", None, firewall=True),
        mac="52:54:00:12:34:57",
    )
    identity = dataclasses.replace(
        IDENTITY,
        segment=Segment("vmbr1"),
        more_nics=(SECOND, third),
        search_domains=("lab20.example",),
    )
    config = await deployed(pve, identity)
    assert config["ipconfig0"] == "ip=127.0.10.50/24,gw=127.0.10.1"
    assert config["ipconfig1"] == "ip=127.0.20.5/24"  # no gateway: no route through it
    assert config["ipconfig2"] == "ip=127.0.30.7/24,gw=127.0.30.1"
    mac1 = mac_of(config["net1"])
    assert config["net1"] == f"virtio={mac1},bridge=vmbr0,tag=20,firewall=0"
    assert mac1 not in (mac_of(config["net0"]), "BC:24:11:00:00:AA")  # Proxmox made one
    assert config["net2"] == "virtio=52:54:00:12:34:57,bridge=vmbr1,firewall=1"
    assert config["searchdomain"] == "lab.example lab20.example"
    first, retry = (r.params for r in pve.sent("POST", CONFIG))
    assert first["net1"] == "virtio,bridge=vmbr0,tag=20,firewall=0"  # no MAC: generated
    assert "net1" not in retry  # the retry keeps the generated MAC: nothing to change
    assert retry["ipconfig1"] == "ip=127.0.20.5/24"


async def test_one_nic_writes_no_more_fields_and_costs_no_more_requests(pve: FakePVE) -> None:
    config = await deployed(pve, IDENTITY)
    assert not any(k in config for k in ("net1", "ipconfig1"))
    sent = pve.sent("POST", CONFIG)[0].params
    assert not any(k.startswith(("net1", "ipconfig1")) for k in sent)


async def test_a_fixed_mac_goes_on_net0(pve: FakePVE) -> None:
    pve.cluster.vms[9000].config["net0"] = "virtio=BC:24:11:00:00:AA,bridge=vmbr0"
    identity = dataclasses.replace(IDENTITY, mac="52:54:00:12:34:56")
    config = await deployed(pve, identity)
    assert config["net0"] == "virtio=52:54:00:12:34:56,bridge=vmbr0"


async def test_the_second_nics_segment_is_checked_before_cloning(pve: FakePVE) -> None:
    """vmbr1 is not VLAN-aware in the fake: a tag there would reach nothing."""
    before = set(pve.cluster.vms)
    bad = dataclasses.replace(SECOND, segment=Segment("vmbr1", 20))
    with pytest.raises(PermanentError, match="bridge vmbr1 on node pve1 of pve is not VLAN"):
        await deployed(pve, dataclasses.replace(IDENTITY, more_nics=(bad,)))
    assert pve.sent("POST", CLONE) == [] and set(pve.cluster.vms) == before
    # The node's bridges were read once for both NICs' checks (and once afresh to refuse).
    assert len(pve.sent("GET", "/nodes/{node}/network")) == 2


async def test_macs_in_use_reuses_the_address_sweeps_configs(pve: FakePVE) -> None:
    pve.cluster.vms[9000].config["net0"] = "virtio=BC:24:11:00:00:AA,bridge=vmbr0"
    config = await deployed(pve, dataclasses.replace(IDENTITY, more_nics=(SECOND,)))
    proxmox = make_backend(pve)
    try:
        assert isinstance(proxmox, KnowsMacs)
        await proxmox.addresses_in_use()
        reads = len(pve.sent("GET", CONFIG))
        macs = await proxmox.macs_in_use()
        assert len(pve.sent("GET", CONFIG)) == reads  # every config reused: no request
    finally:
        await proxmox.close()
    vmid = next(v for v, vm in pve.cluster.vms.items() if vm.config is config)
    for key in ("net0", "net1"):
        assert macs[mac_of(config[key]).lower()] == f"web01 ({vmid})"
    assert "bc:24:11:00:00:aa" not in macs  # a template's NIC is on no wire


async def test_the_real_guest_lane_boots_each_later_nic_on_a_network_of_its_own(
    pve: FakePVE,
) -> None:
    """What `realvm` makes of the config this backend wrote (no guest boots here; the
    boot is tests/test_realguest_boot.py): net1 with its MAC on 127.0.20.0/24, QEMU
    there at an address that is not the guest's (it has no gateway there)."""
    config = await deployed(pve, dataclasses.replace(IDENTITY, more_nics=(SECOND,)))
    (nic,) = more_lans(config)
    assert nic == MoreNic(mac_of(config["net1"]), "127.0.20.0/24", "127.0.20.1")
