"""Runners sharing one database under an injected clock: who owns a job, and when."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimBackend
from bot.app.compose import compose
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import Job, utcnow
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from store.db import Store
from tests.support.deployer import Recorder


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the runners keep their state: the ownership protocol holds on both stores."""
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return str(tmp_path / "jobs.db")


class Clock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def request(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


@asynccontextmanager
async def runner(
    settings: Settings,
    sim: SimBackend,
    clock: Callable[[], datetime] = utcnow,
    progress: Recorder | None = None,
    **options: Any,
) -> AsyncIterator[Deployer]:
    """One process's Deployer on the shared database and hypervisor."""
    store = await Store.open(settings.database, password=settings.database_password)
    deployer = compose(
        settings, store, {"sim": sim}, progress or Recorder(), clock=clock, **options
    )
    await deployer.start()
    try:
        yield deployer
    finally:
        await deployer.close(grace_s=5)
        await store.close()


def gate(recorder: Recorder, step: str) -> asyncio.Event:
    """Hold every job at the start of `step` until the returned event is set."""
    release = asyncio.Event()

    async def hold(_job: Job, started: str) -> None:
        if started == step:
            await release.wait()

    recorder.on_step = hold
    return release
