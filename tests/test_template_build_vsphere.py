"""Template builds on vSphere (issue 17) against vcsim, in vCenter and ESXi mode: the
pre-flight, the OVF import of a qcow2 (converted by qemu-img), the build mark,
publishing by renames, the versions, removal, a failed upload, and a clone from a built
template; and the pure parts (CPU baseline rule, OVA head, mark) directly."""

# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects and pyVim are not)

from __future__ import annotations

import asyncio
import http.server
import io
import shutil
import ssl
import subprocess
import tarfile
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pyVim.task import WaitForTask
from pyVmomi import vim

from backends.base import CloneSpec, NotOurVM, PermanentError, VMRef
from backends.building import BuildPlan, BuildsTemplates, BuildTarget
from backends.tags import parse_tag
from backends.vsphere import VSphereBackend, buildmark, cpu, ovf
from tests.support.vsphere.simulator import (
    TEMPLATE,
    Simulated,
    TlsFiles,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

INSTALLATION = "inst0abcde"
BUILT_AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def plan(
    version: int = 1, job: str = "jbuild01", name: str = "debian-12", **more: Any
) -> BuildPlan:
    fields: dict[str, Any] = {
        "job_id": job,
        "profile": "debian-12",
        "os_family": "debian",
        "version": version,
        "name": name,
        "cpu": "x86-64-v2-AES",
        "ostype": "l26",
        "nic": "vmxnet3",
        "disk_bus": "scsi",
        "user": "debian",
        "built_at": BUILT_AT,
        "source_digest": "sha256:" + "ab" * 32,
        "cores": 2,
        "memory_mib": 1024,
        "installation": INSTALLATION,
    }
    return BuildPlan(**{**fields, **more})


@pytest.fixture(scope="session")
def qcow2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("qemu-img") is None:
        pytest.skip("qemu-img is not installed (apt-get install qemu-utils)")
    image = tmp_path_factory.mktemp("image") / "prepared.qcow2"
    subprocess.run(["qemu-img", "create", "-f", "qcow2", str(image), "64M"], check=True)
    return image


@pytest.fixture(params=["vcenter", "esxi"])
def simulated(request: pytest.FixtureRequest) -> Simulated:
    found: Simulated = request.getfixturevalue(request.param)
    return found


@pytest.fixture
async def backend(simulated: Simulated) -> AsyncIterator[VSphereBackend]:
    vsphere = simulated.sim.backend()
    yield vsphere
    await vsphere.close()


@pytest.fixture
async def vc_backend(vcenter: Simulated) -> AsyncIterator[VSphereBackend]:
    vsphere = vcenter.sim.backend()
    yield vsphere
    await vsphere.close()


async def build(backend: VSphereBackend, p: BuildPlan, image: Path) -> tuple[VMRef, BuildTarget]:
    target = await backend.build_preflight(p)
    ref = await backend.prepare_build(p, target)
    await backend.create_template(p, target, ref, image)
    return ref, target


def named(sim: Any, name: str) -> list[Any]:
    view = sim.content.viewManager.CreateContainerView(
        sim.content.rootFolder, [vim.VirtualMachine], True
    )
    try:
        return [vm for vm in view.view if vm.name == name]
    finally:
        view.DestroyView()


# --- on vcsim -----------------------------------------------------------------------


async def test_a_build_imports_a_marked_template(
    backend: VSphereBackend, simulated: Simulated, qcow2: Path
) -> None:
    assert isinstance(backend, BuildsTemplates)
    p = plan()
    ref, target = await build(backend, p, qcow2)
    assert ref.vm_id and target.storage
    vm = simulated.sim.vm(ref.vm_id)
    assert vm is not None
    assert vm.name == "debian-12-v1"
    assert vm.config.template
    lines = vm.config.annotation.splitlines()
    assert lines[0] == p.tag and parse_tag(lines[0]) is not None
    mark = buildmark.read(vm.config.annotation)
    assert mark == {
        "name": "debian-12",
        "profile": "debian-12",
        "version": "1",
        "built_at": BUILT_AT.isoformat(),
        "cpu": "x86-64-v2-AES",
        "digest": "sha256:" + "ab" * 32,
    }
    assert vm.config.hardware.numCPU == 2
    assert vm.config.hardware.memoryMB == 1024
    assert vm.config.guestId == "debian10_64Guest"
    devices = vm.config.hardware.device
    (disk,) = [d for d in devices if isinstance(d, vim.vm.device.VirtualDisk)]
    assert disk.capacityInKB == 64 * 1024
    (nic,) = [d for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard)]
    assert isinstance(nic, vim.vm.device.VirtualVmxnet3)
    (version,) = await backend.template_versions()
    assert (version.vm_id, version.name, version.base_name) == (
        ref.vm_id,
        "debian-12-v1",
        "debian-12",
    )
    assert (version.version, version.built_at, version.cpu) == (1, BUILT_AT, "x86-64-v2-AES")
    assert version.mark is not None and version.mark.job_id == p.job_id
    assert not version.current
    # A second call (a resumed job) finds it done; the VMDK's folder went each time.
    again = await backend.create_template(p, target, ref, qcow2)
    assert again is not None and "already" in again
    assert list(qcow2.parent.glob("deploybot-*")) == []


