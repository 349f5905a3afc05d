"""What people's jobs hold (VMs, cores, memory, disk), and the check that a new job fits.

No table of its own: a job holds its share while it holds its VM (HOLDING_STATES), and
the request kept with it says how much. `check` runs inside the insert's transaction
after taking the store's "quota" lock, so of two requests that each fit alone but not
together, the second one's check already counts the first (SQLite: one writer at a
time; PostgreSQL: the lock, held until the commit).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bot.models import HOLDING_STATES, DeployRequest
from bot.models.errors import StoreError
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


def asked(request: DeployRequest) -> Usage:
    """What one deploy holds once recorded."""
    return Usage(1, request.cores, request.memory_mib, request.disk_grow_gib)


@dataclass(frozen=True)
class Cap:
    """One quota a new job must fit: the jobs of `members` together (one person, or the
    members of a chat user group), at most `limits` (only the resources limited)."""

    label: str  # whose quota: a user id, or a group id
    members: frozenset[str]
    limits: Mapping[str, int] = field(default_factory=dict)
    group: bool = False


class OverQuota(StoreError):
    """The new job does not fit `cap`: its members already hold `used`."""

    def __init__(self, cap: Cap, used: Usage) -> None:
        super().__init__(cap.label)
        self.cap = cap
        self.used = used


def usage(db: Db, members: Iterable[str]) -> Usage:
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


def over(cap: Cap, used: Usage, wanted: Usage) -> bool:
    return any(used.of(r) + wanted.of(r) > limit for r, limit in cap.limits.items())


def check(db: Db, caps: Sequence[Cap], wanted: Usage) -> None:
    """Inside the insert's transaction: raise `OverQuota` for the first cap the new job
    does not fit. Takes the lock first, so the usage read here cannot change before the
    commit."""
    if not caps:
        return
    db.lock("quota")
    for cap in caps:
        used = usage(db, cap.members)
        if over(cap, used, wanted):
            raise OverQuota(cap, used)
