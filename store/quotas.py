"""What people's jobs hold (VMs, cores, memory, disk): the queries behind quotas.

The policy (who may hold how much, and what a request over it gets) is the core's
(bot/requests/quotas.py); the store only counts. No table of its own: a job holds its share while
it holds its VM (HOLDING_STATES), and the request kept with it says how much. `admit`
runs the core's check inside the insert's transaction after taking the store's "quota"
lock, so of two requests that each fit alone but not together, the second one's check
already counts the first (SQLite: one writer at a time; PostgreSQL: the lock, held until
the commit).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass

from bot.models import HOLDING_STATES
from store.sql import Db

_MARKS = ", ".join(f"'{s.value}'" for s in sorted(HOLDING_STATES))
RESOURCES = ("vms", "cores", "memory_mib", "disk_gib")


@dataclass(frozen=True)
class Usage:
    vms: int = 0
    cores: int = 0
    memory_mib: int = 0
    disk_gib: int = 0  # the disk growth asked (disk=+N): the template's own disk is not known

    def of(self, resource: str) -> int:
        return int(getattr(self, resource))

    def plus(self, other: Usage) -> Usage:
        return Usage(*(self.of(r) + other.of(r) for r in RESOURCES))


# What the requesters in a collection hold now, read in the caller's transaction.
UsageOf = Callable[[Collection[str]], Usage]
# The core's check of a new job against its quotas: raises to refuse it (bot/requests/quotas.py).
Admit = Callable[[UsageOf], None]


def usage(db: Db, members: Collection[str]) -> Usage:
    """What the jobs of these requesters hold now."""
    people = sorted(set(members))
    if not people:
        return Usage()
    marks = ", ".join("?" for _ in people)
    rows = db.query(
        f"SELECT request FROM jobs WHERE state IN ({_MARKS}) AND requester IN ({marks})", people
    )
    total = Usage()
    for row in rows:
        try:
            request = json.loads(row["request"])
            one = Usage(1, int(request["cores"]), int(request["memory_mib"]),
                        int(request.get("disk_grow_gib", 0)))  # fmt: skip
        except (TypeError, ValueError, KeyError):
            one = Usage(vms=1)  # a damaged row still holds its VM; reading it quarantines it
        total = total.plus(one)
    return total


def admit(db: Db, check: Admit) -> None:
    """Inside the insert's transaction: take the "quota" lock first, so the usage `check`
    reads here cannot change before the commit; what `check` raises undoes the insert."""
    db.lock("quota")
    check(lambda members: usage(db, members))
