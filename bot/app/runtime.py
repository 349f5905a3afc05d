"""Running the core: build the backends named in the configuration, open the store, and
run the `Deployer` the composition root (bot/app/compose.py) builds on them."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from backends.base import Backend, BackendFactory
from backends.config import BackendConfig
from backends.ipam import open_ipam
from bot.app.compose import compose
from bot.app.service import Deployer
from bot.config.settings import Settings, backend_module
from bot.jobs.durations import teach
from bot.jobs.progress import Progress
from bot.kinds.build.parts import BuildNotes
from bot.kinds.deploy.preflight import Preflight
from bot.models import utcnow
from bot.models.errors import BackendError, ConfigError, StoreUnavailable
from bot.ownership.claims import Clock
from bot.sshca.authority import HostCA, load_host_ca
from store.db import Store
from store.retry import RetryPolicy, Unavailable

log = logging.getLogger(__name__)


def make_backend(config: BackendConfig, environ: Mapping[str, str] | None = None) -> Backend:
    """Build a backend through its module's `create` (see bot.config.settings.BACKEND_MODULES)."""
    factory: BackendFactory = backend_module(config.kind).create
    try:
        return factory(config, os.environ if environ is None else environ)
    except BackendError as exc:  # a missing secret, an unreadable CA bundle...
        prefix = f"backend {config.name}: "
        message = exc.message if exc.message.startswith(prefix) else prefix + exc.message
        raise ConfigError(message) from None


async def make_backends(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> dict[str, Backend]:
    """Every configured backend, or one `ConfigError` naming each that cannot be built
    (a secret missing from the environment...), so one start tells the operator all."""
    built: dict[str, Backend] = {}
    problems = []
    for config in settings.backends:
        try:
            built[config.name] = make_backend(config, environ)
        except ConfigError as exc:
            problems.append(exc.message)
    if problems:
        await close_backends(built)
        raise ConfigError("\n".join(problems))
    return built


async def close_backends(backends: Mapping[str, Backend]) -> None:
    for backend in backends.values():
        try:
            await backend.close()
        except Exception:
            log.exception("closing backend %s failed", backend.name)


async def secret_problems(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """The secrets the configuration names that `environ` lacks (backends' passwords and
    tokens, NetBox's token, the host CA's key), each with its variable; nothing is
    connected to."""
    problems = []
    try:
        load_host_ca(settings, environ)
    except ConfigError as exc:
        problems.append(exc.message)
    try:
        await close_backends(await make_backends(settings, environ))
    except ConfigError as exc:
        problems += exc.message.splitlines()
    try:
        await open_ipam(settings.ipam, environ).close()
    except BackendError as exc:
        problems.append(f"[ipam]: {exc.message}")
    return problems


_heap_frozen = False


def freeze_startup_heap() -> None:
    """Move what is alive once the bot has started (modules, schemas, settings: all of
    it lives as long as the process) out of the collector's way, once per process.

    Without this every full collection walks that whole heap again, and with fifty
    deploys in flight one took 30-45 ms, all of it an event-loop stall."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.collect()
        gc.freeze()


@asynccontextmanager
async def running_deployer(
    settings: Settings,
    progress: Progress | None = None,
    *,
    backends: dict[str, Backend] | None = None,
    grace_s: float = 30.0,
    runner_kind: str = "shell",
    takes_over: bool = True,
    start: bool = True,
    clock: Clock = utcnow,
    build_notes: BuildNotes | None = None,
    host_ca: HostCA | None = None,
    preflight: Preflight | None = None,
) -> AsyncIterator[Deployer]:
    """Open the store, start the backends and the queue; shut all down on exit.

    With `start=False` the caller starts the deployer itself (`deploybot serve` binds
    its front end first, so what recovery says reaches Slack). `build_notes`: where
    template builds' progress goes (the CLI's terminal; a log by default). `host_ca`:
    the configured one unless given (the demo makes one of its own). `preflight`: the
    deploys' privilege check and what it keeps (a benchmark's rounds share one)."""
    if host_ca is None:  # before anything opens: it may refuse
        host_ca = load_host_ca(settings, os.environ)
    backends = backends if backends is not None else await make_backends(settings)
    store = await open_store(settings)
    deployer = compose(
        settings,
        store,
        backends,
        progress,
        runner_kind=runner_kind,
        takes_over=takes_over,
        clock=clock,  # tests pass a simulated one (leases: days pass in a step)
        build_notes=build_notes,
        host_ca=host_ca,
        preflight=preflight,
    )
    freeze_startup_heap()  # before start(): the jobs it recovers and queues are not
    try:
        await teach(store, backends)  # before any job: a fresh process paces from history
        if start:
            await deployer.start()
        yield deployer
    finally:
        await deployer.close(grace_s)
        await close_backends(backends)
        await store.close()


async def open_store(settings: Settings) -> Store:
    """The configured database, or a `StoreUnavailable` saying which and why."""
    try:
        return await Store.open(
            settings.database,
            password=settings.database_password,
            retry=RetryPolicy(window_s=settings.store.write_retry_s),
        )
    except Unavailable as exc:
        raise StoreUnavailable(str(exc), settings.database_password_env) from None
