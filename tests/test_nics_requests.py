"""Several NICs and fixed MACs in a request (issue 29 items 2 and 3): `+ADDRESS` / `+SUBNET`
words and `mac=` / `macN=` in the grammar, and the refusals of bot/requests/validation.py
(two NICs in one subnet, an address or a MAC twice, a subnet without a segment on the
backend for a later NIC), each naming what is wrong."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from bot.models import DeployRequest, NicRequest
from bot.models.errors import RequestInvalid, UsageError
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from tests.support.deployer import make_settings

PVE = {"kind": "proxmox", "name": "pve", "host": "pve.example"}
SIM = {"kind": "sim", "name": "sim"}


def subnet(cidr: str, name: str, **extra: Any) -> dict[str, Any]:
    net = cidr.rsplit(".", 1)[0]
    return {"cidr": cidr, "gateway": f"{net}.1", "name": name, "dns": [f"{net}.2"], **extra}


def three(tmp_path: Path, **lab30: Any) -> Any:
    return make_settings(
        tmp_path,
        backends=[SIM, PVE],
        defaults={"backend": "sim"},
        subnets=[
            subnet("10.0.0.0/24", "lab", search_domain="lab.example"),
            subnet(
                "10.0.20.0/24",
                "lab20",
                search_domain="twenty.example",
                pool="10.0.20.100-10.0.20.110",
            ),
            subnet("10.0.30.0/24", "lab30", **lab30),
        ],
    )


def build(text: str, settings: Any) -> DeployRequest:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    return build_request(args, settings, "alice")


def refused(text: str, settings: Any) -> RequestInvalid:
    with pytest.raises(RequestInvalid) as caught:
        build(text, settings)
    return caught.value


def test_plus_words_and_macs_parse_in_any_order() -> None:
    args = parse(
        "web01 10.0.0.50 cpu=2 +10.0.20.5 mac=52-54-00-AB-CD-EF +lab30 mac3=52:54:00:00:00:03"
    )
    assert isinstance(args, DeployArgs)
    assert args.address == "10.0.0.50"
    assert args.more_nics == ("10.0.20.5", "lab30")
    assert args.macs == ((1, "52:54:00:ab:cd:ef"), (3, "52:54:00:00:00:03"))
    assert args.cores == 2
    first_free = parse("web01 +10.0.20.5")
    assert isinstance(first_free, DeployArgs)
    assert (first_free.address, first_free.more_nics) == (None, ("10.0.20.5",))


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "web01 10.0.0.50 mac2=52:54:00:12:34:56",
            "the request has one NIC; add a `+` word for NIC 2",
        ),
        ("web01 10.0.0.50 +lab20 mac3=52:54:00:12:34:56", "the request has 2 NICs"),
        ("web01 10.0.0.50 mac=52:54:00:12:34", "is not a MAC address: write six pairs"),
        ("web01 10.0.0.50 mac=zz:54:00:12:34:56", "is not a MAC address"),
        ("web01 10.0.0.50 mac=52:54-00:12:34:56", "is not a MAC address"),
        ("web01 10.0.0.50 mac=01:00:5e:00:00:01", "is a multicast MAC address"),
        ("web01 10.0.0.50 mac=00:00:00:00:00:00", "not a usable MAC address"),
        ("web01 10.0.0.50 mac=52:54:00:12:34:56 mac1=52:54:00:12:34:57", "the same NIC's"),
        ("web01 10.0.0.50 mac2=52:54:00:12:34:56 mac2=52:54:00:12:34:57 +lab20", "given twice"),
        ("web01 10.0.0.50 +", "A `+` word gives one NIC more"),
        ("web01 10.0.0.50 +mac=1", "A `+` word gives one NIC more"),
        ("web01 10.0.0.50 " + "+lab20 " * 8, "at most 8 NICs"),
    ],
)
def test_grammar_refusals_say_what_was_wrong(text: str, said: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse(text)
    assert said in str(caught.value)


def test_a_nic_per_subnet_with_its_settings_and_no_gateway(tmp_path: Path) -> None:
    req = build(
        "web01 10.0.0.50 +10.0.20.5 +lab30 mac=52:54:00:00:00:01 mac2=52:54:00:00:00:02",
        three(tmp_path),
    )
    assert req.address == ipaddress.IPv4Interface("10.0.0.50/24")
    assert req.mac == "52:54:00:00:00:01"
    second, third = req.nics
    assert second == NicRequest(
        address=ipaddress.IPv4Interface("10.0.20.5/24"),
        subnet="lab20",
        dns=(ipaddress.IPv4Address("10.0.20.2"),),
        search_domain="twenty.example",
        mac="52:54:00:00:00:02",
    )
    assert third.subnet == "lab30" and third.picked and third.gateway is None
    assert third.address.ip in ipaddress.IPv4Network("10.0.30.0/24")
    assert [str(a.ip) for a in req.addresses][:2] == ["10.0.0.50", "10.0.20.5"]
    assert req.macs == ("52:54:00:00:00:01", "52:54:00:00:00:02")
    # A job's request survives the store's round trip (JSON) with its NICs.
    assert DeployRequest.model_validate_json(req.model_dump_json()) == req


def test_a_routed_second_leg_gets_its_gateway_when_its_subnet_says(tmp_path: Path) -> None:
    req = build("web01 10.0.0.50 +lab30", three(tmp_path, gateway_when_not_first=True))
    assert req.nics[0].gateway == ipaddress.IPv4Address("10.0.30.1")


def test_a_picked_nic_stands_in_with_its_pools_first(tmp_path: Path) -> None:
    req = build("web01 10.0.0.50 +lab20", three(tmp_path))
    assert req.nics[0].address == ipaddress.IPv4Interface("10.0.20.100/24")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "web01 10.0.0.50 +10.0.0.51",
            "NIC 2 (10.0.0.51) is in lab like NIC 1: two NICs in one subnet",
        ),
        ("web01 10.0.0.50 +lab", "NIC 2 (lab) is in lab like NIC 1"),
        ("web01 10.0.0.50 +lab20 +10.0.20.7", "NIC 3 (10.0.20.7) is in lab20 like NIC 2"),
        ("web01 10.0.0.50 +192.168.9.9", "NIC 2: 192.168.9.9 is not in a subnet deploybot may use"),
        ("web01 10.0.0.50 +lab99", "NIC 2: `lab99` is not an IPv4 address"),
        ("web01 10.0.0.50 +10.0.20.0", "10.0.20.0 is the network address of 10.0.20.0/24"),
        ("web01 10.0.0.50 +10.0.20.5/16", "NIC 2: 10.0.20.5/16 says /16"),
        ("web01 10.0.0.50 +10.0.20.1", "NIC 2: 10.0.20.1 is the gateway of 10.0.20.0/24"),
        (
            "web01 10.0.0.50 +10.0.20.5 mac=52:54:00:00:00:01 mac2=52:54:00:00:00:01",
            "The MAC 52:54:00:00:00:01 is given twice",
        ),
    ],
)
def test_request_refusals_name_the_nic(tmp_path: Path, text: str, said: str) -> None:
    assert said in str(refused(text, three(tmp_path)))


def test_an_address_twice_is_refused_by_the_model() -> None:
    base = {
        "name": "web01", "address": "10.0.0.50/24", "gateway": "10.0.0.1", "template": "t",
        "backend": "sim", "cores": 1, "memory_mib": 512, "user": "ubuntu", "requester": "a",
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"10\.0\.0\.50 is given twice"):
        DeployRequest.model_validate(
            {**base, "nics": [{"address": "10.0.0.50/24", "subnet": "lab"}]}
        )


def test_a_later_nic_without_a_segment_on_the_backend_is_refused_naming_it(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path,
        backends=[SIM, PVE],
        defaults={"backend": "pve"},
        subnets=[
            subnet("10.0.0.0/24", "lab", segments={"pve": {"bridge": "vmbr0"}}),
            subnet("10.0.20.0/24", "lab20", segments={"pve": {"bridge": "vmbr0", "vlan": 20}}),
            subnet("10.0.30.0/24", "lab30"),
        ],
    )
    said = str(refused("web01 10.0.0.50 +10.0.20.5 +10.0.30.5", settings))
    assert "NIC 3 (10.0.30.5): lab30 has no segment on pve" in said
    assert "lab20" not in said  # the NIC that has one is not named
    ok = build("web01 10.0.0.50 +10.0.20.5", settings)
    assert [n.subnet for n in ok.nics] == ["lab20"]
