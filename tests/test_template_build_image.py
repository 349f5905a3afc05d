"""Issue 17, first slice: build profiles, the verified download, offline customisation.

The "upstream" is a real HTTP server on 127.0.0.1 (tests/support/images.py); the images
are the real-guest lane's Debian image and its variants (tests/support/realguest/upstream.py);
libguestfs is the real one, and what it did is read back from the images' contents.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import time
from collections.abc import Awaitable
from pathlib import Path
from urllib.parse import unquote

import pytest

from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.images.customize import DATASOURCE_FILE, Accelerator, selinux_state
from bot.images.fetch import Expected, FetchError, fetch_verified, parse_sums
from bot.images.prepare import PreparedImage, PrepareError, prepare_image
from bot.images.profiles import (
    ImagesSettings,
    Platform,
    Profile,
    ProfileError,
    build_profile,
    catalogue,
)
from bot.models.errors import ConfigError
from tests.support.images import require_libguestfs, unavailable, upstream_server
from tests.support.realguest import image, qemu, upstream

SHIPPED = {"ubuntu-22.04", "ubuntu-24.04", "debian-12", "debian-13"}
SHIPPED |= {"rocky-9", "rocky-10", "alma-9", "alma-10"}


def test_shipped_catalogue_validates() -> None:
    profiles = catalogue()
    assert set(profiles) >= SHIPPED
    for name in ("rocky-10", "alma-10"):
        assert profiles[name].cpu == "x86-64-v3" and profiles[name].selinux is True
    assert profiles["debian-12"].checksum_algorithm == "sha512"  # Debian publishes SHA512SUMS
    assert profiles["debian-12"].packages == ()  # no pins shipped: pools drop old versions
    for profile in profiles.values():
        assert profile.url.startswith("https://") and profile.checksum_url
        assert profile.datasources_for("vsphere")[0] == "VMware"


def test_overrides_merge_and_errors_name_the_profile_and_key() -> None:
    settings = load_settings(
        BUNDLED_CONFIG,
        images={"profiles": {"debian-12": {"user": "admin"}, "mine": {**_mine()}}},
    )
    assert settings.images.profile("debian-12").user == "admin"
    assert settings.images.profile("debian-12").os_family == "debian"  # the rest kept
    assert settings.images.profile("mine").checksum == "sha256:" + "0" * 64
    with pytest.raises(ProfileError, match="no build profile 'debian-11'; known profiles: alma-10"):
        settings.images.profile("debian-11")
    with pytest.raises(ConfigError) as bad:
        load_settings(BUNDLED_CONFIG, images={"profiles": {"rocky-10": {"cpu": "x86-64-v4"}}})
    assert "images: profile 'rocky-10': cpu: Input should be" in str(bad.value)
    with pytest.raises(ConfigError) as both:
        load_settings(
            BUNDLED_CONFIG,
            images={"profiles": {"mine": {**_mine(), "checksum_url": "https://x.example/S"}}},
        )
    assert "profile 'mine'" in str(both.value) and "exactly one of `checksum`" in str(both.value)
    with pytest.raises(ConfigError) as digest:
        load_settings(
            BUNDLED_CONFIG, images={"profiles": {"mine": {**_mine(), "checksum": "md5:1"}}}
        )
    assert "profile 'mine': checksum: 'md5:1' is not a digest" in str(digest.value)


def test_an_override_replaces_how_a_shipped_profile_is_verified() -> None:
    """TOML cannot unset `checksum_url`: an override's fixed `checksum` replaces it (and
    the other way round), instead of the profile having both and failing to load."""
    fixed = "sha256:" + "ab" * 32
    settings = load_settings(
        BUNDLED_CONFIG,
        images={
            "profiles": {
                "debian-12": {"url": "https://mirror.example.org/d12.qcow2", "checksum": fixed},
                "mine": {**_mine()},
            }
        },
    )
    pinned = settings.images.profile("debian-12")
    assert (pinned.checksum, pinned.checksum_url) == (fixed, None)
    assert pinned.user == "debian"  # the rest kept
    sums = "https://mirror.example.org/SUMS"
    with pytest.raises(ValueError, match="exactly one of `checksum`"):
        ImagesSettings(profiles={"mine": {**_mine(), "checksum_url": sums}})  # both: refused
    shipped = ImagesSettings(profiles={"debian-12": {"checksum_url": sums}})
    assert (shipped.profile("debian-12").checksum_url, shipped.profile("debian-12").checksum) == (
        sums,
        None,
    )


def _mine() -> dict[str, object]:
    return {
        "os_family": "debian",
        "version": "12",
        "url": "https://images.example.org/mine.qcow2",
        "checksum": "SHA256:" + "0" * 64,
        "user": "debian",
    }


def test_checksum_file_formats() -> None:
    digest = "ab" * 32
    gnu = f"{'cd' * 32}  other.img\n{digest} *ubuntu.img\n"
    assert parse_sums(gnu, "ubuntu.img", "sha256") == digest
    bsd = f"# Rocky\nSHA256 (Rocky.qcow2) = {digest.upper()}\n"
    assert parse_sums(bsd, "Rocky.qcow2", "sha256") == digest
    assert parse_sums(f"{digest}  ./x.qcow2\n", "x.qcow2", "sha256") == digest
    assert parse_sums(gnu, "missing.img", "sha256") is None
    assert parse_sums(gnu, "ubuntu.img", "sha512") is None  # a 64-digit line is no sha512


def _leftovers(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


async def test_fetch_verifies_caches_and_refuses(tmp_path: Path) -> None:
    body = os.urandom(3 * (1 << 20) + 17)
    good = Expected("sha256", hashlib.sha256(body).hexdigest())
    async with upstream_server() as mirror:
        mirror.files["disk.img"] = body
        path = await fetch_verified(mirror.link("disk.img"), good, tmp_path)
        assert path == tmp_path / "sha256" / good.hexdigest and path.read_bytes() == body
        assert path.stat().st_mode & 0o777 == 0o644
        again = await fetch_verified(mirror.link("disk.img"), good, tmp_path)
        assert again == path and mirror.hits["disk.img"] == 1  # reused, not downloaded

        wrong = Expected("sha256", "0" * 64)
        bad_cache = tmp_path / "bad"
        with pytest.raises(FetchError, match="does not match its checksum") as refused:
            await fetch_verified(mirror.link("disk.img"), wrong, bad_cache)
        assert "expected sha256:000" in str(refused.value)
        assert _leftovers(bad_cache) == []  # no partial file, nothing under the digest

        with pytest.raises(FetchError, match="nothing was kept") as cut:
            await fetch_verified(mirror.link("cut/disk.img"), good, bad_cache)
        assert mirror.hits["cut/disk.img"] == 1 and "disk.img" in str(cut.value)
        assert _leftovers(bad_cache) == []

        secret = mirror.url.replace("://", "://deploy:s3cret-pw@")
        with pytest.raises(FetchError, match="HTTP 404") as gone:
            await fetch_verified(f"{secret}/gone.img", good, bad_cache)
        assert "s3cret-pw" not in str(gone.value) and mirror.link("gone.img") in str(gone.value)


# libguestfs: the variants fetched, verified and customised for Proxmox, all at once.


def _accelerator(tmp_path: Path) -> Accelerator:
    eni = image.built(image.ENI)
    assert eni is not None
    return "kvm" if qemu.accelerator(eni, tmp_path) == qemu.KVM else "tcg"


def _profile(name: str, mirror_url: str, **extra: object) -> Profile:
    return build_profile(
        f"test-{name}",
        {
            "os_family": "debian",
            "version": "12",
            "url": f"{mirror_url}/{name}.qcow2",
            "checksum_url": f"{mirror_url}/SHA256SUMS",
            "user": "debian",
            **extra,
        },
    )


@pytest.fixture
def variants() -> Path:
    require_libguestfs()
    if image.built(image.ENI) is None:
        unavailable(f"no eni guest image in {image.image_dir(image.ENI)}: run `make guest-image`")
    folder = upstream.built()
    if folder is None:
        unavailable(f"no upstream variants in {upstream.folder()}: run `make guest-image`")
    return folder


async def test_wrong_checksum_refuses_the_build(variants: Path, tmp_path: Path) -> None:
    async with upstream_server() as mirror:
        sums = (variants / "SHA256SUMS").read_text().replace("vmware.qcow2", "other.qcow2")
        mirror.files["SHA256SUMS"] = f"{'1' * 64}  vmware.qcow2\n{sums}".encode()
        mirror.files["vmware.qcow2"] = variants / "vmware.qcow2"
        with pytest.raises(FetchError, match=r"vmware\.qcow2 does not match its checksum"):
            await prepare_image(_profile("vmware", mirror.url), tmp_path / "cache")
        assert mirror.hits["vmware.qcow2"] == 1
    assert _leftovers(tmp_path / "cache") == []


def _read_back(disks: dict[str, Path], accel: Accelerator) -> dict[str, str]:
    """One read-only guestfish session over all disks: what each holds now."""
    script = ["run"]
    for index, name in enumerate(disks):
        script += [
            f"mount-ro /dev/sd{chr(ord('a') + index)} /",
            f"echo =={name}:autorelabel",
            "exists /.autorelabel",
            f"echo =={name}:datasources",
            f"-cat {DATASOURCE_FILE}",
            f"echo =={name}:agent",
            "exists /usr/sbin/qemu-ga",
            f"echo =={name}:status",
            "cat /var/lib/dpkg/status",
            f"echo =={name}:uploads",
            "exists /var/tmp/deploybot-packages",
            "umount /",
        ]
    argv = ["guestfish", "--ro"]
    for disk in disks.values():
        argv += ["--format=qcow2", "-a", str(disk)]
    out = subprocess.run(
        argv, input="\n".join(script) + "\n", text=True, capture_output=True, check=True,
        env=upstream.libguestfs_env(accel), timeout=900,
    ).stdout  # fmt: skip
    parts: dict[str, list[str]] = {}
    key = ""
    for line in out.splitlines():
        if line.startswith("=="):
            key = line[2:]
            parts[key] = []
        elif key:
            parts[key].append(line)
    return {k: "\n".join(v).strip() for k, v in parts.items()}


def _dpkg_status(status: str, package: str) -> str:
    """The `Status:` dpkg records for `package` in /var/lib/dpkg/status ("" if none)."""
    for stanza in status.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Package") == package:
            return fields.get("Status", "")
    return ""


async def _refused(work: Awaitable[PreparedImage]) -> PrepareError:
    try:
        await work
    except PrepareError as exc:
        return exc
    raise AssertionError("prepare_image did not refuse")


async def test_customised_offline(variants: Path, tmp_path: Path) -> None:
    accel = _accelerator(tmp_path)
    cache = tmp_path / "cache"
    heard: list[str] = []

    async def progress(line: str) -> None:
        heard.append(line)

    async with upstream_server() as mirror:
        mirror.files["SHA256SUMS"] = variants / "SHA256SUMS"
        for name in upstream.RECIPES:
            mirror.files[f"{name}.qcow2"] = variants / f"{name}.qcow2"
        packages = []
        for deb in upstream.agent_debs():
            mirror.files[f"debs/{unquote(deb.name)}"] = deb  # apt's %3a is the epoch's colon
            digest = hashlib.sha256(deb.read_bytes()).hexdigest()
            packages.append(
                {"url": mirror.link(f"debs/{deb.name}"), "checksum": f"sha256:{digest}"}
            )
        # name: (profile, the platform it is prepared for)
        # The test images carry qemu-guest-agent, not open-vm-tools: the SELinux one is
        # prepared for vSphere (its datasource) checking for the agent it has; the
        # default vSphere agent is checked by the refusal below.
        selinux_on_vsphere = _profile("selinux", mirror.url).model_copy(
            update={"vsphere_agent_package": "qemu-guest-agent"}
        )
        profiles: dict[str, tuple[Profile, Platform]] = {
            "selinux": (selinux_on_vsphere, "vsphere"),
            "vmware": (_profile("vmware", mirror.url), "proxmox"),
            "noagent": (_profile("noagent", mirror.url, packages=packages), "proxmox"),
        }
        started = time.monotonic()
        async with asyncio.TaskGroup() as group:
            # The same image with no package files to add: refused once it is read.
            bare = _profile("noagent", mirror.url).model_copy(update={"name": "test-bare"})
            refusal = group.create_task(
                _refused(prepare_image(bare, cache, "proxmox", accelerator=accel))
            )
            # On vSphere the agent is VMware Tools, which none of the images has.
            tools = _profile("vmware", mirror.url).model_copy(update={"name": "test-tools"})
            no_tools = group.create_task(
                _refused(prepare_image(tools, cache, "vsphere", accelerator=accel))
            )
            tasks = [
                group.create_task(prepare_image(p, cache, on, accelerator=accel, progress=progress))
                for p, on in profiles.values()
            ]
        results = [task.result() for task in tasks]
        took = time.monotonic() - started
    done: dict[str, PreparedImage] = dict(zip(profiles, results, strict=True))
    print(f"three images prepared at once in {took:.0f} s ({accel})")
    assert str(refusal.result()) == (
        "the test-bare image has no qemu-guest-agent and the profile lists no package files "
        "to add: set `packages` in [images.profiles.test-bare] to the agent's package file "
        "and its dependencies (URL and sha256 each)"
    )
    assert str(no_tools.result()).startswith(
        "the test-tools image has no open-vm-tools and the profile lists no package files "
        "to add: set `vsphere_packages` in [images.profiles.test-tools]"
    )

    selinux, vmware, noagent = done["selinux"], done["vmware"], done["noagent"]
    assert selinux.selinux_detected and selinux.selinux_relabelled
    assert not vmware.selinux_relabelled and not noagent.selinux_relabelled
    assert any(
        n.startswith("SELinux policy detected") and n.endswith("will relabel") for n in heard
    )
    assert vmware.datasource_list_before == ("VMware",) and vmware.datasources_unpinned
    assert vmware.datasource_list == ("NoCloud", "ConfigDrive", "VMware", "None")
    # The eni image's own pin, [NoCloud, None], leaves out vSphere's VMware.
    assert selinux.datasource_list_before == ("NoCloud", "None") and selinux.datasources_unpinned
    assert selinux.datasource_list == ("VMware", "NoCloud", "ConfigDrive", "None")
    assert (
        noagent.datasource_list_before == ("NoCloud", "None") and not noagent.datasources_unpinned
    )
    assert noagent.agent_installed and not noagent.agent_was_present
    assert selinux.agent_was_present and not selinux.agent_installed

    contents = _read_back({name: result.path for name, result in done.items()}, accel)
    assert contents["selinux:autorelabel"] == "true"
    assert contents["vmware:autorelabel"] == contents["noagent:autorelabel"] == "false"
    assert "datasource_list: [NoCloud, ConfigDrive, VMware, None]" in contents["vmware:datasources"]
    assert (
        "datasource_list: [VMware, NoCloud, ConfigDrive, None]" in contents["selinux:datasources"]
    )
    assert contents["noagent:datasources"] == ""
    assert contents["noagent:agent"] == "true"
    assert _dpkg_status(contents["noagent:status"], "qemu-guest-agent") == "install ok installed"
    assert contents["noagent:uploads"] == "false"
    # The upstream files in the cache are the verified originals, untouched.
    for name, result in done.items():
        with result.source.open("rb") as original:
            assert original.read(4) == b"QFI\xfb"
        assert result.source_digest.split(":")[1] in (variants / "SHA256SUMS").read_text()
        assert result.path.name.startswith(f"test-{name}-{result.platform}-")
    # No working folders left, nor anything of the refused build.
    assert sorted(p.name.split("-")[1] for p in (cache / "prepared").iterdir()) == [
        "noagent", "selinux", "vmware",
    ]  # fmt: skip


def test_selinux_detection_rules() -> None:
    files = "targeted\ntargeted/policy\ntargeted/policy/policy.33"
    assert selinux_state("SELINUX=enforcing\nSELINUXTYPE=targeted\n", files)[0]
    assert selinux_state("SELINUX=permissive\n", files)[0]
    assert not selinux_state("SELINUX=disabled\nSELINUXTYPE=targeted\n", files)[0]
    assert not selinux_state("SELINUX=enforcing\nSELINUXTYPE=mls\n", files)[0]
    assert not selinux_state("", "")[0]


def test_images_section_defaults() -> None:
    assert ImagesSettings().all_profiles().keys() == catalogue().keys()
