"""Offline customisation of a disk image with libguestfs (Debian's `libguestfs-tools`).

Two appliance boots per image: `inspect` reads what the image holds (guestfish,
read-only): its SELinux configuration, whether qemu-guest-agent is there, and cloud-init's
configuration; `customize` then changes it in one `virt-customize` run, with the
appliance's network off: the agent installed from package files uploaded into the image,
a datasource list that excludes the target platform's datasource un-pinned, and
`--selinux-relabel` exactly when the image has an SELinux policy.

The tools run as subprocesses of the event loop with a timeout; their output goes to the
log, never into a message for a person (a `CustomizeError` says what failed and where to
look). libguestfs boots its appliance with KVM when /dev/kvm is there; where that device
cannot run a kernel (nested virtualisation), `accelerator="tcg"` forces TCG.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from bot.models.errors import UserError

log = logging.getLogger(__name__)

Accelerator = Literal["auto", "kvm", "tcg"]
TOOLS = ("guestfish", "virt-customize")
PACKAGE_DIR = "/var/tmp/deploybot-packages"
# Sorts after any name a distribution or an image builder gives its cloud.cfg.d files, so
# its datasource_list is the one cloud-init ends with.
DATASOURCE_FILE = "/etc/cloud/cloud.cfg.d/zz-deploybot-datasources.cfg"
AGENT_PATHS = ("/usr/sbin/qemu-ga", "/usr/bin/qemu-ga")
# The programs that show an agent package is installed.
AGENT_PROGRAMS = {
    "qemu-guest-agent": AGENT_PATHS,
    "open-vm-tools": ("/usr/bin/vmtoolsd", "/usr/sbin/vmtoolsd"),
}


class CustomizeError(UserError):
    """Reading or changing the image failed; the message says what, the log says why."""


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def tool_env(accelerator: Accelerator) -> dict[str, str]:
    """The environment of a libguestfs tool: the direct backend (no libvirt daemon), TCG
    when asked, and no proxy settings (the appliance has no network anyway)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.setdefault("LIBGUESTFS_BACKEND", "direct")
    if accelerator == "tcg":
        env["LIBGUESTFS_BACKEND_SETTINGS"] = "force_tcg"
    elif accelerator == "kvm":
        env.pop("LIBGUESTFS_BACKEND_SETTINGS", None)
    return env