async def test_publish_renames_and_finishes_after_a_crash(
    backend: VSphereBackend, simulated: Simulated, qcow2: Path
) -> None:
    """Both templates are in one folder, where vSphere (and vcsim) refuse a second VM
    of one name: the previous one is renamed first, then the new one."""
    sim, vc_backend = simulated.sim, backend
    p1 = plan(1, "jbuild01")
    ref1, _t = await build(vc_backend, p1, qcow2)
    said = await vc_backend.publish_template(p1, ref1)
    assert said == "debian-12-v1 is now debian-12"
    assert sim.vm(ref1.vm_id).name == "debian-12"
    assert await vc_backend.publish_template(p1, ref1) == "debian-12 was published already"

    p2 = plan(2, "jbuild02")
    ref2, _t = await build(vc_backend, p2, qcow2)  # pre-flight: debian-12 is ours, v1
    await vc_backend.publish_template(p2, ref2)
    assert (sim.vm(ref2.vm_id).name, sim.vm(ref1.vm_id).name) == ("debian-12", "debian-12-v1")
    versions = await vc_backend.template_versions("debian-12")
    assert [(v.version, v.current) for v in versions] == [(1, False), (2, True)]

    # A crash between the two renames of version 3's publication: run again, finished.
    p3 = plan(3, "jbuild03")
    ref3, _t = await build(vc_backend, p3, qcow2)
    await asyncio.to_thread(WaitForTask, sim.vm(ref2.vm_id).Rename_Task("debian-12-v2"))
    said = await vc_backend.publish_template(p3, ref3)
    assert said == "debian-12-v3 is now debian-12"
    names = {sim.vm(r.vm_id).name for r in (ref1, ref2, ref3)}
    assert names == {"debian-12", "debian-12-v1", "debian-12-v2"}
    assert sim.vm(ref3.vm_id).name == "debian-12"
    # The deploy path sees the new one at once (the inventory's template cache went).
    assert any(t.name == "debian-12" for t in await vc_backend.templates())


async def test_publish_across_folders_renames_the_new_one_first(
    vc_backend: VSphereBackend, vcenter: Simulated, qcow2: Path
) -> None:
    """With the previous template in another folder the name is never free: the new
    one takes it first (two of one name for a moment, as on Proxmox)."""
    sim = vcenter.sim
    p1, p2 = plan(1, "jbuild01"), plan(2, "jbuild02")
    ref1, _t = await build(vc_backend, p1, qcow2)
    await vc_backend.publish_template(p1, ref1)
    old = sim.datacenter.vmFolder.CreateFolder("retired")
    await asyncio.to_thread(WaitForTask, old.MoveIntoFolder_Task([sim.vm(ref1.vm_id)]))
    # A new session: vcsim (0.24) moves a VM by removing and adding it, which the
    # session's tracker of VM names (a container view) misses; vCenter's views follow.
    fresh = sim.backend()
    try:
        ref2, _t = await build(fresh, p2, qcow2)
        said = await fresh.publish_template(p2, ref2)
    finally:
        await fresh.close()
    assert said == "debian-12-v2 is now debian-12; debian-12-v1 (was debian-12)"
    assert (sim.vm(ref2.vm_id).name, sim.vm(ref1.vm_id).name) == ("debian-12", "debian-12-v1")


async def test_template_versions_read_the_marks_in_one_request(
    vc_backend: VSphereBackend, qcow2: Path
) -> None:
    p = plan()
    ref, _t = await build(vc_backend, p, qcow2)
    assert [v.vm_id for v in await vc_backend.template_versions("debian-12")] == [ref.vm_id]
    assert await vc_backend.template_versions("ubuntu-24.04") == []  # no mark: not ours
    before = vc_backend.api_calls()
    (version,) = await vc_backend.template_versions()
    assert vc_backend.api_calls() - before == {"RetrievePropertiesEx": 1}
    assert version.profile == "debian-12" and version.used_by == ()


