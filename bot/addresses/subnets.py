"""The `[[subnets]]` deploybot may hand addresses out of, and which one a request uses.

A request that names its address uses the subnet the address falls in. One that does
not gets the next free address of a subnet chosen, in order, by `subnet=NAME`, by its
network (`networks = [...]`, or the network of its segment on the request's backend),
by its backend (`backends = [...]`), or as the only one.

The subnet then says where the VM's NIC goes on each backend (`[subnets.segments.NAME]`,
`segment_on`): a Proxmox bridge with an optional VLAN tag, a vSphere network by name.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.base import Segment
from backends.ipam.base import Pool

# One DNS domain (letters, digits, hyphens; dot-separated labels of at most 63).
_DOMAIN = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(?:\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*$")
# An FQDN has at most 253 characters; the host name takes up to 63 of them, and a dot.
_MAX_DOMAIN = 253 - 64
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# A Proxmox bridge (or SDN vnet): an interface name, at most 15 characters (Linux's limit).
_BRIDGE = r"^[-_.A-Za-z0-9]{1,15}$"


class SegmentSettings(BaseModel):
    """`[subnets.segments.BACKEND]`: where the subnet's VMs are plugged in on that backend.
    Proxmox: `bridge`, `vlan` (the tag, 1-4094; the bridge must be VLAN-aware) and
    `firewall` (Proxmox's per-NIC firewall; default off: VMs coming from VMware never had
    one, and turning it on is a project of its own). vSphere: `network`, a standard network
    or a distributed portgroup by name. Which keys a backend takes is checked against its
    kind when the file is read (`Settings`, with the kind's `segment_keys`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bridge: str | None = Field(default=None, pattern=_BRIDGE)  # Proxmox: the bridge or vnet
    vlan: int | None = Field(default=None, ge=1, le=4094)  # Proxmox: the NIC's VLAN tag
    firewall: bool = False  # Proxmox: the NIC's firewall switch
    network: str | None = Field(default=None, min_length=1, max_length=80)  # vSphere: by name

    @model_validator(mode="after")
    def _one_place(self) -> SegmentSettings:
        if (self.bridge is None) == (self.network is None):
            raise ValueError(
                "give either bridge (Proxmox, with an optional vlan) or network (vSphere: a "
                "standard network or distributed portgroup by name)"
            )
        if self.network is not None and {"vlan", "firewall"} & self.model_fields_set:
            raise ValueError(
                "vlan and firewall go with a Proxmox bridge; a vSphere portgroup carries its "
                "own VLAN: name the portgroup of that VLAN as network"
            )
        return self

    def keys(self) -> frozenset[str]:
        """The keys the file gave (for the check against the backend's kind)."""
        return frozenset(self.model_fields_set)

    def segment(self) -> Segment:
        return Segment(self.bridge or self.network or "", self.vlan, self.firewall)


class Subnet(BaseModel):
    """`search_domain` is also the guests' domain: web01 in lab.test is web01.lab.test,
    so it is one domain name (a trailing dot is dropped), not a list.

    `pool` ("10.0.0.100-10.0.0.199") is the range next-free addresses come from (default:
    the whole subnet but its gateway and DNS servers); an address typed by hand may be
    anywhere in the subnet. `ipam_prefix`/`ipam_vrf` name the IPAM's prefix for it when
    it is not the same CIDR in the global table. `vms_on` names the backends whose VMs
    may hold addresses of the subnet: the conflict check asks only those and the
    request's own backend (default: every backend)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cidr: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address
    dns: tuple[ipaddress.IPv4Address, ...] = ()
    search_domain: str = ""
    name: str = Field(default="", description="what subnet=NAME calls it; default: the CIDR")
    pool: str | None = None
    backends: tuple[str, ...] = ()
    networks: tuple[str, ...] = ()
    # Keyed by backend name: where the subnet's VMs are plugged in on that backend.
    segments: dict[str, SegmentSettings] = Field(default_factory=dict)
    vms_on: tuple[str, ...] = ()
    ipam_prefix: str | None = None
    ipam_vrf: str | None = None
    # A NIC of this subnet that is not a VM's first gets the gateway too (a routed second
    # leg): by default only the first NIC has one, so the default route stays there.
    gateway_when_not_first: bool = False

    @field_validator("search_domain")
    @classmethod
    def _one_domain(cls, value: str) -> str:
        domain = value.strip().removesuffix(".")
        if domain and (len(domain) > _MAX_DOMAIN or not _DOMAIN.fullmatch(domain)):
            raise ValueError(
                f"{value!r} is not one domain name (e.g. lab.example): it becomes the "
                "guests' domain, so it must be a single name of letters, digits and hyphens"
            )
        return domain

    @field_validator("name")
    @classmethod
    def _a_word(cls, value: str) -> str:
        if value and not _NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a subnet name: use lower-case letters, digits, ., - and _ "
                "(it is typed as subnet=NAME)"
            )
        return value

    @model_validator(mode="after")
    def _gateway_inside(self) -> Subnet:
        if self.gateway not in self.cidr:
            raise ValueError(f"gateway {self.gateway} is outside {self.cidr}")
        if self.cidr.prefixlen < 31 and self.gateway in (
            self.cidr.network_address,
            self.cidr.broadcast_address,
        ):
            what = "network" if self.gateway == self.cidr.network_address else "broadcast"
            raise ValueError(
                f"gateway {self.gateway} is the {what} address of {self.cidr}: give the "
                "router's own address"
            )
        self.bounds()  # a bad pool is reported at start
        return self

    @property
    def label(self) -> str:
        return self.name or str(self.cidr)

    def __str__(self) -> str:
        return f"{self.name} ({self.cidr})" if self.name else str(self.cidr)

    def bounds(self) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
        """The pool's first and last address."""
        if self.pool is None:
            return self.cidr.network_address, self.cidr.broadcast_address
        first, sep, last = self.pool.partition("-")
        low: ipaddress.IPv4Address | None = None
        high: ipaddress.IPv4Address | None = None
        with contextlib.suppress(ValueError):
            low, high = ipaddress.IPv4Address(first.strip()), ipaddress.IPv4Address(last.strip())
        if not sep or low is None or high is None or low > high:
            raise ValueError(
                f"pool {self.pool!r} is not a range: write FIRST-LAST, e.g. "
                f"{self.cidr.network_address + 100}-{self.cidr.network_address + 199}"
            )
        if low not in self.cidr or high not in self.cidr:
            raise ValueError(f"pool {self.pool} is not inside {self.cidr}")
        return low, high

    def asked(self, backends: list[str], own: str) -> list[str]:
        """Of `backends`, those whose VMs the conflict check asks for an address of
        this subnet on backend `own`: `vms_on` and `own`, or all when it is unset."""
        if not self.vms_on:
            return backends
        return [b for b in backends if b in self.vms_on or b == own]

    def segment(self, backend: str) -> Segment | None:
        """Where a NIC of this subnet goes on `backend`; None: the subnet says nothing."""
        found = self.segments.get(backend)
        return found.segment() if found is not None else None

    def as_pool(self) -> Pool:
        return self._pool

    @functools.cached_property
    def _pool(self) -> Pool:
        """Made once: the subnet is frozen, and every request and every deploy's
        `check_free` asks for its pool (parsing the range each time cost ~40 us)."""
        first, last = self.bounds()
        return Pool(
            name=self.label,
            cidr=self.cidr,
            first=first,
            last=last,
            excluded=frozenset({self.gateway, *self.dns}),
            ipam_prefix=self.ipam_prefix,
            ipam_vrf=self.ipam_vrf,
        )


def choose(
    subnets: tuple[Subnet, ...], named: str | None, backend: str, network: str | None
) -> Subnet | str:
    """The subnet a request without an address takes its next free address from, or
    what is wrong (a sentence for the requester)."""
    names = ", ".join(str(s) for s in subnets)
    if named is not None:
        found = [s for s in subnets if named in (s.name, str(s.cidr))]
        return found[0] if found else f"subnet: {named!r} is not a subnet; choose one of {names}."
    for matches in (
        [s for s in subnets if network is not None and network in _networks(s, backend)],
        [s for s in subnets if backend in s.backends],
    ):
        if len(matches) == 1:
            return matches[0]
    if len(subnets) == 1:
        return subnets[0]
    return (
        f"Say which subnet to take the next free address from (subnet=NAME, one of "
        f"{names}), or give the address."
    )


def _networks(subnet: Subnet, backend: str) -> tuple[str, ...]:
    """The networks that name `subnet` on `backend`: its `networks`, and its segment's."""
    segment = subnet.segment(backend)
    return (*subnet.networks, *((segment.network,) if segment else ()))


def segment_on(
    subnets: tuple[Subnet, ...], subnet: Subnet, backend: str, network: str | None = None
) -> Segment | str | None:
    """Where a NIC in `subnet` goes on `backend`: its segment there; None when no subnet
    has a segment on that backend (the backend's own network, or `network=`, applies to
    every address, as before segments); else what is wrong, for the requester.

    A subnet without a segment where others have one is refused rather than put on the
    backend's default network: the NIC would sit on another subnet's segment and never
    answer. `network` (the request's network=) must then be the segment's, if given."""
    segment = subnet.segment(backend)
    if segment is None:
        if any(backend in s.segments for s in subnets):
            return (
                f"{subnet.label} has no segment on {backend}: ask an operator to add "
                f"[subnets.segments.{backend}] to the subnet {subnet.cidr} (other subnets "
                f"say where their VMs go on {backend})."
            )
        return None
    if network is not None and network != segment.network:
        return (
            f"network: {subnet.label} is on {segment} on {backend}, not {network}: leave "
            "network out (the address picks the segment)."
        )
    return segment


def request_segment(
    subnets: tuple[Subnet, ...],
    label: str,
    address: ipaddress.IPv4Address,
    backend: str,
    network: str | None,
) -> Segment | str | None:
    """`segment_on` for a recorded request: its subnet by name (`DeployRequest.subnet`),
    else the one its address is in (a request from before subnets were recorded)."""
    subnet = next((s for s in subnets if label and s.label == label), None)
    subnet = subnet or next((s for s in subnets if address in s.cidr), None)
    if subnet is None:
        return None
    return segment_on(subnets, subnet, backend, network)