async def run_process(
    argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None, stdin: str = ""
) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv`; killed on timeout (TimeoutError) or when
    the caller is cancelled, and waited for either way."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


async def run_tool(
    argv: Sequence[str], accelerator: Accelerator, timeout_s: float, what: str, stdin: str = ""
) -> str:
    """Run a libguestfs tool; its stdout on success, a `CustomizeError` otherwise."""
    log.info("libguestfs: %s: %s", what, " ".join(argv))
    try:
        code, out, err = await run_process(argv, timeout_s, tool_env(accelerator), stdin)
    except TimeoutError:
        log.error("libguestfs: %s: killed after %.0f s", what, timeout_s)
        raise CustomizeError(
            f"{what} took longer than {timeout_s:.0f} s and was stopped; the log has "
            "libguestfs' output (a slow machine may need a larger customize_timeout_s)"
        ) from None
    if err.strip():
        log.info("libguestfs: %s: stderr:\n%s", what, err.strip())
    if code != 0:
        log.error("libguestfs: %s: exit status %s", what, code)
        raise CustomizeError(f"{what} failed (exit status {code}); the log has libguestfs' output")
    return out


@dataclass(frozen=True)
class Inspection:
    """What the image holds, read before it is changed."""

    selinux: bool  # SELINUX=enforcing|permissive and the configured policy is there
    selinux_reason: str
    agent: bool  # the platform's agent is installed (qemu-ga; vmtoolsd on vSphere)
    datasource_list: tuple[str, ...] | None  # cloud-init's effective list; None: not pinned
    datasource_file: str | None  # the file that sets it last


_INSPECT_SCRIPT = """\
echo ==selinux-config
-cat /etc/selinux/config
echo ==selinux-files
-find /etc/selinux
echo ==agent
{agent}
-copy-out /etc/cloud {cloud}
"""


def _sections(text: str) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("=="):
            current = line[2:]
            sections[current] = []
        elif current:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def selinux_state(config: str, files: str) -> tuple[bool, str]:
    """(has a policy to label for, why): SELINUX= enforcing or permissive, and the policy
    of SELINUXTYPE= present under /etc/selinux/TYPE/policy/."""
    values = dict(re.findall(r"^\s*(SELINUX|SELINUXTYPE)\s*=\s*(\S+)", config, re.M))
    mode = values.get("SELINUX", "").lower()
    if not config.strip():
        return False, "no /etc/selinux/config"
    if mode not in ("enforcing", "permissive"):
        return False, f"SELINUX={mode or '(unset)'} in /etc/selinux/config"
    kind = values.get("SELINUXTYPE", "targeted")
    listed = [line.strip().lstrip("/") for line in files.splitlines()]
    if not any(line.startswith(f"{kind}/policy/") for line in listed):
        return False, f"SELINUX={mode} but no policy in /etc/selinux/{kind}/policy"
    return True, f"SELINUX={mode}, policy {kind}"


def datasource_pin(cloud: Path) -> tuple[tuple[str, ...] | None, str | None]:
    """The datasource_list cloud-init ends with (cloud.cfg, then cloud.cfg.d/*.cfg in name
    order, later files winning) and the file that sets it; (None, None) when none does."""
    files = [cloud / "cloud.cfg", *sorted((cloud / "cloud.cfg.d").glob("*.cfg"))]
    found: tuple[tuple[str, ...] | None, str | None] = (None, None)
    for path in files:
        if not path.is_file():
            continue
        try:
            data = yaml.safe_load(path.read_text(errors="replace"))
        except yaml.YAMLError:
            log.warning("cloud-init config %s is not valid YAML: ignored", path.name)
            continue
        if isinstance(data, dict) and isinstance(data.get("datasource_list"), list):
            names = tuple(str(name) for name in data["datasource_list"])
            found = (names, "/etc/cloud/" + str(path.relative_to(cloud)))
    return found


async def inspect(
    disk: Path,
    accelerator: Accelerator,
    timeout_s: float,
    workdir: Path,
    agent_paths: tuple[str, ...] = AGENT_PATHS,
) -> Inspection:
    """Read the image (read-only, one appliance boot); `agent_paths`: the programs whose
    presence means the platform's agent is installed."""
    cloud = Path(tempfile.mkdtemp(dir=workdir, prefix="cloud-"))
    try:
        agent = "\n".join(f"-is-file {path}" for path in agent_paths)
        script = _INSPECT_SCRIPT.format(agent=agent, cloud=cloud)
        argv = ["guestfish", "--ro", "-a", str(disk), "-i"]
        out = await run_tool(argv, accelerator, timeout_s, "reading the image", stdin=script)
        parts = _sections(out)
        selinux, reason = selinux_state(
            parts.get("selinux-config", ""), parts.get("selinux-files", "")
        )
        pinned, source = datasource_pin(cloud / "cloud")
        return Inspection(
            selinux=selinux,
            selinux_reason=reason,
            agent="true" in parts.get("agent", "").split(),
            datasource_list=pinned,
            datasource_file=source,
        )
    finally:
        shutil.rmtree(cloud, ignore_errors=True)


@dataclass(frozen=True)
class Changes:
    """What `customize` does to the image; empty: nothing to do."""

    packages: tuple[Path, ...] = ()  # package files to install (verified, local)
    package_format: Literal["deb", "rpm"] = "deb"
    datasource_list: tuple[str, ...] | None = None  # written last in cloud.cfg.d
    selinux_relabel: bool = False

    def __bool__(self) -> bool:
        return bool(self.packages or self.datasource_list or self.selinux_relabel)


def customize_argv(disk: Path, changes: Changes, workdir: Path) -> list[str]:
    argv = ["virt-customize", "--no-network", "--format", "qcow2", "-a", str(disk)]
    if changes.packages:
        argv += ["--mkdir", PACKAGE_DIR]
        for package in changes.packages:
            argv += ["--upload", f"{package}:{PACKAGE_DIR}/{package.name}"]
        install = (
            f"dpkg -i {PACKAGE_DIR}/*.deb"
            if changes.package_format == "deb"
            else f"rpm -U --replacepkgs {PACKAGE_DIR}/*.rpm"
        )
        argv += ["--run-command", install, "--delete", PACKAGE_DIR]
    if changes.datasource_list is not None:
        local = workdir / "datasources.cfg"
        names = ", ".join(changes.datasource_list)
        local.write_text(
            "# deploybot: the datasources this template must allow (un-pinned at build)\n"
            f"datasource_list: [{names}]\n"
        )
        argv += ["--upload", f"{local}:{DATASOURCE_FILE}"]
    if changes.selinux_relabel:
        argv.append("--selinux-relabel")
    return argv


async def customize(
    disk: Path, changes: Changes, accelerator: Accelerator, timeout_s: float, workdir: Path
) -> None:
    """Apply `changes` to the qcow2 `disk` in place (one appliance boot)."""
    if not changes:
        return
    argv = customize_argv(disk, changes, workdir)
    await run_tool(argv, accelerator, timeout_s, "customising the image")
