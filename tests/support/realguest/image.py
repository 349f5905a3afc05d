"""Build the Debian 12 guest images the real-guest tests boot:
`python -m tests.support.realguest.image`.

Two variants: `eni` (ifupdown + resolvconf: what Debian's cloud-init renders) and
`netplan` (netplan.io + systemd-networkd + systemd-resolved, cloud-init told to render
netplan: the Ubuntu way). Each is made once and kept in ~/.cache/deploybot/guest-<key>/
or guest-netplan-<key>/ ($DEPLOYBOT_CACHE moves it): `disk.qcow2`, `vmlinuz`,
`initrd.img`. The netplan build reuses the ENI build's downloaded packages. The key
hashes everything below that decides an image's content (suite, packages, the files and
links written into it), so a change here builds a new one and an unchanged one is
reused. Needs root (debootstrap creates device nodes and chowns files) and the network
(Debian's mirror, read from /etc/apt/sources.list*), so CI runs it in the install phase,
before the tests go offline.

No mounts: debootstrap fills a folder, `mkfs.ext4 -d` turns the folder into a
filesystem image and `qemu-img convert` makes the sparse qcow2. The filesystem has no
partition table (root=/dev/vda) and the guest is booted with its own kernel and initrd,
extracted beside the disk, so no boot loader is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUITE = "bookworm"

# debootstrap's resolver takes no virtual packages and no alternatives beyond the first,
# so what a real install would pull in that way is named here.
PACKAGES = (
    "linux-image-amd64",
    "initramfs-tools",  # linux-image's "initramfs-tools | linux-initramfs-tool"
    "systemd-sysv",
    "udev",  # loads the virtio drivers and names the NIC
    "dbus",  # without it systemctl (cloud-init's) and qga's guest-shutdown fail
    "cloud-init",
    "python3-cffi-backend",  # virtual python3-cffi-backend-api-* that cloud-init needs
    "openssh-server",
    "qemu-guest-agent",
    "ifupdown",  # Debian 12's cloud-init renders ENI first
    "resolvconf",  # turns ENI's dns-nameservers into /etc/resolv.conf
    "iproute2",
    "netbase",
    "sudo",  # the default user's sudo rule
)

# Files written into the image, path -> content.
FILES: dict[str, str] = {
    # NoCloud is what Proxmox gives; None rather than probing for a metadata service.
    "etc/cloud/cloud.cfg.d/90-deploybot.cfg": (
        "datasource_list: [NoCloud, None]\n"
        "locale: C.UTF-8\n"  # minbase has no en_US.UTF-8 to generate
        "manage_etc_hosts: true\n"
    ),
    # qemu-guest-agent waits for sysinit.target by default, i.e. for cloud-init's
    # network stage (which runs before it): the agent answers at ~75 s under TCG instead
    # of ~40 s. It needs only its virtio port, so it may start as soon as udev shows it.
    "etc/systemd/system/qemu-guest-agent.service.d/early.conf": (
        "[Unit]\n"
        "DefaultDependencies=no\n"
        "Before=cloud-init.service\n"
        "Conflicts=shutdown.target\n"
        "Before=shutdown.target\n"
    ),
    "etc/fstab": "/dev/vda / ext4 defaults 0 0\n",
    "etc/hostname": "debian\n",
    # Each clone must get its own: systemd makes one at first boot when it is empty.
    "etc/machine-id": "",
}

# The netplan variant (`NETPLAN`): an Ubuntu-like guest whose cloud-init renders netplan,
# which systemd-networkd applies, with systemd-resolved for DNS; no ifupdown/resolvconf
# (systemd-resolved conflicts with resolvconf, and cloud-init would pick ENI first).
_NETPLAN_PACKAGES = (
    *(p for p in PACKAGES if p not in ("ifupdown", "resolvconf")),
    "netplan.io",
    "systemd-resolved",
)
_NETPLAN_CFG = (
    FILES["etc/cloud/cloud.cfg.d/90-deploybot.cfg"]
    + "system_info:\n  network:\n    renderers: [netplan]\n"  # Ubuntu's cloud.cfg has it
)
_UNITS = "/lib/systemd/system"
_WANTS = "etc/systemd/system"
_MULTI = f"{_WANTS}/multi-user.target.wants"
# `systemctl enable systemd-networkd systemd-resolved` as links (Debian ships networkd
# disabled); resolv.conf is resolved's stub, as on Ubuntu.
_NETPLAN_LINKS = {
    f"{_MULTI}/systemd-networkd.service": f"{_UNITS}/systemd-networkd.service",
    f"{_WANTS}/sockets.target.wants/systemd-networkd.socket": f"{_UNITS}/systemd-networkd.socket",
    f"{_WANTS}/network-online.target.wants/systemd-networkd-wait-online.service": (
        f"{_UNITS}/systemd-networkd-wait-online.service"
    ),
    f"{_WANTS}/dbus-org.freedesktop.network1.service": f"{_UNITS}/systemd-networkd.service",
    f"{_MULTI}/systemd-resolved.service": f"{_UNITS}/systemd-resolved.service",
    f"{_WANTS}/dbus-org.freedesktop.resolve1.service": f"{_UNITS}/systemd-resolved.service",
    "etc/resolv.conf": "../run/systemd/resolve/stub-resolv.conf",
}


@dataclass(frozen=True)
class Variant:
    """One image: its packages, the files written into it and symlinks (path -> target)."""

    name: str
    packages: tuple[str, ...]
    files: dict[str, str]
    links: dict[str, str] = field(default_factory=dict)


ENI = Variant("eni", PACKAGES, FILES)
NETPLAN = Variant(
    "netplan",
    _NETPLAN_PACKAGES,
    {**FILES, "etc/cloud/cloud.cfg.d/90-deploybot.cfg": _NETPLAN_CFG},
    _NETPLAN_LINKS,
)
VARIANTS = {v.name: v for v in (ENI, NETPLAN)}

DISK_SIZE = "3G"  # the guest's disk; the qcow2 only holds what is used (~0.8 GiB)
# The same cache as the NetBox install's (tests/support/netbox/install.py).
CACHE = Path(
    os.environ.get("DEPLOYBOT_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deploybot"
)


def cache_key(variant: Variant = ENI) -> str:
    """A hash of what decides the image's content (not of this file's wording)."""
    inputs: dict[str, object] = {
        "suite": SUITE,
        "packages": variant.packages,
        "files": variant.files,
        "size": DISK_SIZE,
        "v": 1,
    }
    if variant.links:  # the ENI image's key is the one it had before variants existed
        inputs["links"] = variant.links
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def image_dir(variant: Variant = ENI) -> Path:
    prefix = "guest" if variant is ENI else f"guest-{variant.name}"
    return CACHE / f"{prefix}-{cache_key(variant)}"


def built(variant: Variant = ENI) -> Path | None:
    """The image's folder when it is complete (the build renames it into place last)."""
    path = image_dir(variant)
    names = ("disk.qcow2", "vmlinuz", "initrd.img")
    return path if all((path / name).is_file() for name in names) else None


