"""Run a program with some of the host's paths replaced by a test's own files, in a mount
namespace of its own (util-linux `unshare --mount`, private propagation): what a simulated
guest's command or a real cloud-init module writes to /etc/ssh lands in the test's folder,
never in the host's. It runs in a PID namespace of its own too (`--pid --fork
--mount-proc`): a guest's `kill -HUP $(cat /run/sshd.pid)` can only reach the program's
own processes, never one of the host's. Root (a CI container) does it directly, another
user through a user namespace (`--map-root-user`). Where neither works, or the host lacks
a path to bind over, `unavailable` says why and `require` skips the test with that reason
(or fails it under DEPLOYBOT_REQUIRE_MOUNTNS=1)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

# What the fake Proxmox's guests bind over (tests/support/fakepve/guestfiles.py).
GUEST_TARGETS = ("/etc/ssh", "/run")

# Bind each SOURCE over its TARGET (pairs up to "--"), then run the rest.
_BIND = (
    'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 125; shift 2; done; shift; exec "$@"'
)


def _unshare() -> list[str]:
    found = shutil.which("unshare") or "/usr/bin/unshare"
    flags = ["--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc"]
    return [found, *flags] if os.geteuid() == 0 else [found, "--map-root-user", *flags]


def confined(binds: Mapping[str, Path], argv: Sequence[str]) -> list[str]:
    """The command line that runs `argv` with each host path (a key) replaced by its
    file or folder (the value; both must exist)."""
    pairs = [part for target, source in binds.items() for part in (str(source), target)]
    return [*_unshare(), "/bin/sh", "-c", _BIND, "mountns", *pairs, "--", *argv]


@functools.cache
def unavailable(targets: tuple[str, ...] = GUEST_TARGETS) -> str | None:
    """Why a mount namespace binding a folder over each of `targets` cannot be made here;
    None when it can."""
    if shutil.which("unshare") is None:
        return "util-linux's unshare is missing"
    if missing := [t for t in targets if not Path(t).is_dir()]:
        return f"this host has no {', '.join(missing)} to bind a test's folder over"
    with tempfile.TemporaryDirectory(prefix="mountns-probe-") as folder:
        binds = {target: Path(folder) for target in targets}
        try:
            done = subprocess.run(
                confined(binds, ["true"]),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except OSError as exc:
            return f"unshare cannot run: {exc}"
    if done.returncode != 0:
        how = f"unshare --mount --pid binding over {', '.join(targets)}"
        return f"no mount namespace here ({how}: {done.stderr.strip()[-200:] or done.returncode})"
    return None


def require(targets: tuple[str, ...] = GUEST_TARGETS) -> None:
    """Skip the calling test when `unavailable`, with its reason; fail it instead under
    DEPLOYBOT_REQUIRE_MOUNTNS=1 (CI must not skip silently)."""
    if (reason := unavailable(targets)) is None:
        return
    if os.environ.get("DEPLOYBOT_REQUIRE_MOUNTNS") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_MOUNTNS=1 forbids skipping")
    pytest.skip(reason)
