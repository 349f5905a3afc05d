"""Wiring: build the backends named in the configuration and a running `Deployer`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from backends.base import Backend
from backends.sim import SimBackend
from bot.progress import Progress
from bot.service import Deployer
from bot.settings import BackendConfig, Settings
from store.db import Store

log = logging.getLogger(__name__)


def make_backend(config: BackendConfig) -> Backend:
    """One place that knows every backend kind; a new kind adds a branch here."""
    if config.kind == "sim":
        return SimBackend(config.name, placements=config.placements, time_scale=config.time_scale)
    raise ValueError(f"unknown backend kind {config.kind!r}")  # settings validation prevents this


@asynccontextmanager
async def running_deployer(
    settings: Settings,
    progress: Progress | None = None,
    *,
    backends: dict[str, Backend] | None = None,
    grace_s: float = 30.0,
) -> AsyncIterator[Deployer]:
    """Open the store, start the backends and the queue; shut all down on exit."""
    backends = (
        backends if backends is not None else {c.name: make_backend(c) for c in settings.backends}
    )
    store = await Store.open(settings.database)
    deployer = Deployer(settings, store, backends, progress)
    try:
        await deployer.start()
        yield deployer
    finally:
        await deployer.close(grace_s)
        for backend in backends.values():
            try:
                await backend.close()
            except Exception:
                log.exception("closing backend %s failed", backend.name)
        await store.close()