def _sources() -> list[str]:
    paths = [Path("/etc/apt/sources.list")]
    parts = Path("/etc/apt/sources.list.d")
    if parts.is_dir():
        paths += sorted(parts.iterdir())
    return [p.read_text() for p in paths if p.is_file()]


def mirror(texts: list[str] | None = None) -> str:
    """The Debian mirror this machine's apt uses for SUITE (one-line or deb822 format)."""
    for text in _sources() if texts is None else texts:
        # One-line format: `deb [options] URI SUITE COMPONENTS...`
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", " ", line.split("#")[0]).split()
            if len(words) >= 4 and words[0] == "deb" and words[2] == SUITE and "main" in words:
                return words[1]
        # deb822: paragraphs of `Key: value`
        for paragraph in re.split(r"\n\s*\n", text):
            fields: dict[str, list[str]] = {}
            for line in paragraph.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.split()
            if (
                "deb" in fields.get("types", [])
                and SUITE in fields.get("suites", [])
                and "main" in fields.get("components", [])
                and fields.get("uris")
            ):
                return fields["uris"][0]
    raise SystemExit(f"no `deb ... {SUITE} main` source in /etc/apt/sources.list*")


def _run(*argv: str | Path) -> None:
    print("+", " ".join(str(a) for a in argv), flush=True)
    subprocess.run([str(a) for a in argv], check=True)


def _prepare(root: Path, variant: Variant) -> None:
    """Make the debootstrapped tree a template: config in, per-machine state out."""
    for name, content in variant.files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    for name, target in variant.links.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to(target)
    # dbus keeps its own machine-id as a link to /etc/machine-id; a copy would be shared.
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() and not dbus_id.is_symlink():
        dbus_id.unlink()
    # Host keys made by openssh-server's postinst would be every clone's: cloud-init
    # makes new ones at first boot (before ssh.service starts).
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    # Package caches are not needed in a guest; the API filesystems are mounted over
    # these folders at boot.
    for folder in ("var/cache/apt/archives", "var/lib/apt/lists", "dev", "proc", "sys", "run"):
        for entry in (root / folder).glob("*"):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _kernel(root: Path, out: Path) -> None:
    """The guest's own kernel and initrd, for QEMU's direct kernel boot."""
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if len(kernels) != 1 or len(initrds) != 1:
        raise SystemExit(f"expected one kernel and one initrd in /boot: {kernels} {initrds}")
    shutil.copyfile(kernels[0], out / "vmlinuz")
    shutil.copyfile(initrds[0], out / "initrd.img")


def build(variant: Variant = ENI, force: bool = False) -> Path:
    """Build the image unless it is cached; return its folder."""
    if not force and (done := built(variant)) is not None:
        print(f"guest image ({variant.name}): cached in {done}")
        return done
    for tool in ("debootstrap", "mkfs.ext4", "qemu-img"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing (apt-get install debootstrap qemu-utils)")
    final = image_dir(variant)
    work = final.with_name(final.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    root = work / "root"
    root.mkdir(parents=True)
    debs = CACHE / "debootstrap-debs"  # reused by a local rebuild; CI starts cold
    debs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _run(
        "debootstrap",
        "--variant=minbase",
        "--components=main",
        f"--include={','.join(variant.packages)}",
        f"--cache-dir={debs}",
        SUITE,
        root,
        mirror(),
    )
    bootstrapped = time.monotonic()
    _kernel(root, work)
    _prepare(root, variant)
    raw = work / "disk.raw"
    _run("mkfs.ext4", "-q", "-L", "root", "-d", root, raw, DISK_SIZE)
    _run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, work / "disk.qcow2")
    raw.unlink()
    shutil.rmtree(root)
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    size = (final / "disk.qcow2").stat().st_size / 2**20
    print(
        f"guest image ({variant.name}): {final} ({size:.0f} MiB qcow2); debootstrap "
        f"{bootstrapped - started:.0f} s, total {time.monotonic() - started:.0f} s"
    )
    return final


if __name__ == "__main__":
    # Every variant unless named: `python -m tests.support.realguest.image [--force] [eni|netplan]`
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(VARIANTS)
    for name in names:
        build(VARIANTS[name], force="--force" in sys.argv[1:])
