"""Building golden templates on Proxmox (issue 17) against the fake: the upload, the VM
imported from it, the template conversion and the upload's removal; publishing; the
versions and their linked clones; destroying a build; and the pre-flight refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from backends.base import CloneSpec, NotOurVM, PermanentError, VMRef
from backends.building import BuildPlan, BuildsTemplates
from backends.proxmox import ProxmoxBackend
from backends.proxmox.apierrors import TaskFailed
from backends.proxmox.vmconfig import mark_field, merged_tags, tags_of
from tests.support.fakepve import testing
from tests.support.fakepve.realvm import RealMachines
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import make_backend, start_fake
from tests.support.images import upstream_server
from tests.support.proxmox import IDENTITY

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

INSTALLATION = "labinst001"
UPLOAD = "/nodes/{node}/storage/{storage}/upload"
CREATE = "/nodes/{node}/qemu"
TEMPLATE = "/nodes/{node}/qemu/{vmid}/template"
VOLUME = "/nodes/{node}/storage/{storage}/content/{volume}"
DOWNLOAD = "/nodes/{node}/storage/{storage}/download-url"
needs_qemu_img = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="qemu-img (qemu-utils) is not installed"
)


def plan(job: str = "jbuild01", version: int = 1, **changes: Any) -> BuildPlan:
    base = BuildPlan(
        job_id=job,
        profile="golden-deb",
        os_family="debian",
        version=version,
        name="golden-deb",
        cpu="x86-64-v2-AES",
        ostype="l26",
        nic="virtio",
        disk_bus="scsi",
        user="debian",
        built_at=datetime(2026, 12, 2, 6, 0, tzinfo=UTC),
        source_digest="sha256:" + "ab" * 32,
        storage="local-lvm",
        installation=INSTALLATION,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("qemu-img") is None:
        pytest.skip("qemu-img (qemu-utils) is not installed")
    path = tmp_path_factory.mktemp("image") / "golden.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "64M"], check=True)
    return path


def modern(schema: ApiSchema, tls: Tls, **options: Any) -> FakePVE:
    """PVE 8.4, whose `local` storage takes content `import`."""
    fake = start_fake(schema, tls, release="8.4", **options)
    fake.cluster.storages["local"].content = "iso,vztmpl,backup,import"
    return fake


@pytest.fixture
async def pve(pve_schema: ApiSchema, pve_tls: Tls) -> AsyncIterator[FakePVE]:
    async with modern(pve_schema, pve_tls) as fake:
        yield fake


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    proxmox = make_backend(pve, bridge="vmbr1")
    yield proxmox
    await proxmox.close()


async def build(backend: ProxmoxBackend, image: Path, p: BuildPlan) -> VMRef:
    target = await backend.build_preflight(p)
    ref = await backend.prepare_build(p, target)
    await backend.create_template(p, target, ref, image)
    return ref


# --- the build --------------------------------------------------------------------------


async def test_a_build_uploads_imports_converts_and_removes_the_upload(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    assert isinstance(backend, BuildsTemplates)
    p = plan()
    target = await backend.build_preflight(p)
    assert (target.placement, target.storage) == ("pve1", "local-lvm")
    assert any("local (content import)" in n for n in target.notes)
    ref = await backend.prepare_build(p, target)
    assert ref.placement == "pve1@lab" and ref.tag == p.tag
    assert int(ref.vm_id) not in pve.cluster.vms  # chosen, nothing created
    note = await backend.create_template(p, target, ref, image)
    assert note and "local-lvm" in note

    (upload,) = pve.sent("POST", UPLOAD)
    assert upload.params["content"] == "import"
    assert upload.params["filename"] == "deploybot-jbuild01.qcow2"
    assert upload.params["checksum-algorithm"] == "sha256"
    digest = await asyncio.to_thread(lambda: hashlib.sha256(image.read_bytes()).hexdigest())
    assert upload.params["checksum"] == digest
    (create,) = pve.sent("POST", CREATE)
    assert create.params["scsi0"] == "local-lvm:0,import-from=local:import/deploybot-jbuild01.qcow2"
    (delete,) = pve.sent("DELETE", VOLUME)
    assert delete.path_params["volume"] == "local:import/deploybot-jbuild01.qcow2"
    order = [r.template for r in pve.requests if r.method != "GET"]
    assert order == [UPLOAD, CREATE, TEMPLATE, VOLUME]
    assert pve.cluster.volumes == {}  # the upload is gone

    config = pve.cluster.vms[int(ref.vm_id)].config
    assert config["template"] == "1" and config["name"] == "golden-deb-v1"
    assert config["scsi0"] == f"local-lvm:base-{ref.vm_id}-disk-0,size=64M"
    assert config["ide2"] == f"local-lvm:vm-{ref.vm_id}-cloudinit,media=cdrom"
    assert (config["serial0"], config["vga"], config["agent"]) == ("socket", "serial0", "1")
    assert (config["cpu"], config["ostype"], config["scsihw"]) == (
        "x86-64-v2-AES",
        "l26",
        "virtio-scsi-single",
    )
    assert config["boot"] == "order=scsi0" and config["net0"].endswith(",bridge=vmbr1")
    assert config["tags"].split(";") == sorted([p.tag, "os-debian", "profile-golden-deb"])
    assert p.tag in tags_of(config)
    for key, value in [("version", "1"), ("build", "golden-deb"), ("cpu", "x86-64-v2-AES")]:
        assert mark_field(config, key) == value
    assert mark_field(config, "source") == p.source_digest
    assert mark_field(config, "job") == "jbuild01"
    # A template is no job's leftover VM: find_tagged (and so gc) skips it.
    assert all(v.vm_id != ref.vm_id for v in await backend.find_tagged())


async def test_an_unchanged_image_is_fetched_by_the_node_itself(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    """An upstream qcow2 that needed no change: the node downloads and verifies it
    (`download-url`), nothing is uploaded from the bot host."""
    digest = await asyncio.to_thread(lambda: hashlib.sha256(image.read_bytes()).hexdigest())
    async with upstream_server() as mirror:
        mirror.files["golden.qcow2"] = image
        p = plan(source_url=mirror.link("golden.qcow2"), source_digest=f"sha256:{digest}")
        target = await backend.build_preflight(p)
        ref = await backend.prepare_build(p, target)
        note = await backend.create_template(p, target, ref, image)
        assert mirror.hits["golden.qcow2"] == 1
    assert note and "a download by the node to local" in note
    (download,) = pve.sent("POST", DOWNLOAD)
    assert download.params["content"] == "import"
    assert download.params["filename"] == "deploybot-jbuild01.qcow2"
    assert (download.params["checksum"], download.params["checksum-algorithm"]) == (
        digest,
        "sha256",
    )
    assert pve.sent("POST", UPLOAD) == []
    assert pve.cluster.vms[int(ref.vm_id)].config["template"] == "1"
    assert pve.cluster.volumes == {}  # the download is gone too


async def test_a_download_the_node_cannot_verify_falls_back_to_the_upload(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    """Upstream changed since the bot verified its copy: the node's download fails its
    checksum and keeps nothing; the verified copy is uploaded instead."""
    digest = await asyncio.to_thread(lambda: hashlib.sha256(image.read_bytes()).hexdigest())
    async with upstream_server() as mirror:
        mirror.files["golden.qcow2"] = b"QFI\xfb a newer upstream file"
        p = plan(source_url=mirror.link("golden.qcow2"), source_digest=f"sha256:{digest}")
        ref = await build(backend, image, p)
    assert len(pve.sent("POST", DOWNLOAD)) == 1 and len(pve.sent("POST", UPLOAD)) == 1
    assert pve.cluster.vms[int(ref.vm_id)].config["template"] == "1"


async def test_an_old_release_uploads_raw_data_to_an_iso_store(
    pve_schema: ApiSchema, pve_tls: Tls, image: Path
) -> None:
    async with start_fake(pve_schema, pve_tls, release="8.2") as fake:
        proxmox = make_backend(fake)
        try:
            ref = await build(proxmox, image, plan())
        finally:
            await proxmox.close()
        (upload,) = fake.sent("POST", UPLOAD)
        assert (upload.params["content"], upload.params["filename"]) == (
            "iso",
            "deploybot-jbuild01.img",
        )
        (create,) = fake.sent("POST", CREATE)
        assert create.params["scsi0"].endswith("import-from=local:iso/deploybot-jbuild01.img")
        config = fake.cluster.vms[int(ref.vm_id)].config
        assert config["scsi0"] == f"local-lvm:base-{ref.vm_id}-disk-0,size=64M"  # raw: 64M
        assert fake.cluster.volumes == {}


# --- publishing and versions ------------------------------------------------------------


async def test_publish_renames_the_new_then_the_previous_and_can_run_again(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    first = plan("jbuild01", 1)
    one = await build(backend, image, first)
    assert await backend.publish_template(first, one)
    assert (await backend.template("golden-deb")) is not None  # read, then cached
    second = plan("jbuild02", 2)
    two = await build(backend, image, second)
    # A crash after the first rename: the new one carries the name, the old one too.
    pve.cluster.vms[int(two.vm_id)].config["name"] = "golden-deb"
    note = await backend.publish_template(second, two)
    assert note and f"VM {one.vm_id}" in note and "golden-deb-v1" in note
    names = {vmid: pve.cluster.vms[int(vmid)].config["name"] for vmid in (one.vm_id, two.vm_id)}
    assert names == {one.vm_id: "golden-deb-v1", two.vm_id: "golden-deb"}
    again = await backend.publish_template(second, two)
    assert again and "already" in again
    # The next deploy sees the new one (the cache was dropped).
    found = await backend.template("golden-deb")
    assert found is not None and (await backend.inventory.template("golden-deb")).vmid == int(
        two.vm_id
    )

    before = len(pve.requests)
    versions = await backend.template_versions("golden-deb")
    asked = [r.template for r in pve.requests[before:]]
    # The VM list, each template's config, one content listing per storage of theirs.
    assert asked.count("/cluster/resources") == 1
    assert asked.count("/nodes/{node}/qemu/{vmid}/config") == 8  # 6 hand-made + 2 built
    assert asked.count("/nodes/{node}/storage/{storage}/content") == 1
    assert [(v.vm_id, v.name, v.version, v.current) for v in versions] == [
        (one.vm_id, "golden-deb-v1", 1, False),
        (two.vm_id, "golden-deb", 2, True),
    ]
    assert versions[1].mark is not None and versions[1].mark.job_id == "jbuild02"
    assert versions[1].built_at == second.built_at and versions[1].cpu == "x86-64-v2-AES"
    assert await backend.template_versions("other") == []


async def test_publish_refuses_a_hand_made_template_of_that_name(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    p = plan()
    ref = await build(backend, image, p)
    pve.cluster.add_template(9100, "golden-deb")  # made by hand meanwhile
    with pytest.raises(PermanentError, match="did not build it"):
        await backend.publish_template(p, ref)


async def test_a_deploy_from_a_build_is_linked_and_carries_only_its_own_job_tag(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    p = plan()
    ref = await build(backend, image, p)
    await backend.publish_template(p, ref)
    spec = CloneSpec("jdeploy1", "web01", "golden-deb", installation=INSTALLATION)
    assert (await backend.clone_mode(spec)).linked
    clone = await backend.prepare_clone(spec)
    await backend.clone(spec, clone)
    await backend.apply_identity(clone, IDENTITY)
    config = pve.cluster.vms[int(clone.vm_id)].config
    tags = tags_of(config)
    assert spec.tag in tags and p.tag not in tags
    assert {"os-debian", "profile-golden-deb"} <= tags
    assert [v.vm_id for v in await backend.find_tagged()] == [clone.vm_id]

    (version,) = await backend.template_versions()
    assert version.used_by == (clone.vm_id,)
    await backend.destroy(clone)
    (version,) = await backend.template_versions()
    assert version.used_by == ()


async def test_a_build_on_a_file_storage_is_qcow2_and_deploys_link_to_it(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    """A file storage's default disk format is raw, which no linked clone can use: the
    build asks for qcow2 there, so deploys from the template take seconds."""
    p = plan(storage="bulk-nfs")
    ref = await build(backend, image, p)
    (create,) = pve.sent("POST", CREATE)
    assert create.params["scsi0"].endswith(",format=qcow2")
    config = pve.cluster.vms[int(ref.vm_id)].config
    base = f"bulk-nfs:{ref.vm_id}/base-{ref.vm_id}-disk-0.qcow2"
    assert config["scsi0"] == f"{base},size=64M"
    await backend.publish_template(p, ref)
    spec = CloneSpec("jdeploy1", "web01", "golden-deb", installation=INSTALLATION)
    assert (await backend.clone_mode(spec)).linked
    clone = await backend.prepare_clone(spec)
    await backend.clone(spec, clone)
    disk = pve.cluster.vms[int(clone.vm_id)].config["scsi0"]
    assert disk.startswith(f"{base}/{clone.vm_id}/vm-{clone.vm_id}-disk-0.qcow2,")
    (version,) = await backend.template_versions()
    assert version.used_by == (clone.vm_id,)
    # A block storage takes no format: the build leaves it to the storage.
    other = plan("jbuild02", name="golden-lvm", storage="local-lvm")
    await build(backend, image, other)
    assert "format" not in pve.sent("POST", CREATE)[-1].params["scsi0"]


def test_a_clone_drops_the_job_tags_it_inherits() -> None:
    built = {"tags": "deploybot-labinst001-jbuild01;os-debian;profile-golden-deb"}
    assert merged_tags(built, "deploybot-labinst001-jdeploy1") == (
        "deploybot-labinst001-jdeploy1;os-debian;profile-golden-deb"
    )
    legacy = {"tags": "deploybot-jold001;deploybot-managed"}  # a human's tag stays
    assert merged_tags(legacy, "deploybot-jnew001") == "deploybot-jnew001;deploybot-managed"


# --- destroying -------------------------------------------------------------------------


async def test_destroy_removes_a_half_built_vm_and_its_upload(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    p = plan()
    target = await backend.build_preflight(p)
    ref = await backend.prepare_build(p, target)
    pve.inject("template", "task_error", message="injected: disk full")
    with pytest.raises(TaskFailed, match="disk full"):
        await backend.create_template(p, target, ref, image)
    vm = pve.cluster.vms[int(ref.vm_id)]
    assert not vm.template and list(pve.cluster.volumes) == [
        "local:import/deploybot-jbuild01.qcow2"
    ]
    assert [v.vm_id for v in await backend.find_tagged()] == [ref.vm_id]  # gc sees it
    vm.running = True  # someone started it meanwhile
    await backend.destroy_template(ref)
    assert int(ref.vm_id) not in pve.cluster.vms and pve.cluster.volumes == {}
    await backend.destroy_template(ref)  # gone already: quiet


async def test_a_crashed_build_runs_again_under_the_same_id(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    p = plan()
    target = await backend.build_preflight(p)
    ref = await backend.prepare_build(p, target)
    pve.inject("template", "task_error")
    with pytest.raises(TaskFailed):
        await backend.create_template(p, target, ref, image)
    await backend.create_template(p, target, ref, image)  # the job's retry
    assert pve.cluster.vms[int(ref.vm_id)].template and pve.cluster.volumes == {}
    assert len(pve.sent("POST", UPLOAD)) == 1  # the verified upload was used again


async def test_destroy_removes_a_template_and_refuses_one_without_the_tag(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    p = plan()
    ref = await build(backend, image, p)
    await backend.destroy_template(ref)
    assert int(ref.vm_id) not in pve.cluster.vms
    with pytest.raises(NotOurVM):
        await backend.destroy_template(VMRef("9000", "jbuild01", "pve1@lab", INSTALLATION))
    assert 9000 in pve.cluster.vms


# --- pre-flight -------------------------------------------------------------------------


async def test_preflight_refuses_x86_64_v3_on_a_node_without_avx2(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    el10 = plan(profile="rocky-10", os_family="el", cpu="x86-64-v3", placement="pve2")
    with pytest.raises(PermanentError) as refused:
        await backend.build_preflight(el10)
    message = refused.value.message
    assert "x86-64-v3" in message and "pve2" in message and "avx2" in message
    assert "try again" not in message
    assert [r for r in pve.requests if r.method != "GET"] == []
    ok = await backend.build_preflight(dataclasses.replace(el10, placement="pve1"))
    assert ok.placement == "pve1"


async def test_el10_builds_are_tagged_for_the_el10_profile(
    pve: FakePVE, backend: ProxmoxBackend, image: Path
) -> None:
    el10 = plan(profile="rocky-10", name="rocky-10-golden", os_family="el", cpu="x86-64-v3")
    ref = await build(backend, image, el10)
    config = pve.cluster.vms[int(ref.vm_id)].config
    assert "os-el10" in config["tags"] and config["cpu"] == "x86-64-v3"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"storage": "local"}, "does not hold VM disks"),
        ({"storage": "nowhere"}, "does not exist on pve1"),
        ({"name": "web-template"}, "not a template"),
        ({"name": "debian-12"}, "did not build"),
        ({"version": 7}, "golden-deb-v7 is taken by VM 700"),
    ],
)
async def test_preflight_refusals(
    pve: FakePVE, backend: ProxmoxBackend, changes: dict[str, Any], expected: str
) -> None:
    pve.cluster.add_vm(700, "golden-deb-v7")
    with pytest.raises(PermanentError, match=expected) as refused:
        await backend.build_preflight(plan(**changes))
    assert "try again" not in refused.value.message


async def test_preflight_refuses_a_node_without_an_upload_storage(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    pve.cluster.storages["local"].content = "vztmpl,backup"
    with pytest.raises(PermanentError, match="takes the image upload"):
        await backend.build_preflight(plan())


# --- real guests ------------------------------------------------------------------------


@needs_qemu_img
async def test_a_real_guest_template_disk_is_a_copy_of_the_upload(
    pve_schema: ApiSchema, pve_tls: Tls, image: Path, tmp_path: Path
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pvb-"))  # short: QEMU's unix sockets
    machines = RealMachines.factory(tmp_path, workdir)
    try:
        async with modern(pve_schema, pve_tls, machines=machines, state_dir=tmp_path) as fake:
            proxmox = make_backend(fake)
            try:
                ref = await build(proxmox, image, plan())
            finally:
                await proxmox.close()
            disk = workdir / ref.vm_id / "disk.qcow2"
            compare = await asyncio.create_subprocess_exec(
                "qemu-img", "compare", str(image), str(disk), stdout=subprocess.PIPE
            )
            said, _ = await compare.communicate()
            assert compare.returncode == 0, said.decode()
            assert "identical" in said.decode()
            assert fake.cluster.volumes == {}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
