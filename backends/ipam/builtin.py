"""The default address manager: deploybot's own store is the record.

The store's unique index over the addresses of jobs in flight or succeeded is what makes
a reservation atomic; this only picks the first address of the pool that nobody is known
to hold. Two requests that pick the same address race at the job's insert, and the one
that loses picks again (bot/requests/intake.py).
"""

from __future__ import annotations

import ipaddress

from backends.ipam.base import Pool, PoolExhausted, Record, Reservation, ReservedFor, Vlan


class Builtin:
    name = ""

    async def reserve(
        self,
        pool: Pool,
        reserved_for: ReservedFor,
        *,
        address: ipaddress.IPv4Address | None = None,
        skip: frozenset[ipaddress.IPv4Address] = frozenset(),
    ) -> Reservation:
        if address is not None:
            return Reservation(address, None)
        for ip in pool.hosts():
            if ip not in skip:
                return Reservation(ip, None)
        raise PoolExhausted(f"every address of {pool.name} ({pool.first}-{pool.last}) is taken")

    async def holder(self, pool: Pool, address: ipaddress.IPv4Address, job_id: str) -> str | None:
        return None  # the store's own jobs are checked by the caller

    async def activate(self, ref: str, reserved_for: ReservedFor) -> None:
        return None

    async def release(self, ref: str, reserved_for: ReservedFor) -> None:
        return None

    async def records(self, installation: str) -> list[Record]:
        return []

    async def problems(self, pools: list[Pool]) -> list[str]:
        return []

    async def vlan(self, pool: Pool) -> Vlan | None:
        return None  # no server, no VLANs: the segment's tag is the only word on it

    async def close(self) -> None:
        return None
