"""The shared backend contract, run against the simulator."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from backends.base import Backend
from backends.sim import SimBackend
from tests.contract import *  # noqa: F403


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    sim = SimBackend("sim", time_scale=0.001)
    yield sim
    await sim.close()
