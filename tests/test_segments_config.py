"""`[subnets.segments.BACKEND]` (issue 29): each segment is checked against its backend's
kind when the file is read, with a message naming the subnet, the backend and the keys;
the request picks the segment through its subnet and is refused, naming both, when its
subnet has none on the chosen backend while others do."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from backends.base import Segment
from bot.addresses.subnets import segment_on
from bot.models.errors import ConfigError, RequestInvalid
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from tests.support.deployer import make_settings

PVE = {"kind": "proxmox", "name": "pve", "host": "pve.example"}
VC = {"kind": "vsphere", "name": "vc", "host": "vc.example", "user": "u"}
SIM = {"kind": "sim", "name": "sim"}


def subnet(cidr: str = "10.0.20.0/24", **segments: dict[str, Any]) -> dict[str, Any]:
    net = cidr.rsplit(".", 1)[0]
    return {"cidr": cidr, "gateway": f"{net}.1", "segments": segments}


def settings_with(tmp_path: Path, *subnets: dict[str, Any]) -> Any:
    return make_settings(
        tmp_path, backends=[SIM, PVE, VC], subnets=list(subnets), defaults={"backend": "sim"}
    )


def test_a_segment_per_backend_is_read_into_its_value(tmp_path: Path) -> None:
    settings = settings_with(
        tmp_path,
        subnet(
            pve={"bridge": "vmbr0", "vlan": 20}, vc={"network": "dvpg-20"}, sim={"bridge": "vmbr1"}
        ),
    )
    (only,) = settings.subnets
    assert only.segment("pve") == Segment("vmbr0", 20, firewall=False)
    assert only.segment("vc") == Segment("dvpg-20")
    assert str(only.segment("pve")) == "vmbr0 VLAN 20" and str(only.segment("vc")) == "dvpg-20"
    assert only.segment("elsewhere") is None


@pytest.mark.parametrize(
    ("segments", "said"),
    [
        (
            {"pve": {"network": "vmbr0"}},
            "subnet 10.0.20.0/24: [subnets.segments.pve]: pve is a proxmox backend, which "
            "takes bridge, firewall, vlan, not network",
        ),
        (
            {"vc": {"bridge": "vmbr0", "vlan": 20}},
            "[subnets.segments.vc]: vc is a vsphere backend, which takes network (a standard "
            "network or distributed portgroup by name; its VLAN comes with the portgroup), "
            "not bridge, vlan",
        ),
        (
            {"pve2": {"bridge": "vmbr0"}},
            "subnet 10.0.20.0/24: [subnets.segments.pve2] names no backend: use one of "
            "sim, pve, vc",
        ),
        ({"pve": {"bridge": "vmbr0", "vlan": 4095}}, "vlan: Input should be less than or equal "
         "to 4094"),
        ({"pve": {"bridge": "vmbr0", "vlan": 0}}, "vlan: Input should be greater than or equal "
         "to 1"),
        ({"pve": {"vlan": 20}}, "give either bridge (Proxmox, with an optional vlan) or network"),
        ({"sim": {"bridge": "vmbr0", "network": "x"}}, "give either bridge"),
        (
            {"vc": {"network": "dvpg", "firewall": True}},
            "vlan and firewall go with a Proxmox bridge; a vSphere portgroup carries its own VLAN",
        ),
        ({"pve": {"bridge": "vmbr0 x"}}, "bridge: String should match pattern"),
        ({"pve": {"bridge": "vmbr0", "mtu": 9000}}, "mtu: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_a_wrong_segment_stops_the_start_naming_subnet_backend_and_keys(
    tmp_path: Path, segments: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError) as stopped:
        settings_with(tmp_path, subnet(**segments))
    assert said in str(stopped.value)


def request(settings: Any, text: str, **changes: Any) -> Any:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return build_request(dataclasses.replace(args, **changes), settings, "alice")


def test_the_address_picks_the_subnet_and_a_subnet_without_a_segment_is_refused(
    tmp_path: Path,
) -> None:
    settings = settings_with(
        tmp_path,
        subnet("10.0.20.0/24", pve={"bridge": "vmbr0", "vlan": 20}),
        subnet("10.0.30.0/24"),
    )
    assert request(settings, "web01 10.0.20.5 on=pve").subnet == "10.0.20.0/24"
    with pytest.raises(RequestInvalid) as refused:
        request(settings, "web01 10.0.30.5 on=pve")
    assert refused.value.message.startswith(
        "10.0.30.0/24 has no segment on pve: ask an operator to add [subnets.segments.pve] "
        "to the subnet 10.0.30.0/24"
    )
    # No subnet has a segment on the simulator: its own network applies to both, as before.
    assert request(settings, "web01 10.0.30.5").backend == "sim"
    subnets = settings.subnets
    assert segment_on(subnets, subnets[1], "sim") is None
    assert segment_on(subnets, subnets[0], "pve") == Segment("vmbr0", 20)


def test_network_is_the_segments_or_refused_and_it_picks_the_subnet(tmp_path: Path) -> None:
    settings = settings_with(
        tmp_path,
        subnet("10.0.20.0/24", pve={"bridge": "vmbr0", "vlan": 20}),
        subnet("10.0.30.0/24", pve={"bridge": "vmbr1"}),
    )
    same = request(settings, "web01 10.0.20.5 on=pve", network="vmbr0")
    assert same.network == "vmbr0"
    with pytest.raises(RequestInvalid) as refused:
        request(settings, "web01 10.0.20.5 on=pve", network="vmbr1")
    assert "network: 10.0.20.0/24 is on vmbr0 VLAN 20 on pve, not vmbr1: leave network out" in (
        refused.value.message
    )
    # No address: the form's network choice names the subnet whose segment it is.
    picked = request(settings, "web01 on=pve", network="vmbr1")
    assert picked.subnet == "10.0.30.0/24" and picked.picked
