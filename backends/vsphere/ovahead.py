"""The OVA head (issue 30 item 4): a template exported as an OVA on a web server, read
from its first 128 kB alone and described as `TemplateFacts`, without downloading the
disks.

An OVA is a tar archive whose first member is the .ovf descriptor, so one HTTP range
request (`Range: bytes=0-131071`) holds it; `ovf.ova_descriptor` reads it out of those
bytes as a stream. A server that ignores the range answers 200 with the whole file: the
body is read up to the same limit and the connection closed, so deploybot reads no more
either way (what such a server wrote before it saw the close, into the sockets' buffers,
is not read, but it is not bounded here either). `OvaSource` is a read-only migration
source of one OVA (`--from-ova URL`).

The descriptor is untrusted XML of at most 128 kB; Python's expat (2.4.1 and later)
refuses entity expansion bombs, and nothing here resolves external entities.
"""

from __future__ import annotations

import fnmatch
import io
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass

import aiohttp

from backends.base import PermanentError, Unreachable
from backends.migrating import Scope, TemplateFacts, VMFacts, extra_facts
from backends.vsphere.ovf import ova_descriptor

HEAD_BYTES = 128 * 1024
NS = {
    "ovf": "http://schemas.dmtf.org/ovf/envelope/1",
    "rasd": "http://schemas.dmtf.org/wbem/wscim/1/cim-schema/2/CIM_ResourceAllocationSettingData",
    "vssd": "http://schemas.dmtf.org/wbem/wscim/1/cim-schema/2/CIM_VirtualSystemSettingData",
    "vmw": "http://www.vmware.com/schema/ovf",
}
# CIM resource types of the descriptor's items.
NIC, IDE, SCSI, SATA, DISK = "10", "5", "6", "20", "17"
SCSI_MODELS = {
    "virtualscsi": "pvscsi",
    "lsilogic": "lsilogic",
    "lsilogicsas": "lsilogic-sas",
    "buslogic": "buslogic",
}


@dataclass(frozen=True)
class OvaHead:
    """What one range request read: the descriptor, and how many body bytes it took."""

    url: str
    descriptor: str
    bytes_read: int


async def read_head(url: str, *, timeout_s: float = 30.0) -> OvaHead:
    """The descriptor of the OVA at `url`, from one request for its first HEAD_BYTES."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Range": f"bytes=0-{HEAD_BYTES - 1}", "Accept-Encoding": "identity"}
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(url, headers=headers, max_redirects=5) as response,
        ):
            if response.status not in (200, 206):
                raise PermanentError(
                    f"{url} answered HTTP {response.status}: give the URL of an .ova file"
                )
            head = await _read_at_most(response, HEAD_BYTES)
            response.close()  # a 200 would go on with the disks: stop here
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise Unreachable(f"{url} does not answer ({exc})") from None
    try:
        text = ova_descriptor(io.BytesIO(head))
    except PermanentError:
        if len(head) >= HEAD_BYTES:
            raise PermanentError(
                f"{url}: its .ovf descriptor does not fit in the first {HEAD_BYTES // 1024} kB "
                "(or the file is no OVA)"
            ) from None
        raise
    return OvaHead(url, text, len(head))


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await response.content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def template_facts(source_id: str, descriptor: str) -> TemplateFacts:
    """The facts of the (first) virtual system an OVF descriptor describes."""
    try:
        root = ET.fromstring(descriptor)  # at most 128 kB (module docstring)
    except ET.ParseError as exc:
        raise PermanentError(f"{source_id}: the .ovf descriptor is not XML ({exc})") from None
    system = root.find(".//ovf:VirtualSystem", NS)
    if system is None:
        raise PermanentError(f"{source_id}: the .ovf descriptor describes no VirtualSystem")
    name = system.findtext("ovf:Name", "", NS) or system.get(f"{{{NS['ovf']}}}id", "")
    os_section = system.find("ovf:OperatingSystemSection", NS)
    guest = os_section.get(f"{{{NS['vmw']}}}osType", "") if os_section is not None else ""
    items = system.findall("ovf:VirtualHardwareSection/ovf:Item", NS)
    extra = [
        (e.get(f"{{{NS['vmw']}}}key", ""), e.get(f"{{{NS['vmw']}}}value", ""))
        for e in system.iter(f"{{{NS['vmw']}}}ExtraConfig")
    ]
    return TemplateFacts(
        source_id=source_id,
        name=name.strip(),
        guest_id=guest,
        annotation=system.findtext("ovf:AnnotationSection/ovf:Annotation", "", NS).strip(),
        extra=extra_facts(extra),
        nics=tuple(
            _rasd(i, "ResourceSubType").lower() or "unknown"
            for i in items
            if _rasd(i, "ResourceType") == NIC
        ),
        disk_controllers=_controllers(items),
        hardware_version=system.findtext(
            "ovf:VirtualHardwareSection/ovf:System/vssd:VirtualSystemType", "", NS
        ).strip(),
    )


def _rasd(item: ET.Element, field: str) -> str:
    return (item.findtext(f"rasd:{field}", "", NS) or "").strip()


def _controllers(items: list[ET.Element]) -> tuple[str, ...]:
    """The models of the controllers that hold a disk."""
    by_id = {_rasd(i, "InstanceID"): i for i in items}
    found = []
    for disk in (i for i in items if _rasd(i, "ResourceType") == DISK):
        parent = by_id.get(_rasd(disk, "Parent"))
        if parent is None:
            continue
        kind = _rasd(parent, "ResourceType")
        if kind == SCSI:
            sub = _rasd(parent, "ResourceSubType").lower()
            found.append(SCSI_MODELS.get(sub, sub or "scsi"))
        else:
            found.append({IDE: "ide", SATA: "sata"}.get(kind, f"type-{kind}"))
    return tuple(sorted(found))


class OvaSource:
    """One OVA on a web server as a read-only migration source: one range request."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.name = url
        self.url = url
        self.timeout_s = timeout_s
        self._calls: Counter[str] = Counter()
        self.last: OvaHead | None = None
        self.tags_unreadable: str | None = None  # an OVA has no vSphere tags to read

    async def template_facts(self, scope: Scope) -> list[TemplateFacts]:
        self._calls["GET (range)"] += 1
        self.last = await read_head(self.url, timeout_s=self.timeout_s)
        facts = template_facts(self.url, self.last.descriptor)
        if scope.name is not None and not fnmatch.fnmatchcase(facts.name, scope.name):
            return []
        return [facts]

    async def vm_facts(self, scope: Scope) -> list[VMFacts]:
        """An OVA holds a template, never a running VM."""
        return []

    def api_calls(self) -> Counter[str]:
        return Counter(self._calls)

    async def close(self) -> None:
        return None
