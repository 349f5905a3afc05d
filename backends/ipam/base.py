"""The address-manager contract: one small async Protocol every IPAM provider implements.

deploybot's own store always records which job holds which address (a unique index over
jobs in flight or succeeded). An IPAM provider is the second record, the one the rest of
the organisation reads: a deploy reserves its address there before anything is built,
marks it active when the VM answers, and releases it when the job fails, is cancelled
or rejected, or the VM is destroyed.

Contract (tests/test_ipam_contract.py runs it against every provider):

* `reserve` is atomic in the IPAM: two callers, in two processes, never get the same
  address. Without `address` it takes the next free one of the pool that is not in
  `skip` (what the caller knows is taken elsewhere: other jobs, VMs on the hypervisors);
  with `address` it takes exactly that one or raises `AddressTaken` naming the holder.
* Every record a provider writes names the job (its id in the description) and this
  installation, so `release` can refuse an address that is not the job's (`NotOurs`) and
  `records` can find reservations a crash left behind (reconciled at start, like VMs).
* `release` and `activate` are idempotent: an address already gone is released.
* Failures are `BackendError`s as for hypervisors (backends/base.py): `Unreachable` when
  the IPAM does not answer (the job waits and says so), `PermanentError` when it refuses;
  a full pool is `PoolExhausted`.

The built-in provider keeps no record of its own: the store's unique index over the
addresses of jobs is the record, so it meets the first clause together with the job's
insert (a loser picks again), its reservations have no `ref`, and who holds an address is
the store's answer; it has no server to be unreachable.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from backends.base import PermanentError


class AddressTaken(PermanentError):
    """The address is held in the IPAM by someone other than the asking job."""

    def __init__(self, message: str, *, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class PoolExhausted(PermanentError):
    """No free address is left in the pool."""


class NotOurs(PermanentError):
    """The IPAM record exists but names another job or installation: never touched."""


@dataclass(frozen=True)
class Pool:
    """One configured subnet as an address manager sees it."""

    name: str
    cidr: ipaddress.IPv4Network
    first: ipaddress.IPv4Address  # the range deploybot may hand out, inclusive
    last: ipaddress.IPv4Address
    excluded: frozenset[ipaddress.IPv4Address]  # the gateway, DNS servers
    ipam_prefix: str | None = None  # the IPAM's prefix for it (default: cidr)
    ipam_vrf: str | None = None

    def hosts(self) -> list[ipaddress.IPv4Address]:
        """The addresses of the pool in order, without the excluded ones."""
        span = range(int(self.first), int(self.last) + 1)
        return [
            ip
            for ip in (ipaddress.IPv4Address(n) for n in span)
            if ip not in self.excluded and _host(self.cidr, ip)
        ]


def _host(cidr: ipaddress.IPv4Network, ip: ipaddress.IPv4Address) -> bool:
    return cidr.prefixlen >= 31 or ip not in (cidr.network_address, cidr.broadcast_address)


@dataclass(frozen=True)
class ReservedFor:
    """Who a reservation is for: written into the IPAM's record of it."""

    job_id: str
    installation: str
    name: str
    dns_name: str  # name.search_domain, or the bare name without one


@dataclass(frozen=True)
class Reservation:
    address: ipaddress.IPv4Address
    ref: str | None  # the IPAM's id of its record (None: the store is the record)


@dataclass(frozen=True)
class Vlan:
    """The VLAN the IPAM says a pool's addresses are in (NetBox: its prefix's VLAN)."""

    vid: int  # the 802.1Q tag, 1-4094
    name: str

    def __str__(self) -> str:
        return f"VLAN {self.vid} ({self.name})" if self.name else f"VLAN {self.vid}"


@dataclass(frozen=True)
class Record:
    """A reservation of this installation found in the IPAM (for reconciliation)."""

    ref: str
    address: ipaddress.IPv4Address
    job_id: str
    status: str
    created: datetime


class Ipam(Protocol):
    """One address manager. See the module docstring for the contract."""

    # What messages call it ("NetBox"); "" for the built-in one, which has no server.
    name: str

    async def reserve(
        self,
        pool: Pool,
        reserved_for: ReservedFor,
        *,
        address: ipaddress.IPv4Address | None = None,
        skip: frozenset[ipaddress.IPv4Address] = frozenset(),
    ) -> Reservation: ...

    async def holder(self, pool: Pool, address: ipaddress.IPv4Address, job_id: str) -> str | None:
        """Who the IPAM says holds `address`, when not `job_id`: None if it is free."""
        ...

    async def activate(self, ref: str, reserved_for: ReservedFor) -> None:
        """The VM answers: its address is in use now (from reserved to active)."""
        ...

    async def release(self, ref: str, reserved_for: ReservedFor) -> None: ...

    async def records(self, installation: str) -> list[Record]: ...

    async def problems(self, pools: list[Pool]) -> list[str]:
        """What stops this IPAM from serving these pools (`deploybot check`): the token
        cannot read a prefix or create an address, a prefix does not exist."""
        ...

    async def vlan(self, pool: Pool) -> Vlan | None:
        """The VLAN the IPAM puts the pool's addresses in (None: it says none), for
        `deploybot check` to compare with the subnet's segments."""
        ...

    async def close(self) -> None: ...
