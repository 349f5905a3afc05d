"""Shared fixtures: fast settings on real SQLite files, a simulator, a running Deployer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from tests.support.deployer import SIM_SCALE, Recorder, make_settings
from tests.support.netbox.harness import clean_netbox, netbox  # noqa: F401 (fixtures)
from tests.support.postgres import (  # noqa: F401 (fixtures)
    pg_cluster,
    pg_url,
    stoppable_cluster,
    stoppable_pg,
)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def sim() -> SimBackend:
    return SimBackend("sim", time_scale=SIM_SCALE)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def deployer(
    settings: Settings, sim: SimBackend, recorder: Recorder
) -> AsyncIterator[Deployer]:
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:
        yield d
