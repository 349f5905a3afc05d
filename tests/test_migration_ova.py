"""The OVA head (issue 30 item 4): an OVA built by backends/vsphere/ovf.py's writer,
served by a web server on 127.0.0.1, is classified from one range request for its first
128 kB; its disk is never read. `--from-ova URL` makes it a plan's source."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web

from backends.base import PermanentError
from backends.building import BuildPlan
from backends.migrating import Scope
from backends.vsphere import buildmark, ovf
from backends.vsphere.ovahead import HEAD_BYTES, OvaSource, read_head, template_facts
from bot.images.profiles import catalogue
from bot.migration.classify import Category, MatchedBy, NoteKind
from bot.migration.plan import make_plan
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

DISK_BYTES = 4 * 1024 * 1024
MACHINE = ovf.Machine(
    name="debian-12",
    os_family="debian",
    cores=2,
    memory_mib=2048,
    nic="vmxnet3",
    disk_bus="scsi",
    network="VM Network",
    disk_file="disk1.vmdk",
    disk_file_size=DISK_BYTES,
    disk_capacity=8 * 1024**3,
)


def ova(descriptor: str, disk_bytes: int = DISK_BYTES) -> bytes:
    """An OVA as vSphere exports one: a tar, the descriptor first, then the disk."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("debian-12.ovf", descriptor.encode()), ("disk1.vmdk", None)):
            info = tarfile.TarInfo(name)
            info.size = len(data) if data is not None else disk_bytes
            stream = io.BytesIO(data if data is not None else os.urandom(disk_bytes))
            tar.addfile(info, stream)
    return out.getvalue()


def exported(descriptor: str, annotation: str, extra: dict[str, str]) -> str:
    """The writer's descriptor with what a vSphere export adds: the template's notes
    (AnnotationSection) and its extraConfig (vmw:ExtraConfig items)."""
    section = (
        '<AnnotationSection ovf:required="false"><Info>Notes</Info>'
        f"<Annotation>{annotation}</Annotation></AnnotationSection>"
    )
    items = "".join(
        f'<vmw:ExtraConfig ovf:required="false" vmw:key="{k}" vmw:value="{v}"/>'
        for k, v in extra.items()
    )
    with_notes = descriptor.replace("<OperatingSystemSection", section + "<OperatingSystemSection")
    return with_notes.replace("</VirtualHardwareSection>", items + "</VirtualHardwareSection>")


