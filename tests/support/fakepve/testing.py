"""Fixtures and helpers for the Proxmox tests: a fake server per test (fast task
durations), a ProxmoxBackend pointed at it through the CA bundle, settings for the
pipeline. Test modules import the fixtures they use by name."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest

from backends.proxmox import ProxmoxBackend, create
from backends.proxmox.config import Config
from bot.config.settings import Settings
from tests.support.cli import run_async
from tests.support.deployer import FAST_TIMEOUTS, make_settings
from tests.support.fakepve.cluster import Timings
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls, make_tls
from tests.support.reference import reference_json

FAST = Timings(
    clone_s=0.04,
    clone_full_s=0.08,
    config_s=0.02,
    resize_s=0.02,
    start_s=0.03,
    stop_s=0.03,
    destroy_s=0.02,
    agent_after_s=0.05,
    lock_wait_s=0.3,
)
Auth = Literal["token", "password"]


@pytest.fixture(scope="session")
def pve_schema() -> ApiSchema:
    return ApiSchema(reference_json("pve-api-subset.json"))


@pytest.fixture(scope="session")
def pve_tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("pve-tls"))


def start_fake(schema: ApiSchema, tls: Tls, **options: Any) -> FakePVE:
    options.setdefault("timings", dataclasses.replace(FAST))
    options.setdefault("auth_fail_delay_s", 0.01)
    return FakePVE(schema, tls, **options)


@pytest.fixture
async def pve(pve_schema: ApiSchema, pve_tls: Tls) -> AsyncIterator[FakePVE]:
    async with start_fake(pve_schema, pve_tls) as fake:
        yield fake


def config_data(fake: FakePVE, auth: Auth = "token", **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "kind": "proxmox",
        "name": "pve",
        "host": "127.0.0.1",
        "port": fake.port,
        "user": fake.user,
        "ca_bundle": str(fake.tls.ca_path),
        "request_timeout_s": 5.0,
        "max_parallel_requests": 8,
        "task_poll_initial_s": 0.005,
        "task_poll_max_s": 0.05,
        "lock_backoff_s": 0.01,
        "lock_wait_s": 0.5,
        "agent_poll_window_s": 0.2,
        # No first guesses: the typical durations (seconds) would make these fast
        # fake tasks wait seconds; the tests of first guesses set their own.
        "expect_s": {},
    }
    if auth == "token":
        data["token_id"] = fake.token_id.split("!")[1]
    data.update(overrides)
    return data


def environ(fake: FakePVE, auth: Auth = "token") -> dict[str, str]:
    if auth == "token":
        return {"PVE_TOKEN_SECRET": fake.token_secret}
    return {"PVE_PASSWORD": fake.password}


def make_backend(fake: FakePVE, auth: Auth = "token", **overrides: Any) -> ProxmoxBackend:
    return create(Config.model_validate(config_data(fake, auth, **overrides)), environ(fake, auth))


@pytest.fixture
async def pve_backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    backend = make_backend(pve)
    yield backend
    await backend.close()


def pve_settings(tmp_path: Path, fake: FakePVE, **overrides: Any) -> Settings:
    """Settings with one Proxmox backend `pve`, guests on 127.0.10.0/24 (loopback: the
    SSH check connects for real) and the fast timeouts, a little longer for HTTPS."""
    timeouts = {
        **FAST_TIMEOUTS,
        **{k: 3.0 for k in FAST_TIMEOUTS if k.endswith("_s") and "retry" not in k},
    }
    data: dict[str, Any] = {
        "backends": [config_data(fake)],
        "subnets": [
            {
                "cidr": "127.0.10.0/24",
                "gateway": "127.0.10.1",
                "dns": ["127.0.10.2"],
                "search_domain": "lab.example",
            }
        ],
        "defaults": {
            "backend": "pve",
            "template": "ubuntu-24.04",
            "ssh_port": fake.cluster.guest.ssh_port or 22,
        },
        "timeouts": timeouts,
    }
    data.update(overrides)
    return make_settings(tmp_path, **data)


DEMO_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"


# Where each subnet's VMs go on the fake's node (`config_text(segments=True)`): its
# bridges are vmbr0 (VLAN-aware) and vmbr1.
SEGMENT = '\n[subnets.segments.pve]\nbridge = "vmbr0"\n'
LAB20 = """
[[subnets]]
cidr = "10.0.20.0/24"
name = "lab20"
gateway = "10.0.20.1"
dns = ["10.0.20.2"]
search_domain = "lab20.example"
[subnets.segments.pve]
bridge = "vmbr0"
vlan = 20
"""


def config_text(
    fake: FakePVE, state_dir: Path, ssh_port: int | None, *, segments: bool = False
) -> str:
    """A deploybot.toml for deploys onto this fake. When the fake runs a jump host, the
    backend's SSH checks all go through it (guests on 10.0.0.0/24 and on 127.0.10.0/24
    alike); without one, only 127.0.10.0/24 is offered. Either way the check connects
    to nothing outside loopback. With `segments`, every subnet says its segment on pve
    (vmbr0), and with a jump host there is a second lab subnet, `lab20` (10.0.20.0/24 on
    vmbr0 VLAN 20), for a NIC more (`+10.0.20.5`)."""
    jump = fake.jump.toml() if fake.jump is not None else ""
    segment = SEGMENT if segments else ""
    lab = (
        f"""
[[subnets]]
cidr = "10.0.0.0/24"
gateway = "10.0.0.1"
dns = ["10.0.0.2"]
search_domain = "lab.example"
{segment}{LAB20 if segments else ""}"""
        if jump
        else ""
    )
    return f"""\
database = "{state_dir / "deploybot.db"}"
log_file = "{state_dir / "deploybot.log"}"

[[backends]]
kind = "proxmox"
name = "pve"
host = "127.0.0.1"
port = {fake.port}
user = "{fake.user}"
token_id = "{fake.token_id.split("!")[1]}"
ca_bundle = "{fake.tls.ca_path}"
{jump}{lab}
[[subnets]]
cidr = "127.0.10.0/24"
gateway = "127.0.10.1"
dns = ["127.0.10.2"]
search_domain = "lab.example"
{segment}
[defaults]
backend = "pve"
template = "ubuntu-24.04"
ssh_port = {ssh_port or 22}
# A public key (no secret): without one a deploy is refused, as nobody could log in.
ssh_keys = ["{DEMO_KEY}"]
"""


async def run_deploybot(fake: FakePVE, config: Path, cwd: Path, *args: str) -> tuple[int, str]:
    """The real `deploybot` command against this fake: (exit code, stdout + stderr)."""
    code, out, err = await run_deploybot_apart(fake, config, cwd, *args)
    return code, out + err


async def run_deploybot_apart(
    fake: FakePVE, config: Path, cwd: Path, *args: str
) -> tuple[int, str, str]:
    """The real `deploybot` command against this fake: (exit code, stdout, stderr)."""
    return await run_async(config, cwd, {"PVE_TOKEN_SECRET": fake.token_secret}, *args)