async def test_publish_leaves_a_hand_made_holder_alone(
    vc_backend: VSphereBackend, vcenter: Simulated, qcow2: Path
) -> None:
    p = plan()
    ref, _t = await build(vc_backend, p, qcow2)
    # Someone calls the template they made by hand debian-12 after the pre-flight.
    hand = named(vcenter.sim, TEMPLATE)[0]
    await asyncio.to_thread(WaitForTask, hand.Rename_Task("debian-12"))
    with pytest.raises(PermanentError, match="not a template this installation built"):
        await vc_backend.publish_template(p, ref)
    assert vcenter.sim.vm(ref.vm_id).name == "debian-12-v1"
    assert hand.name == "debian-12"


async def test_cpu_baseline_refused_where_the_hosts_lack_avx2(backend: VSphereBackend) -> None:
    # vcsim's hosts (both modes) are Sandy Bridge Xeons: AES and AVX, no leaf 7.
    with pytest.raises(PermanentError, match=r"cannot run x86-64-v3: .* lacks .*avx2"):
        await backend.build_preflight(plan(cpu="x86-64-v3"))
    assert (await backend.build_preflight(plan())).storage


async def test_a_vmxnet3_template_is_refused_for_deploys_until_tools_were_seen(
    vc_backend: VSphereBackend, qcow2: Path
) -> None:
    """What the build job must know: an imported template never ran, so vSphere has not
    seen VMware Tools in it, and a deploy of a vmxnet3 template is refused (`nic`)."""
    p = plan(nic="vmxnet3")
    ref, _t = await build(vc_backend, p, qcow2)
    await vc_backend.publish_template(p, ref)
    spec = CloneSpec("jdeploy1", "web01", "debian-12", installation=INSTALLATION)
    with pytest.raises(PermanentError, match="needs VMware Tools"):
        await vc_backend.prepare_clone(spec)


async def test_built_templates_carry_the_template_annotation_filter(
    vcenter: Simulated, qcow2: Path
) -> None:
    backend = vcenter.sim.backend(template_annotation="golden")
    try:
        p = plan(nic="e1000e")
        ref, _t = await build(backend, p, qcow2)
        await backend.publish_template(p, ref)
        assert "debian-12" in [t.name for t in await backend.templates()]
        assert "golden" in vcenter.sim.vm(ref.vm_id).config.annotation.splitlines()
    finally:
        await backend.close()


async def test_destroy_template(backend: VSphereBackend, simulated: Simulated, qcow2: Path) -> None:
    p = plan()
    ref, _t = await build(backend, p, qcow2)
    with pytest.raises(NotOurVM):
        await backend.destroy_template(VMRef(ref.vm_id, "jother01", None, INSTALLATION))
    await backend.destroy_template(ref)
    assert simulated.sim.vm(ref.vm_id) is None
    await backend.destroy_template(ref)  # gone: quiet
    assert await backend.template_versions() == []


