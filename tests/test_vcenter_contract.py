"""The shared backend contract, run against vcsim in vCenter (VPX) mode.

The test's guest agent (tests/support/vsphere/simulator.py) plays the booted guest: it reports
the address from the VM's cloud-init metadata, so `wait_for_address` returns the identity's
address.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator

import pytest

from backends.base import Backend, VMRef
from tests.support.contract import *  # noqa: F403
from tests.support.contract import HandBuilt, Untag
from tests.support.vsphere.simulator import (  # noqa: F401
    Simulated,
    vcenter_fixture,
    vcsim_binary_fixture,
    vcsim_tls_fixture,
)


@pytest.fixture
async def backend(vcenter: Simulated) -> AsyncIterator[Backend]:
    vsphere = vcenter.sim.backend()
    yield vsphere
    await vsphere.close()


@pytest.fixture
def hand_built(vcenter: Simulated) -> HandBuilt:
    async def build(name: str, address: ipaddress.IPv4Address) -> str:
        return await asyncio.to_thread(vcenter.sim.build_by_hand, name, str(address))

    return build


@pytest.fixture
def untag(vcenter: Simulated) -> Untag:
    """The notes that hold the tag rewritten by hand (vSphere Client, govc; vcsim takes
    an empty annotation for "unchanged", so they get other words)."""

    async def remove(ref: VMRef) -> None:
        await asyncio.to_thread(vcenter.sim.set_annotation, ref.vm_id, "web, ask bob")

    return remove
