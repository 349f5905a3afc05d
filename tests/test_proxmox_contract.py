"""The shared backend contract, run against ProxmoxBackend and the fake Proxmox API."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import AsyncIterator

import pytest

from backends.base import Backend, VMRef
from tests.support.contract import *  # noqa: F403
from tests.support.contract import HandBuilt, Untag
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend

# The fake server's fixtures, shared by the Proxmox test modules.
pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[Backend]:
    proxmox = make_backend(pve)
    yield proxmox
    await proxmox.close()


@pytest.fixture
def hand_built(pve: FakePVE) -> HandBuilt:
    """A stopped VM made in the web UI with a static cloud-init address."""

    async def build(name: str, address: ipaddress.IPv4Address) -> str:
        vmid = max(pve.cluster.vms) + 1
        pve.cluster.add_vm(vmid, name, ipconfig0=f"ip={address}/24,gw=10.0.0.1")
        return str(vmid)

    return build


@pytest.fixture
def untag(pve: FakePVE) -> Untag:
    """The tag deleted in the web UI: from `tags`, and the `tag:` line of the notes."""

    async def remove(ref: VMRef) -> None:
        config = pve.cluster.vms[int(ref.vm_id)].config
        config.pop("tags", None)
        notes = re.sub(r"(?m)^tag: \S+\n?", "", str(config.get("description", "")))
        config["description"] = notes

    return remove
