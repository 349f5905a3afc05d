"""The shared backend contract, run against the simulator."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator

import pytest

from backends.base import Backend, VMRef
from backends.sim import SimBackend
from tests.support.contract import *  # noqa: F403
from tests.support.contract import HandBuilt, Untag


@pytest.fixture
async def sim() -> AsyncIterator[SimBackend]:
    sim = SimBackend("sim", time_scale=0.001)
    yield sim
    await sim.close()


@pytest.fixture
def backend(sim: SimBackend) -> Backend:
    return sim


@pytest.fixture
def hand_built(sim: SimBackend) -> HandBuilt:
    async def build(name: str, address: ipaddress.IPv4Address) -> str:
        return sim.add_vm(name, address=address)

    return build


@pytest.fixture
def untag(sim: SimBackend) -> Untag:
    async def remove(ref: VMRef) -> None:
        sim.vms[ref.vm_id].tags.clear()

    return remove
