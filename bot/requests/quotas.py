"""Quotas: how much one person, and one team (a chat user group), may hold at once.

A quota counts VMs, cores, memory and disk growth of the jobs that hold their VM
(HOLDING_STATES: in flight, ready, or on their way out); a destroyed, failed or
rejected job frees its share. `[quotas] default` applies to everyone, `[quotas.users]`
overrides it per person, and each `[[quotas.groups]]` caps the sum of all its members'
jobs. No table of its own: the store reads the jobs (store/quotas.py).

The intake asks `caps` for the requester's quotas and hands their `admission` to the
store's insert, which runs it inside its transaction under the store's "quota" lock: two requests
that each fit alone but not together cannot both be recorded, in one process or many.
A request over quota is refused with the numbers, or (`over = "approval"`) recorded as
awaiting an approver, who then decides knowing it is over.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bot.models import DeployRequest
from bot.models.errors import NotAllowed, StoreError, UserError
from store.db import Store
from store.quotas import RESOURCES, Admit, Usage, UsageOf

log = logging.getLogger(__name__)
# The members of a chat user group (the same look-up approver groups use).
Members = Callable[[str], Awaitable[frozenset[str]]]
UNITS = {"vms": "", "cores": "", "memory_mib": " MiB", "disk_gib": " GiB"}
NAMES = {"vms": "VMs", "cores": "cores", "memory_mib": "memory", "disk_gib": "disk"}


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


def asked(request: DeployRequest) -> Usage:
    """What one deploy holds once recorded."""
    return Usage(1, request.cores, request.memory_mib, request.disk_grow_gib)


def over(cap: Cap, used: Usage, wanted: Usage) -> bool:
    return any(used.of(r) + wanted.of(r) > limit for r, limit in cap.limits.items())


def admission(caps: list[Cap], wanted: Usage) -> Admit | None:
    """The check the store's insert runs in its transaction, under its "quota" lock
    (store/quotas.admit): `OverQuota` for the first cap the new job does not fit.
    None when there is no cap to check (and no lock to take)."""
    if not caps:
        return None

    def check(usage_of: UsageOf) -> None:
        for cap in caps:
            used = usage_of(cap.members)
            if over(cap, used, wanted):
                raise OverQuota(cap, used)

    return check


class Quota(BaseModel):
    """Limits per resource; one left out is not limited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vms: int | None = Field(default=None, ge=0)
    cores: int | None = Field(default=None, ge=0)
    memory_mib: int | None = Field(default=None, ge=0)
    disk_gib: int | None = Field(default=None, ge=0)

    def limits(self) -> dict[str, int]:
        return {r: v for r in RESOURCES if (v := getattr(self, r)) is not None}


class GroupQuota(Quota):
    group: str = Field(min_length=1)  # a Slack user group id (S...)
    # For front ends that cannot list a group (the CLI): its members, spelled out.
    members: tuple[str, ...] = ()


class QuotaSettings(BaseModel):
    """`[quotas]`: nothing set, nothing limited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: Quota = Quota()
    users: dict[str, Quota] = {}  # per person; a resource left out keeps the default's
    groups: tuple[GroupQuota, ...] = ()
    over: Literal["refuse", "approval"] = "refuse"

    def for_user(self, user: str) -> dict[str, int]:
        own = self.users.get(user)
        return {**self.default.limits(), **(own.limits() if own else {})}


@dataclass(frozen=True)
class Standing:
    """One quota as a person sees it: whose, how much is used, the limits."""

    cap: Cap
    used: Usage


class QuotaExceeded(NotAllowed):
    """A request over quota, under `over = "refuse"`: permanent until something is freed."""


def amount(resource: str, value: int) -> str:
    return f"{value}{UNITS[resource]}"


def whose(cap: Cap) -> str:
    return f"the quota of group {cap.label}" if cap.group else "your quota"


def over_text(cap: Cap, used: Usage, wanted: Usage) -> str:
    """Why `wanted` does not fit `cap`, with the numbers of only the resources that do
    not fit: 'over your quota (cores: 14 used + 4 asked > 16)'."""
    parts = [
        f"{NAMES[r]}: {amount(r, used.of(r))} used + {amount(r, wanted.of(r))} asked "
        f"> {amount(r, limit)}"
        for r, limit in cap.limits.items()
        if used.of(r) + wanted.of(r) > limit
    ]
    return f"over {whose(cap)} ({'; '.join(parts)})"


def refusal(exc: OverQuota, wanted: Usage) -> QuotaExceeded:
    return QuotaExceeded(
        f"This request is {over_text(exc.cap, exc.used, wanted)}. Destroy a VM you no "
        "longer need (`/deploy list`), ask for less, or ask an operator to raise the quota."
    )


class Quotas:
    def __init__(self, config: QuotaSettings, store: Store, members: Callable[[], Members | None]):
        """`members`: the chat front end's group look-up, when there is one (read at each
        use: the front end sets it after the core is built)."""
        self.config = config
        self.store = store
        self._members = members

    async def caps(self, user: str) -> list[Cap]:
        """The quotas a request by `user` must fit: their own, and each group's they are in."""
        caps = []
        own = self.config.for_user(user)
        if own:
            caps.append(Cap(user, frozenset({user}), own))
        for group in self.config.groups:
            members = await self._group(group)
            if user in members and group.limits():
                caps.append(Cap(group.group, members, group.limits(), group=True))
        return caps

    async def _group(self, group: GroupQuota) -> frozenset[str]:
        lookup = self._members()
        if lookup is None:
            return frozenset(group.members)
        try:
            return await lookup(group.group) | frozenset(group.members)
        except Exception as exc:  # a quota that cannot be counted must not be skipped
            log.exception("could not list the members of quota group %s", group.group)
            raise UserError(
                f"I could not list the members of group {group.group} to check its quota "
                f"({exc.__class__.__name__}); try again in a minute, or ask an operator to "
                "look at the log."
            ) from None

    async def standing(self, user: str) -> list[Standing]:
        """Each of `user`'s quotas with what is used now (the form, the App Home)."""
        return [
            Standing(cap, await self.store.jobs.quota_usage(cap.members))
            for cap in await self.caps(user)
        ]

    async def first_over(self, caps: list[Cap], wanted: Usage) -> OverQuota | None:
        """The first cap `wanted` does not fit now (read outside the insert: the insert
        checks again under the lock)."""
        for cap in caps:
            used = await self.store.jobs.quota_usage(cap.members)
            if over(cap, used, wanted):
                return OverQuota(cap, used)
        return None
