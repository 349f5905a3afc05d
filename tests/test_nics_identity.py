"""What a deploy with several NICs hands its backend (`identity_of`, issue 29): each NIC
after the first with its address, gateway (only where its subnet gave one), segment and
fixed MAC, in order; DNS servers and search domains of every NIC merged, the first
NIC's first, none twice."""

from __future__ import annotations

import ipaddress

from backends.base import Nic, Segment
from bot.kinds.deploy.runs import identity_of
from bot.models import DeployRequest, NicRequest

IP = ipaddress.IPv4Address
IF = ipaddress.IPv4Interface
REQUEST = DeployRequest(
    name="web01",
    address=IF("127.0.10.50/24"),
    gateway=IP("127.0.10.1"),
    dns=(IP("127.0.10.2"),),
    search_domain="lab.test",
    template="ubuntu-24.04",
    backend="sim",
    cores=2,
    memory_mib=2048,
    user="ubuntu",
    requester="alice",
    subnet="lab10",
    mac="52:54:00:12:34:56",
    nics=(
        NicRequest(
            address=IF("127.0.20.5/24"),
            subnet="lab20",
            dns=(IP("127.0.20.2"), IP("127.0.10.2")),
            search_domain="lab20.test",
            mac="52:54:00:12:34:57",
        ),
        NicRequest(
            address=IF("127.0.30.7/24"),
            subnet="lab30",
            gateway=IP("127.0.30.1"),
            search_domain="lab.test",
        ),
    ),
)
VLAN20 = Segment("vmbr1", 20)


def test_each_nic_in_order_with_its_segment_gateway_and_mac() -> None:
    identity = identity_of(REQUEST, Segment("vmbr0"), (VLAN20, None))
    assert identity.segment == Segment("vmbr0") and identity.mac == "52:54:00:12:34:56"
    assert identity.more_nics == (
        Nic(IF("127.0.20.5/24"), None, VLAN20, "52:54:00:12:34:57"),
        Nic(IF("127.0.30.7/24"), IP("127.0.30.1"), None, None),
    )


def test_dns_and_search_domains_are_merged_the_first_nics_first() -> None:
    identity = identity_of(REQUEST)
    assert identity.dns == (IP("127.0.10.2"), IP("127.0.20.2"))
    assert (identity.search_domain, identity.search_domains) == ("lab.test", ("lab20.test",))
    assert identity.searches == ("lab.test", "lab20.test")
    # Segments not resolved (a backend without segments): every NIC on the default.
    assert all(n.segment is None for n in identity.more_nics)


def test_a_first_subnet_without_a_search_domain_takes_the_next_ones() -> None:
    identity = identity_of(REQUEST.model_copy(update={"search_domain": ""}))
    assert (identity.search_domain, identity.search_domains) == ("lab20.test", ("lab.test",))


def test_one_nic_is_as_before() -> None:
    one = identity_of(REQUEST.model_copy(update={"nics": (), "mac": None}))
    assert (one.more_nics, one.mac, one.search_domains) == ((), None, ())
    assert one.dns == (IP("127.0.10.2"),) and one.searches == ("lab.test",)
