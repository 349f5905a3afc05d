"""What a migration reads of the hypervisor it leaves (issue 30): the read-only source
contract and the facts of one template, as plain data the plan classifies.

A source is opened through a type that has no mutating method at all, not through a
backend with a flag: `ReadOnlySource` is everything it offers, and every call reads
(backends/vsphere/readonly.py implements it for vCenter and ESXi; its SOAP stub also
refuses, before sending, any method that is not a read). An OVA on a web server is a
source too, read from its head alone (backends/vsphere/ovahead.py).

The facts are what a plan's digest covers, so that an apply can read them again and
notice a source that changed since: only what the classification uses, in a stable
order, and no secret. A template's guestinfo documents may hold keys and passwords,
so only a digest of each is kept; a key that names cloud-init datasources keeps its
value (that value is the finding).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

# guestinfo keys are VMware's channel into the guest (cloud-init's VMware datasource
# reads guestinfo.metadata, .userdata, .vendordata); their values are kept as digests.
GUESTINFO_PREFIX = "guestinfo."
# A key naming the datasources cloud-init may use (tools that pin the list record it
# like `guestinfo.cloudinit.datasource_list = [VMware]`): its value is kept.
DATASOURCE_WORD = "datasource"
MAX_VALUE_CHARS = 200


@dataclass(frozen=True)
class TemplateFacts:
    """One template of the source as the plan sees it."""

    source_id: str  # vSphere: config.instanceUuid (durable); an OVA: its URL
    name: str
    guest_id: str  # vSphere's guest id (debian12_64Guest); "" when the source says none
    annotation: str
    extra: tuple[tuple[str, str], ...]  # (key, value or sha256:digest), sorted
    nics: tuple[str, ...]  # NIC models, one per NIC: vmxnet3, e1000, e1000e
    disk_controllers: tuple[str, ...]  # controllers holding a disk: pvscsi, lsilogic, sata
    hardware_version: str  # vmx-13; "" when not said

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        return data


@dataclass(frozen=True)
class Scope:
    """Which part of the source a plan covers: a folder, a name pattern (fnmatch)."""

    folder: str | None = None
    name: str | None = None


def extra_facts(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The extraConfig entries a plan keeps (the last value of a key wins, as vSphere
    reads them): datasource keys with their value, other guestinfo keys as digests."""
    kept: dict[str, str] = {}
    for key, value in pairs:
        if DATASOURCE_WORD in key.lower():
            kept[key] = str(value)[:MAX_VALUE_CHARS]
        elif key.lower().startswith(GUESTINFO_PREFIX):
            kept[key] = "sha256:" + hashlib.sha256(str(value).encode()).hexdigest()
    return tuple(sorted(kept.items()))


class ReadOnlySource(Protocol):
    """A hypervisor opened for reading only. Nothing here changes it; there is no
    method that could."""

    name: str

    async def template_facts(self, scope: Scope) -> list[TemplateFacts]:
        """Every template in `scope`, sorted by name then id."""
        ...

    def api_calls(self) -> Counter[str]:
        """The calls sent so far, by method name."""
        ...

    async def close(self) -> None: ...
