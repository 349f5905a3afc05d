"""Reading a guest's addresses as its agent or Tools report them: which one is its
address (`pick_address`), and which may be another machine's (`listable`,
`reported_addresses`, for `addresses_in_use`)."""

from __future__ import annotations

import ipaddress

_CONTAINER_IFACES = ("docker", "cni", "veth", "virbr", "br-", "lxc", "flannel", "cali")


def pick_address(
    interfaces: list[tuple[str, str]], expected: ipaddress.IPv4Address | None
) -> ipaddress.IPv4Address | None:
    """Choose the guest's address from what its agent reports as (interface, address) pairs.

    Guest agents report everything the kernel has: loopback, link-local, container
    bridges. None of those reaches the guest from outside, so they are skipped. With an
    expected address, only that one: a guest on another address did not take its
    configuration (a real one whose cloud-init seed does not parse falls back to DHCP,
    without its user or key), so it is not handed over there; the caller keeps waiting
    and then says what the guest reports. Without one, the first usable address.
    """
    usable: list[ipaddress.IPv4Address] = []
    for ip in _outward(interfaces):
        if ip == expected:
            return ip
        if not (ip.is_loopback or ip.is_link_local):
            usable.append(ip)
    return usable[0] if usable and expected is None else None


def _outward(interfaces: list[tuple[str, str]]) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses of (interface, address) pairs, without the `lo` and
    container-bridge interfaces, in order."""
    found = []
    for iface, text in interfaces:
        if iface == "lo" or iface.startswith(_CONTAINER_IFACES):
            continue
        try:
            ip = ipaddress.ip_address(text.split("/")[0])
        except ValueError:
            continue
        if isinstance(ip, ipaddress.IPv4Address):
            found.append(ip)
    return found


def listable(ip: ipaddress.IPv4Address) -> bool:
    """Whether an address can be another machine's on a network (`addresses_in_use`).

    Loopback is kept (the `lo` interface is left out by name): an address is only ever
    compared with the configured subnets, and a subnet on 127.0.0.0/8 (the tests' guests)
    is as real to the conflict check as any other."""
    return not (ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def reported_addresses(interfaces: list[tuple[str, str]]) -> list[ipaddress.IPv4Address]:
    """The listable IPv4 addresses among a guest's (interface, address) pairs, without
    loopback and container-bridge interfaces (as `pick_address` skips them), in order."""
    found: list[ipaddress.IPv4Address] = []
    for ip in _outward(interfaces):
        if listable(ip) and ip not in found:
            found.append(ip)
    return found
