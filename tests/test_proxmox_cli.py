"""The README's demo as a test: `deploybot deploy web01 10.0.0.50 --backend pve` against
the fake Proxmox API, as a separate process, prints the SSH line. The config the fake
writes sends the SSH check through its jump host, for 10.0.0.50 and 127.0.10.50 alike."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.fakepve import testing
from tests.fakepve.schema import ApiSchema
from tests.fakepve.server import FakePVE, Tls
from tests.fakepve.testing import config_text, run_deploybot, start_fake

# The fake server's fixtures, shared by the Proxmox test modules.
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

LOOPBACK_GUEST = "127.0.10.50"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK_GUEST, 0))
        port: int = probe.getsockname()[1]
    return port


def config_file(tmp_path: Path, fake: FakePVE) -> Path:
    """The config the fake writes for the README's demo, with roomier timeouts."""
    path = tmp_path / "deploybot.toml"
    text = config_text(fake, tmp_path, fake.cluster.guest.ssh_port)
    path.write_text(text + "\n[timeouts]\naddress_s = 30\nssh_s = 30\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("guest", ["10.0.0.50", LOOPBACK_GUEST])
async def test_deploybot_deploy_prints_the_ssh_line(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path, guest: str
) -> None:
    lab = start_fake(pve_schema, pve_tls, ssh_port=free_port(), jump_dir=tmp_path / "jump")
    async with lab as fake:
        returncode, output = await run_deploybot(
            fake, config_file(tmp_path, fake), tmp_path,
            "deploy", "web01", guest, "--backend", "pve", "--user", "alice",
        )  # fmt: skip
    assert returncode == 0, output
    assert f"ssh ubuntu@{guest}" in output
    assert "VM 101 on pve1@lab" in output
    assert f"host key {fake.cluster.guest.host_keys[101]}" in output
    assert fake.jump is not None
    asked = [host for host, _port in fake.jump.requests]
    # The check went through the jump host (direct-tcpip, then the key exchange), which
    # reached the guest's sshd on loopback: nothing was sent to 10.0.0.50 itself.
    assert asked and set(asked) == {guest}
    log = (tmp_path / "deploybot.log").read_text(encoding="utf-8")
    assert fake.token_secret not in output + log
