"""What the Proxmox backend tests share: the fake server's fixtures, a backend on it,
a cloned VM, the identity a deploy hands it, and one deploy run to its end on it."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator

import pytest

from backends.base import (
    CloneSpec,
    Identity,
    VMRef,
)
from backends.proxmox import ProxmoxBackend
from bot.app.runtime import running_deployer
from bot.config.settings import Settings
from bot.models import Job, JobEvent
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE, Recorded
from tests.support.fakepve.testing import make_backend

# The fake server's fixtures, shared by the Proxmox test modules.
pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

KEYS = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 alice@laptop",
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7vbqajDhA+17i/tw3ZJ8 bob's key (2024) +ops",
)
IDENTITY = Identity(
    hostname="web01",
    user="ubuntu",
    ssh_keys=KEYS,
    address=ipaddress.IPv4Interface("127.0.10.50/24"),
    gateway=ipaddress.IPv4Address("127.0.10.1"),
    dns=(ipaddress.IPv4Address("127.0.10.2"), ipaddress.IPv4Address("127.0.10.3")),
    search_domain="lab.example",
    upgrade=False,
    cores=2,
    memory_mib=2048,
)
CLONE = "/nodes/{node}/qemu/{vmid}/clone"
CONFIG = "/nodes/{node}/qemu/{vmid}/config"


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    proxmox = make_backend(pve)
    yield proxmox
    await proxmox.close()


async def cloned(
    backend: ProxmoxBackend,
    template: str = "ubuntu-24.04",
    job: str = "jtest01",
    *,
    name: str = "web01",
    placement: str | None = None,
    storage: str | None = None,
) -> VMRef:
    spec = CloneSpec(job, name, template, placement, storage)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    return ref


def config_of(fake: FakePVE, ref: VMRef) -> dict[str, str]:
    return fake.cluster.vms[int(ref.vm_id)].config


def mutations(fake: FakePVE, vmid: str) -> list[Recorded]:
    return [r for r in fake.requests if r.method != "GET" and r.path_params.get("vmid") == vmid]


def no_task_running(fake: FakePVE) -> bool:
    return all(t.exitstatus is not None for t in fake.cluster.tasks.values())


ADDRESS = "127.0.10.50"

ORIGINAL = {100, 9000, 9001, 9002, 9003, 9004, 9005}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((ADDRESS, 0))
        port: int = probe.getsockname()[1]
    return port


async def deploy(
    fake: FakePVE, settings: Settings, text: str, recorder: Recorder | None = None
) -> tuple[Job, list[JobEvent]]:
    backend = make_backend(fake)
    async with running_deployer(settings, recorder, backends={"pve": backend}, grace_s=5) as d:
        args = parse(text)
        assert isinstance(args, DeployArgs)
        job = await d.request_deploy(args, "alice")
        await d.drain()
        info = await d.status(job.id)
    assert info.job.state.final
    return info.job, info.events


def ours_left(fake: FakePVE) -> list[int]:
    marks = (
        vm.config.get("description", "") + vm.config.get("tags", "")
        for vm in fake.cluster.vms.values()
    )
    return [
        vmid for vmid, mark in zip(fake.cluster.vms, marks, strict=True) if "deploybot-" in mark
    ]
