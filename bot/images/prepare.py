"""From a build profile to a verified, customised qcow2 on the bot host.

`prepare_image` is what the template build calls before it uploads anything: fetch the
upstream image (verified against its checksum, cached by digest), fetch the profile's
package files the same way, convert the image to a qcow2 working copy (the cached
original is never changed), read it, customise it, and say what was found and done
(`PreparedImage`). The working copy becomes `PreparedImage.path` only when everything
worked; a failure leaves no output behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bot.images import customize as lg
from bot.images.fetch import Expected, Timeouts, expected_from_sums, fetch_verified
from bot.images.profiles import PLATFORM_DATASOURCE, Platform, Profile

log = logging.getLogger(__name__)

Progress = Callable[[str], Awaitable[None]]


class PrepareError(lg.CustomizeError):
    """The image cannot be prepared as the profile stands; says what to change."""


@dataclass(frozen=True)
class PreparedImage:
    """A customised qcow2 ready for upload, and what was detected and done to it."""

    profile: str
    platform: Platform
    path: Path  # the customised qcow2 (the caller owns it)
    source: Path  # the verified upstream image in the cache
    source_digest: str  # "sha256:<hex>"
    selinux_detected: bool
    selinux_relabelled: bool
    agent_was_present: bool
    agent_installed: bool  # installed offline from the profile's packages
    datasource_list_before: tuple[str, ...] | None  # None: not pinned
    datasource_list: tuple[str, ...] | None  # what cloud-init now ends with
    datasources_unpinned: bool
    notes: tuple[str, ...]  # what was detected and done, in words for a person
    # Whether the image differs from the upstream file. An unchanged qcow2 need not be
    # uploaded: the hypervisor may fetch and verify the upstream file itself.
    changed: bool = True


async def _say(progress: Progress | None, notes: list[str], line: str) -> None:
    notes.append(line)
    log.info("prepare image: %s", line)
    if progress is not None:
        await progress(line)


async def _convert(source: Path, fmt: str, target: Path, timeout_s: float) -> None:
    argv = ["qemu-img", "convert", "-f", fmt, "-O", "qcow2", str(source), str(target)]
    try:
        code, _, err = await lg.run_process(argv, timeout_s)
    except TimeoutError:
        raise PrepareError(f"converting the image took longer than {timeout_s:.0f} s") from None
    if code != 0:
        log.error("%s failed (%s): %s", " ".join(argv), code, err.strip())
        raise PrepareError(
            f"qemu-img could not read the image as {fmt}: check the profile's format; "
            "the log has qemu-img's message"
        )


def _extract_vmdk(ova: Path, into: Path) -> Path:
    """The first disk of an OVA (a tar holding an .ovf and .vmdk files)."""
    with tarfile.open(ova) as tar:
        disks = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".vmdk")]
        if not disks:
            raise PrepareError(f"{ova.name}: the OVA holds no .vmdk disk")
        source = tar.extractfile(disks[0])
        assert source is not None  # a regular file
        target = into / "disk.vmdk"
        with source, target.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    return target


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


async def _verified_source(profile: Profile, cache: Path, timeouts: Timeouts) -> tuple[Path, str]:
    if profile.checksum is not None:
        expected = Expected.parse(profile.checksum)
    else:
        assert profile.checksum_url is not None  # the model wants one of the two
        expected = await expected_from_sums(
            profile.checksum_url, profile.file_name, profile.checksum_algorithm, timeouts
        )
    return await fetch_verified(profile.url, expected, cache, timeouts), str(expected)


async def prepare_image(
    profile: Profile,
    cache_dir: Path,
    platform: Platform = "proxmox",
    *,
    accelerator: lg.Accelerator = "auto",
    timeouts: Timeouts | None = None,
    customize_timeout_s: float = 1800,
    progress: Progress | None = None,
) -> PreparedImage:
    """Fetch, verify and customise `profile`'s image for `platform`.

    The result is a new qcow2 in `cache_dir/prepared/` that the caller uploads and then
    deletes. Raises `FetchError` (download, checksum) or `CustomizeError` (libguestfs),
    both with a message for a person; nothing half-made is left in the cache.
    """
    if missing := lg.missing_tools():
        raise PrepareError(
            f"{', '.join(missing)} missing on the bot host: install Debian's libguestfs-tools "
            "(and a kernel package, linux-image-amd64, for its appliance)"
        )
    timeouts = timeouts or Timeouts()
    notes: list[str] = []
    downloads = cache_dir / "downloads"
    source, digest = await _verified_source(profile, downloads, timeouts)
    await _say(progress, notes, f"{profile.file_name} verified ({digest[:19]}…)")
    agent_package, agent_files, packages_key = profile.agent_for(platform)
    packages = [
        (
            package.file_name,
            await fetch_verified(
                package.url, Expected.parse(package.checksum), downloads, timeouts
            ),
        )
        for package in agent_files
    ]
    out_dir = cache_dir / "prepared"
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".{profile.name}-"))
    try:
        disk = work / "disk.qcow2"
        origin, fmt = source, profile.format
        if fmt == "ova":
            origin, fmt = await asyncio.to_thread(_extract_vmdk, source, work), "vmdk"
        await _convert(origin, fmt, disk, customize_timeout_s)
        agent_paths = lg.AGENT_PROGRAMS[agent_package]
        found = await lg.inspect(disk, accelerator, customize_timeout_s, work, agent_paths)
        relabel = found.selinux if profile.selinux == "detect" else profile.selinux
        if profile.selinux != "detect" and profile.selinux != found.selinux:
            log.warning(
                "profile %s says selinux=%s but the image has %s: following the profile",
                profile.name, profile.selinux, found.selinux_reason,
            )  # fmt: skip
        if found.selinux:
            await _say(
                progress, notes, f"SELinux policy detected ({found.selinux_reason}): will relabel"
            )
        else:
            await _say(progress, notes, f"no SELinux policy ({found.selinux_reason})")
        to_install: tuple[Path, ...] = ()
        if found.agent:
            await _say(progress, notes, f"{agent_package} is already installed")
        elif not packages:
            raise PrepareError(
                f"the {profile.name} image has no {agent_package} and the profile "
                f"lists no package files to add: set `{packages_key}` in "
                f"[images.profiles.{profile.name}] to the agent's package file and "
                "its dependencies (URL and sha256 each)"
            )
        else:
            local = work / "packages"
            local.mkdir()
            for index, (name, path) in enumerate(packages):
                # The file's own name, made safe for virt-customize's `--upload FROM:TO`
                # and the shell's glob, with the suffix dpkg or rpm is given.
                safe = re.sub(r"[^A-Za-z0-9._+-]", "_", name).removesuffix(".")
                suffix = f".{profile.package_format}"
                _link(path, local / f"{index:02d}-{safe.removesuffix(suffix)}{suffix}")
            to_install = tuple(sorted(local.iterdir()))
            names = ", ".join(p.name for p in to_install)
            await _say(progress, notes, f"installing {agent_package} offline from {names}")
        wanted = PLATFORM_DATASOURCE[platform]
        pinned = found.datasource_list
        unpin = pinned is not None and wanted not in pinned
        new_list = profile.datasources_for(platform) if unpin else pinned
        if unpin:
            await _say(
                progress, notes,
                f"cloud-init is pinned to [{', '.join(pinned or ())}] in {found.datasource_file}, "
                f"without {wanted}: allowing [{', '.join(new_list or ())}]",
            )  # fmt: skip
        changes = lg.Changes(
            packages=to_install,
            package_format=profile.package_format,
            datasource_list=new_list if unpin else None,
            selinux_relabel=bool(relabel),
        )
        await lg.customize(disk, changes, accelerator, customize_timeout_s, work)
        final = out_dir / f"{profile.name}-{platform}-{digest.split(':')[1][:16]}.qcow2"
        os.replace(disk, final)
        if changes:
            await _say(progress, notes, f"customised image ready: {final.name}")
        else:
            await _say(progress, notes, "the image needs no change")
        return PreparedImage(
            profile=profile.name,
            platform=platform,
            path=final,
            source=source,
            source_digest=digest,
            selinux_detected=found.selinux,
            selinux_relabelled=bool(relabel),
            agent_was_present=found.agent,
            agent_installed=bool(to_install),
            datasource_list_before=pinned,
            datasource_list=new_list,
            datasources_unpinned=unpin,
            notes=tuple(notes),
            changed=bool(changes),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