class _Refusing(http.server.BaseHTTPRequestHandler):
    paths: list[str] = []  # noqa: RUF012 (the test reads what came)

    def do_POST(self) -> None:
        self.paths.append(self.path)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(507)
        self.end_headers()
        self.wfile.write(b"disk full")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_nfc(vcsim_tls: TlsFiles) -> Iterator[int]:
    """An HTTPS server on 127.0.0.1 that refuses every upload (a full datastore)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(vcsim_tls.cert, vcsim_tls.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join()


async def test_a_refused_upload_aborts_the_lease_and_leaves_no_vm(
    vc_backend: VSphereBackend, vcenter: Simulated, qcow2: Path, refusing_nfc: int
) -> None:
    p = plan()
    target = await vc_backend.build_preflight(p)
    ref = await vc_backend.prepare_build(p, target)
    # The device URL's `*` becomes this server: the upload goes to the refusing one.
    vc_backend.builds.endpoint = ("127.0.0.1", refusing_nfc)
    _Refusing.paths.clear()
    with pytest.raises(PermanentError, match="507"):
        await vc_backend.create_template(p, target, ref, qcow2)
    (path,) = _Refusing.paths
    assert path.startswith("/nfc/")
    assert vcenter.sim.vm(ref.vm_id) is None
    assert named(vcenter.sim, p.versioned_name) == []
    # The lease is gone (aborted): vcsim answers 404 for its device URL now.
    context = ssl.create_default_context(cafile=str(vcenter.sim.tls.ca))
    request = urllib.request.Request(
        f"https://127.0.0.1:{vcenter.sim.port}{path}", data=b"x", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError, match="404"):
        await asyncio.to_thread(urllib.request.urlopen, request, context=context)


async def test_preflight_refusals(vc_backend: VSphereBackend, vcenter: Simulated) -> None:
    sim = vcenter.sim
    target = await vc_backend.build_preflight(plan())
    assert target.placement == "DC0_C0" and target.storage
    with pytest.raises(PermanentError, match="no datastore 'nope'"):
        await vc_backend.build_preflight(plan(storage="nope"))
    with pytest.raises(PermanentError, match="disk bus 'nvme' has no vSphere equivalent"):
        await vc_backend.build_preflight(plan(disk_bus="nvme"))
    vm1 = named(sim, "DC0_H0_VM1")[0]
    await asyncio.to_thread(WaitForTask, vm1.Rename_Task("debian-12-v1"))
    with pytest.raises(PermanentError, match="debian-12-v1 exists already"):
        await vc_backend.build_preflight(plan())
    await asyncio.to_thread(WaitForTask, vm1.Rename_Task("debian-12"))
    with pytest.raises(PermanentError, match=r"debian-12 .* is a VM this installation did not"):
        await vc_backend.build_preflight(plan())
    await asyncio.to_thread(WaitForTask, vm1.Rename_Task("other"))
    hand = named(sim, TEMPLATE)[0]
    await asyncio.to_thread(WaitForTask, hand.Rename_Task("debian-12"))
    with pytest.raises(PermanentError, match="is a template this installation did not"):
        await vc_backend.build_preflight(plan())


async def test_a_template_of_another_installation_is_not_ours(
    vc_backend: VSphereBackend, qcow2: Path
) -> None:
    theirs = plan(1, "jtheirs1", installation="other0abcd")
    ref, _t = await build(vc_backend, theirs, qcow2)
    await vc_backend.publish_template(theirs, ref)
    with pytest.raises(PermanentError, match="this installation did not build"):
        await vc_backend.build_preflight(plan(2))


async def test_a_clone_of_a_built_template_carries_its_own_job_only(
    backend: VSphereBackend, simulated: Simulated, qcow2: Path
) -> None:
    # virtio (the profile's Proxmox model) becomes e1000e: a vmxnet3 template that never
    # ran with VMware Tools is refused for deploys (see the report of the first test).
    p = plan(nic="virtio")
    ref, _t = await build(backend, p, qcow2)
    await backend.publish_template(p, ref)
    template = simulated.sim.vm(ref.vm_id)
    card = vim.vm.device.VirtualEthernetCard
    assert [type(d) for d in template.config.hardware.device if isinstance(d, card)] == [
        vim.vm.device.VirtualE1000e
    ]
    spec = CloneSpec("jdeploy1", "web01", "debian-12", installation=INSTALLATION)
    clone = await backend.prepare_clone(spec)
    await backend.clone(spec, clone)
    note = simulated.sim.vm(clone.vm_id).config.annotation
    assert note.splitlines()[0] == spec.tag
    assert p.tag not in note and buildmark.read(note) is None
    (info,) = await backend.find_by_name("web01")
    assert info.tags == frozenset({spec.tag})


# --- the pure parts -----------------------------------------------------------------


def _host(name: str, leaf1_ecx: int, leaf7_ebx: int | None, ext_ecx: int = 0x21) -> cpu.HostCpu:
    regs = {1: {"ecx": leaf1_ecx}, 0x80000001: {"ecx": ext_ecx}}
    if leaf7_ebx is not None:
        regs[7] = {"ebx": leaf7_ebx}
    return cpu.HostCpu(name, regs)


SANDY = 0x97BA222B  # vcsim's leaf 1 ECX: sse3..sse4.2, popcnt, aes, avx; no fma, movbe, f16c
HASWELL_1 = SANDY | (1 << 12) | (1 << 22) | (1 << 29) | (1 << 27)
HASWELL_7 = (1 << 3) | (1 << 5) | (1 << 8)


def test_cpu_baseline_rule() -> None:
    ok, notes = cpu.baseline_problem("x86-64-v3", "C0", [_host("h1", HASWELL_1, HASWELL_7)], None)
    assert (ok, notes) == (None, [])
    problem, _n = cpu.baseline_problem(
        "x86-64-v3", "C0", [_host("h1", HASWELL_1, HASWELL_7), _host("h2", SANDY, None)], None
    )
    assert problem is not None and "h2 lacks" in problem and "avx2" in problem
    assert "h1" not in problem
    assert cpu.baseline_problem("x86-64-v2-AES", "C0", [_host("h2", SANDY, None)], None)[0] is None
    no_aes = SANDY & ~(1 << 25)
    problem, _n = cpu.baseline_problem("x86-64-v2-AES", "C0", [_host("h", no_aes, None)], None)
    assert problem is not None and "aes" in problem
    # EVC caps every host of the cluster, whatever their CPUs.
    fast = [_host("h1", HASWELL_1, HASWELL_7)]
    problem, _n = cpu.baseline_problem("x86-64-v3", "C0", fast, "intel-sandybridge")
    assert problem is not None and "EVC mode intel-sandybridge" in problem
    assert cpu.baseline_problem("x86-64-v3", "C0", [], "amd-zen2") == (None, [])
    assert cpu.baseline_problem("x86-64-v3", "C0", [], "intel-future")[1]  # a note
    # A host without readable leaves: its best EVC mode, else a note.
    blind = cpu.HostCpu("h3", {}, "intel-ivybridge")
    assert "at most EVC mode intel-ivybridge" in str(
        cpu.baseline_problem("x86-64-v3", "C0", [blind], None)[0]
    )
    unknown = cpu.HostCpu("h4", {})
    assert cpu.baseline_problem("x86-64-v3", "C0", [unknown], None)[0] is None
    assert cpu.baseline_problem("x86-64-v3", "C0", [unknown], None)[1]
    assert "unknown CPU baseline" in str(cpu.baseline_problem("x86-64-v4", "C0", [], None)[0])


def test_cpuid_registers_are_read_most_significant_bit_first() -> None:
    class Info:
        level = -2147483647  # 0x80000001, as the API's signed int
        eax = ebx = edx = "0000:0000:0000:0000:0000:0000:0000:0000"
        ecx = "0000:0000:0000:0000:0000:0000:0010:0001"

    assert cpu.leaves([Info()]) == {0x80000001: {"eax": 0, "ebx": 0, "ecx": 0x21, "edx": 0}}


class _Counting(io.RawIOBase):
    """A stream that counts what is read from it and refuses to be read past `limit`."""

    def __init__(self, data: bytes, limit: int) -> None:
        self.data, self.limit, self.pos = data, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), len(self.data) - self.pos)
        if self.pos + size > self.limit:
            raise AssertionError(f"read past the OVA's head (to {self.pos + size})")
        buffer[:size] = self.data[self.pos : self.pos + size]
        self.pos += size
        return size


def _ova(first: str, text: bytes, disk_size: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in ((first, text), ("disk1.vmdk", b"\0" * disk_size)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_the_ova_descriptor_is_read_from_the_head_only(tmp_path: Path) -> None:
    text = b'<?xml version="1.0"?><Envelope/>'
    data = _ova("appliance.ovf", text, 4 * 1024 * 1024)
    # A header (512) and the descriptor's block (512); tarfile reads 10 KiB blocks.
    stream = _Counting(data, 64 * 1024)
    assert ovf.ova_descriptor(io.BufferedReader(stream, 512)) == text.decode()
    assert stream.pos < 64 * 1024
    path = tmp_path / "a.ova"
    path.write_bytes(data)
    assert ovf.ova_descriptor(path) == text.decode()
    path.write_bytes(_ova("disk0.vmdk", b"x", 10))
    with pytest.raises(PermanentError, match=r"does not start with its \.ovf"):
        ovf.ova_descriptor(path)


def test_the_descriptor_names_what_vsphere_knows() -> None:
    machine = ovf.Machine("t<1>", "el", 4, 4096, "virtio", "sata", "VM & Net", "d.vmdk", 10, 20)
    text = ovf.descriptor(machine)
    assert "t&lt;1&gt;" in text and "VM &amp; Net" in text
    assert 'vmw:osType="rhel7_64Guest"' in text and "<rasd:ResourceSubType>E1000e<" in text
    with pytest.raises(PermanentError, match="NIC model 'rtl8139' has no vSphere"):
        ovf.descriptor(ovf.Machine("t", "el", 1, 1, "rtl8139", "scsi", "n", "d", 1, 1))


def test_the_build_mark_reads_back() -> None:
    p = plan(7)
    note = buildmark.annotation(p)
    props = {
        "name": "debian-12",
        "config.template": True,
        "config.annotation": note,
        "config.instanceUuid": "u-1",
    }
    version = buildmark.version(props)
    assert version is not None and (version.version, version.current) == (7, True)
    assert buildmark.ours(props, INSTALLATION) and not buildmark.ours(props, "other0abcd")
    assert buildmark.version({**props, "config.template": False}) is None
    # The mark is never read as a job tag.
    assert [parse_tag(line) is not None for line in note.splitlines()] == [True, False, False]
