"""Optional abilities of a backend, beside the `Backend` Protocol (backends/base.py): a
backend without them is used through the Protocol alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from backends.base import AddressUse, MissingPrivilege, Template, VMInfo


@runtime_checkable
class ChecksPrivileges(Protocol):
    """A backend that can say which privileges a deploy of `template` lacks
    (`deploybot check`), and where its deploys' disks go by default."""

    default_storage: str | None
    endpoint: tuple[str, int]  # host and port of its API, for the certificate's subject

    async def missing_privileges(self, template: str) -> list[MissingPrivilege]:
        """Those a deploy of `template` lacks. Raises `BackendError` when they cannot be
        asked (no such template: the places a deploy needs them depend on it); never an
        empty list for a check that did not run."""
        ...


@runtime_checkable
class NamedTemplates(Protocol):
    """A backend that can look up one template by name without reading every one (a
    request names one: checking it should not cost a request per template)."""

    async def template(self, name: str) -> Template | None:
        """The template of that name; None when there is none."""
        ...


@runtime_checkable
class NamesWithAddresses(Protocol):
    """A backend that answers the name check and `addresses_in_use` from one read of
    its VMs (vSphere: one look of the session's VM tracker), so that a check of both
    (at admission, in check_free) asks once: the answer is as of that one read."""

    async def named_with_addresses(self, name: str) -> tuple[list[VMInfo], list[AddressUse]]:
        """`find_by_name(name)` and `addresses_in_use()`, from the same read."""
        ...


@dataclass(frozen=True)
class StepTime:
    """How long one finished deploy step took, as the job history recorded it."""

    step: str  # a pipeline step: clone, identity, resize, power_on, address
    template: str
    storage: str | None  # as requested (None: the default)
    duration_s: float


@runtime_checkable
class LearnsDurations(Protocol):
    """A backend that paces its waits by how long such steps took before. The bot
    hands it the recorded step durations (newest first) when it starts, so a fresh
    process does not poll as if it had never deployed."""

    def remember_steps(self, history: list[StepTime]) -> None: ...