@dataclass
class Served:
    """A file server on 127.0.0.1 that records each request's Range and what it sent."""

    files: dict[str, bytes]
    honour_range: bool = True
    ranges: list[str | None] = field(default_factory=list)
    sent: int = 0
    port: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        data = self.files.get(request.path)
        self.ranges.append(request.headers.get("Range"))
        if data is None:
            return web.Response(status=404)
        wanted = request.headers.get("Range", "")
        if self.honour_range and wanted.startswith("bytes="):
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last), len(data) - 1)
            part = data[start : end + 1]
            self.sent += len(part)
            return web.Response(
                status=206,
                body=part,
                headers={"Content-Range": f"bytes {start}-{end}/{len(data)}"},
            )
        response = web.StreamResponse(status=200)
        response.content_length = len(data)
        await response.prepare(request)
        for offset in range(0, len(data), 64 * 1024):
            chunk = data[offset : offset + 64 * 1024]
            try:
                await response.write(chunk)
            except (ConnectionResetError, OSError):
                break  # the client stopped reading: as it should
            self.sent += len(chunk)
        return response


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    server = Served({})
    app = web.Application()
    app.router.add_get("/{tail:.*}", server.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.port = runner.addresses[0][1]
    yield server
    await runner.cleanup()


async def test_one_range_request_reads_the_descriptor_and_no_disk(served: Served) -> None:
    text = ovf.descriptor(MACHINE)
    served.files["/images/debian-12.ova"] = ova(text)
    head = await read_head(f"http://127.0.0.1:{served.port}/images/debian-12.ova")
    assert head.descriptor == text
    assert served.ranges == [f"bytes=0-{HEAD_BYTES - 1}"]
    assert served.sent == head.bytes_read == HEAD_BYTES  # 128 kB of a 4 MiB file
    facts = template_facts(head.url, head.descriptor)
    assert (facts.name, facts.guest_id) == ("debian-12", "debian10_64Guest")
    assert (facts.nics, facts.disk_controllers) == (("vmxnet3",), ("pvscsi",))
    assert facts.hardware_version == "vmx-13"


async def test_a_server_ignoring_the_range_is_read_no_further(served: Served) -> None:
    served.honour_range = False
    served.files["/a.ova"] = ova(ovf.descriptor(MACHINE))
    head = await read_head(f"http://127.0.0.1:{served.port}/a.ova")
    # What deploybot read is bounded; what the server wrote into the socket before the
    # close is not (the module docstring says so), so only the former is asserted.
    assert head.bytes_read == HEAD_BYTES and len(served.ranges) == 1
    assert len(served.files["/a.ova"]) > 8 * HEAD_BYTES
    assert "<Name>debian-12</Name>" in head.descriptor


async def test_what_cannot_be_read_is_said(served: Served) -> None:
    big = ovf.descriptor(MACHINE).replace(
        "</Envelope>", "<!--" + "x" * HEAD_BYTES + "--></Envelope>"
    )
    served.files["/big.ova"] = ova(big)
    served.files["/disk-first.ova"] = _disk_first()
    base = f"http://127.0.0.1:{served.port}"
    with pytest.raises(PermanentError, match="does not fit in the first 128 kB"):
        await read_head(f"{base}/big.ova")
    with pytest.raises(PermanentError, match=r"does not start with its \.ovf"):
        await read_head(f"{base}/disk-first.ova")
    with pytest.raises(PermanentError, match=r"answered HTTP 404: give the URL of an \.ova"):
        await read_head(f"{base}/missing.ova")
    with pytest.raises(PermanentError, match="not XML"):
        template_facts("x.ova", "<Envelope")
    assert len(served.ranges) == 3  # one request each


def _disk_first() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("disk1.vmdk")
        info.size = 1024
        tar.addfile(info, io.BytesIO(b"\0" * 1024))
    return out.getvalue()


def _mark() -> str:
    plan = BuildPlan(
        job_id="jova01a",
        profile="rocky-9",
        os_family="el",
        version=4,
        name="rocky-9",
        cpu="x86-64-v2-AES",
        ostype="l26",
        nic="vmxnet3",
        disk_bus="scsi",
        user="rocky",
        built_at=datetime(2026, 1, 2, tzinfo=UTC),
        source_digest="sha256:" + "cd" * 32,
    )
    return buildmark.annotation(plan)


async def test_an_ova_is_a_plan_source(served: Served) -> None:
    machine = dataclasses.replace(MACHINE, name="rocky-9-golden", os_family="el")
    text = exported(
        ovf.descriptor(machine), _mark(), {"guestinfo.cloudinit.datasource_list": "[VMware]"}
    )
    served.files["/rocky.ova"] = ova(text)
    source = OvaSource(f"http://127.0.0.1:{served.port}/rocky.ova")
    plan = await make_plan(source, "pve", [], catalogue(), Scope())
    (finding,) = plan.findings
    assert (finding.category, finding.profile) == (Category.REBUILDABLE, "rocky-9")
    assert finding.matched_by is MatchedBy.BUILD_MARK
    notes = {n.kind: n.value for n in finding.notes}
    assert notes[NoteKind.DATASOURCE_PINNED] == "guestinfo.cloudinit.datasource_list=[VMware]"
    assert notes[NoteKind.VMWARE_NIC] == "vmxnet3"
    assert source.api_calls() == {"GET (range)": 1} and served.sent == HEAD_BYTES
    skipped = await make_plan(source, "pve", [], catalogue(), Scope(name="debian*"))
    assert skipped.findings == () and skipped.digest != plan.digest


async def test_the_cli_plans_an_ova(served: Served, pve: FakePVE, tmp_path: Path) -> None:
    served.files["/debian-12.ova"] = ova(ovf.descriptor(MACHINE))
    config = tmp_path / "deploybot.toml"
    config.write_text(testing.config_text(pve, tmp_path, None))
    url = f"http://127.0.0.1:{served.port}/debian-12.ova"
    code, out, err = await _plan(pve, config, tmp_path, "--from-ova", url, "--json")
    assert code == 0, err
    document = json.loads(out)
    assert document["counts"]["template"] == {"rebuildable": 1, "on-target": 0, "not-mappable": 0}
    (finding,) = document["findings"]
    assert finding["reason"] == (
        "rebuild from profile debian-12 (from guest id 'debian10_64Guest', name 'debian-12')"
    )
    assert served.ranges == [f"bytes=0-{HEAD_BYTES - 1}"]
    # A source that does not answer, a plan file that cannot be written: said, exit
    # code, no traceback, nothing written.
    closed = _closed_port()
    code, out, err = await _plan(
        pve, config, tmp_path, "--from-ova", f"http://127.0.0.1:{closed}/x.ova"
    )
    assert code == 1 and f"migrate plan: http://127.0.0.1:{closed}/x.ova does not answer" in err
    assert "Nothing was changed" in err and "Traceback" not in out + err
    code, out, err = await _plan(
        pve, config, tmp_path, "--from-ova", url, "--out", str(tmp_path / "no" / "plan.json")
    )
    assert code == 2 and "cannot write the plan there" in err and "Traceback" not in err
    code, out, err = await _plan(pve, config, tmp_path, "--from-ova", "ftp://x/y.ova")
    assert code == 2 and "give the http:// or https:// URL" in err


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _plan(fake: FakePVE, config: Path, cwd: Path, *args: str) -> tuple[int, str, str]:
    return await testing.run_deploybot_apart(
        fake, config, cwd, "migrate", "plan", "--to", "pve", *args
    )
