"""The "upstream images" of the template-build tests: variants of the real-guest lane's
`eni` image, as a distribution would publish them. `python -m tests.support.realguest.upstream`

- `selinux`: an SELinux policy set enforcing (/etc/selinux/config, a policy file under
  /etc/selinux/targeted/policy/, and /usr/sbin/load_policy, which is what libguestfs
  looks for before it relabels); the files only, no real policy: enough to detect it.
- `vmware`: cloud-init pinned to `datasource_list: [VMware]` (a VMware-built image).
- `noagent`: qemu-guest-agent purged with dpkg (its libraries stay, as in a cloud image
  that never had it).

Each is a full qcow2 copy of the eni disk, changed in one guestfish session for all three
(one appliance boot), kept in ~/.cache/deploybot/upstream-<key>/<variant>.qcow2. The key
hashes the eni image's key and the changes below, so an unchanged recipe is reused.
Needs libguestfs-tools and a kernel for its appliance; no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.support.realguest import image

SELINUX_CONFIG = "SELINUX=enforcing\nSELINUXTYPE=targeted\n"
VMWARE_CFG = "datasource_list: [VMware]\nlocale: C.UTF-8\nmanage_etc_hosts: true\n"
# guestfish commands per variant, run with the variant's root filesystem mounted on /.
RECIPES: dict[str, list[str]] = {
    "selinux": [
        "mkdir-p /etc/selinux/targeted/policy",
        "mkdir-p /etc/selinux/targeted/contexts/files",
        f"write /etc/selinux/config {json.dumps(SELINUX_CONFIG)}",
        'write /etc/selinux/targeted/policy/policy.33 "not a real policy"',
        'write /usr/sbin/load_policy "#!/bin/sh\\nexit 0\\n"',
        "chmod 0755 /usr/sbin/load_policy",
    ],
    "vmware": [f"write /etc/cloud/cloud.cfg.d/90-deploybot.cfg {json.dumps(VMWARE_CFG)}"],
    "noagent": ["command 'dpkg --purge qemu-guest-agent'"],
}
# The agent's package and its dependencies, as in the debootstrap cache: the noagent
# variant's profile installs them offline (its libraries stay installed: dpkg -i of the
# same version is a reinstall).
AGENT_DEBS = ("qemu-guest-agent_", "libglib2.0-0_", "libnuma1_", "liburing2_")


def cache_key() -> str:
    blob = json.dumps({"eni": image.cache_key(image.ENI), "recipes": RECIPES, "v": 1})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def folder() -> Path:
    return image.CACHE / f"upstream-{cache_key()}"


def built() -> Path | None:
    path = folder()
    names = [f"{v}.qcow2" for v in RECIPES] + ["SHA256SUMS"]
    return path if all((path / name).is_file() for name in names) else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def agent_debs() -> list[Path]:
    """The agent's .deb and its dependencies from the debootstrap cache (one each)."""
    debs = image.CACHE / "debootstrap-debs"
    found = []
    for prefix in AGENT_DEBS:
        matches = sorted(debs.glob(f"{prefix}*_amd64.deb"))
        if len(matches) != 1:
            raise FileNotFoundError(f"expected one {prefix}*.deb in {debs}, found {matches}")
        found.append(matches[0])
    return found


def libguestfs_env(accel: str | None = None) -> dict[str, str]:
    """The direct backend, and TCG unless `accel` (else $DEPLOYBOT_QEMU_ACCEL) is kvm."""
    env = dict(os.environ, LIBGUESTFS_BACKEND="direct")
    if (accel or os.environ.get("DEPLOYBOT_QEMU_ACCEL", "tcg")) == "tcg":
        env["LIBGUESTFS_BACKEND_SETTINGS"] = "force_tcg"  # this machine's /dev/kvm cannot
    return env


def build(force: bool = False) -> Path:
    if not force and (done := built()) is not None:
        print(f"upstream variants: cached in {done}")
        return done
    base = image.built(image.ENI)
    if base is None:
        raise SystemExit(
            "no eni guest image: run `python -m tests.support.realguest.image eni` first"
        )
    for tool in ("guestfish", "qemu-img"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing (apt-get install libguestfs-tools qemu-utils)")
    started = time.monotonic()
    final = folder()
    work = final.with_name(final.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    script = []
    argv = ["guestfish", "--rw"]
    for index, name in enumerate(RECIPES):
        disk = work / f"{name}.qcow2"
        subprocess.run(
            ["qemu-img", "convert", "-O", "qcow2", str(base / "disk.qcow2"), str(disk)],
            check=True,
        )
        argv += ["--format=qcow2", "-a", str(disk)]
        device = f"/dev/sd{chr(ord('a') + index)}"
        script += [f"mount {device} /", *RECIPES[name], "umount /"]
    script = ["run", *script]
    print("+", " ".join(argv), flush=True)
    subprocess.run(
        argv, input="\n".join(script) + "\n", text=True, check=True, env=libguestfs_env()
    )
    sums = [f"{_sha256(work / f'{name}.qcow2')}  {name}.qcow2\n" for name in RECIPES]
    (work / "SHA256SUMS").write_text("".join(sums))
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    print(f"upstream variants: {final} in {time.monotonic() - started:.0f} s")
    return final


if __name__ == "__main__":
    build(force="--force" in sys.argv[1:])
