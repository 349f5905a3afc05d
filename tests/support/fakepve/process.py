"""The fake Proxmox in a process of its own (`python -m tests.support.fakepve`), and
deploybot configured for it."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.crash import settled_jobs
from tests.support.reference import REFERENCE, reference_json

SECRET = "crash-harness-secret"

CONFIG = """
database = "{tmp}/jobs.db"
log_file = "{tmp}/bot.log"

[[backends]]
kind = "proxmox"
name = "pve"
host = "127.0.0.1"
port = {port}
user = "root@pam"
token_id = "deploybot"
ca_bundle = "{ca}"

[[subnets]]
cidr = "127.0.10.0/24"
gateway = "127.0.10.1"

[defaults]
ssh_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"]
backend = "pve"
ssh_port = {ssh_port}

[timeouts]
retry_initial_s = 0.01
retry_max_s = 0.1
"""


@dataclass(frozen=True)
class FakePVE:
    port: int
    ssh_port: int
    ca: Path

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.port}{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"PVEAPIToken=root@pam!deploybot={SECRET}"},
        )
        context = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return json.loads(answer.read())

    def vms(self) -> list[dict[str, Any]]:
        found = self.call("GET", "/api2/json/cluster/resources?type=vm")["data"]
        return [vm for vm in found if not vm.get("template")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def fake_pve(tmp_path: Path) -> Iterator[FakePVE]:
    reference_json("pve-api-subset.json")  # skips locally, fails in CI, if it is missing
    port, ssh_port = free_port(), free_port()
    state = tmp_path / "pve"
    fast = ["--clone-s", "0.3", "--config-s", "0.05", "--resize-s", "0.05", "--start-s", "0.1"]
    fast += ["--stop-s", "0.05", "--destroy-s", "0.05", "--agent-after-s", "0.3"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fakepve",
         "--port", str(port), "--ssh-port", str(ssh_port),
         "--state-dir", str(state), "--token-secret", SECRET, "--auth-fail-delay-s", "0.1",
         "--schema", str(REFERENCE / "pve-api-subset.json"), *fast],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ca = None
    for line in proc.stdout:
        if "CA bundle:" in line:
            ca = Path(line.split("CA bundle:", 1)[1].strip())
        if line.startswith("export PVE_TOKEN_SECRET"):
            break
    assert ca is not None, "the fake did not start"
    try:
        yield FakePVE(port, ssh_port, ca)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def config_env(tmp: Path, fake: FakePVE) -> dict[str, str]:
    path = tmp / "deploybot.toml"
    path.write_text(CONFIG.format(tmp=tmp, port=fake.port, ca=fake.ca, ssh_port=fake.ssh_port))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env.update(DEPLOYBOT_CONFIG=str(path), PVE_TOKEN_SECRET=SECRET)
    return env


def check_against(tmp: Path, fake: FakePVE) -> None:
    jobs = settled_jobs(tmp)
    vms = fake.vms()
    names = [vm["name"] for vm in vms]
    assert len(names) == len(set(names)), f"a name is used twice: {names}"
    ever_ours = {vm_id for *_rest, vm_id in jobs.values() if vm_id}
    live = {
        str(vm["vmid"])
        for vm in vms
        if str(vm["vmid"]) in ever_ours or "deploybot-" in str(vm.get("tags", ""))
    }
    owned = {vm_id for state, _n, _a, vm_id in jobs.values() if state == "succeeded"}
    assert live == owned, f"VMs {sorted(live - owned)} leaked, {sorted(owned - live)} lost"
    assert "web-template" in names, "a VM that is not ours was touched"
