"""A backend whose `host` does not resolve is a permanent error that names the setting,
never "does not answer ... try again" (issue 11, item 6).

The name is under `.invalid` (RFC 6761), and the lookup runs in a child process inside
a network namespace of its own (`unshare -rn`: loopback only), so that no DNS query
leaves the machine whatever its resolver configuration says.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: build each backend the way `deploybot serve` does and ask it for
# its inventory; print the error it raised.
CHILD = """
import asyncio, json
from bot.models.errors import BackendError
from backends.proxmox import Config as PveConfig, create as pve_create
from backends.vsphere import Config as VsConfig, create as vs_create

async def main():
    found = {}
    pve = pve_create(PveConfig.model_validate({
        "kind": "proxmox", "name": "pve", "host": "pve.example.invalid",
        "user": "deploybot@pve", "token_id": "bot",
    }), {"PVE_TOKEN_SECRET": "s"})
    vs = vs_create(VsConfig.model_validate({
        "kind": "vsphere", "name": "vc", "host": "vc.example.invalid",
        "user": "deploybot@vsphere.local", "password_env": "VCP",
    }), {"VCP": "p"})
    for name, backend in (("pve", pve), ("vc", vs)):
        try:
            await backend.placements()
            found[name] = ["answered", "", False]
        except BackendError as exc:
            found[name] = [type(exc).__name__, exc.message, exc.retryable]
        finally:
            await backend.close()
    print(json.dumps(found))

asyncio.run(main())
"""


def isolated() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace here: {probe.stderr.decode().strip()}")
    return [unshare, "-rn"]


def test_a_host_that_does_not_resolve_is_permanent_and_names_the_setting() -> None:
    done = subprocess.run(
        [*isolated(), sys.executable, "-c", CHILD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for name, host in (("pve", "pve.example.invalid"), ("vc", "vc.example.invalid")):
        kind, message, retryable = found[name]
        assert kind == "PermanentError" and not retryable, found[name]
        assert f"{host} cannot be resolved" in message
        assert f"check `host` in [[backends]] {name}" in message
        assert "try again" not in message and "does not answer" not in message
