"""The demo of docs/backends.md ("Trying the real backends locally") as a test:
`deploybot deploy web01 10.0.0.50 --backend pve` against the fake Proxmox API, as a
separate process, prints the SSH line. The config the fake writes sends the SSH check
through its jump host, for 10.0.0.50 and 127.0.10.50 alike."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import config_text, run_deploybot, start_fake

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
    """The config the fake writes for the docs' demo, with roomier timeouts."""
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


async def test_a_successful_deploy_is_in_the_log_step_by_step(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    """Issue 25, item 18: the log receives every detail of a success too: the job's
    start, each step's end with its duration, the outcome; one line each, with the
    job's fields in JSON mode, and never the token's secret."""
    import json

    lab = start_fake(pve_schema, pve_tls, ssh_port=free_port(), jump_dir=tmp_path / "jump")
    async with lab as fake:
        config = config_file(tmp_path, fake)
        config.write_text('log_format = "json"\n' + config.read_text(encoding="utf-8"))
        returncode, output = await run_deploybot(
            fake, config, tmp_path,
            "deploy", "web01", LOOPBACK_GUEST, "--backend", "pve", "--user", "alice",
        )  # fmt: skip
    assert returncode == 0, output
    text = (tmp_path / "deploybot.log").read_text(encoding="utf-8")
    assert fake.token_secret not in text
    lines = [json.loads(line) for line in text.splitlines()]
    jobs = {line["job"] for line in lines if "job" in line}
    assert len(jobs) == 1, jobs
    job = jobs.pop()
    about = [line for line in lines if line.get("job") == job and line["level"] == "INFO"]
    said = [line["message"] for line in about]
    assert said[0].startswith(f"job {job}: started: web01 {LOOPBACK_GUEST}/24 from ubuntu-24.04")
    for step in ("check_free", "clone", "identity", "power_on", "address", "ssh"):
        (end,) = [line for line in about if line["message"].startswith(f"job {job}: {step} ")]
        assert " finished in " in end["message"] and " s" in end["message"]
        assert end["step"] == step and end["backend"] == "pve"
    assert said[-1].startswith(f"job {job}: succeeded in ")
    assert said[-1].endswith(f"ssh ubuntu@{LOOPBACK_GUEST}")
