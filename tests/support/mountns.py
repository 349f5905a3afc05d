"""Run a program with some of the host's paths replaced by a test's own files, in a mount
namespace of its own (util-linux `unshare --mount`, private propagation): what a simulated
guest's command or a real cloud-init module writes to /etc/ssh lands in the test's folder,
never in the host's. Root (a CI container) does it directly, another user through a user
namespace (`--map-root-user`). Where neither works, `unavailable` says why and the tests
that need it skip with that reason (or fail under DEPLOYBOT_REQUIRE_MOUNTNS=1)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

# Bind each SOURCE over its TARGET (pairs up to "--"), then run the rest.
_BIND = (
    'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 125; shift 2; done; shift; exec "$@"'
)


def _unshare() -> list[str]:
    found = shutil.which("unshare") or "/usr/bin/unshare"
    flags = ["--mount", "--propagation", "private"]
    return [found, *flags] if os.geteuid() == 0 else [found, "--map-root-user", *flags]


def confined(binds: Mapping[str, Path], argv: Sequence[str]) -> list[str]:
    """The command line that runs `argv` with each host path (a key) replaced by its
    file or folder (the value; both must exist)."""
    pairs = [part for target, source in binds.items() for part in (str(source), target)]
    return [*_unshare(), "/bin/sh", "-c", _BIND, "mountns", *pairs, "--", *argv]


@functools.cache
def unavailable() -> str | None:
    """Why a mount namespace cannot be made here; None when it can."""
    if shutil.which("unshare") is None:
        return "util-linux's unshare is missing"
    try:
        done = subprocess.run(
            confined({"/tmp": Path("/tmp")}, ["true"]),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError as exc:
        return f"unshare cannot run: {exc}"
    if done.returncode != 0:
        return f"no mount namespace here (unshare --mount: {done.stderr.strip()[-200:]})"
    return None
