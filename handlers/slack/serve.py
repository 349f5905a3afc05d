"""`deploybot serve`: start the Slack bot in Socket Mode, or in HTTP mode with --http.

The tokens are read from the environment and checked for their shape before anything
starts; a missing or malformed one stops the start with a message that names the
variable and never shows its value. Tokens are not logged, not stored, and not put in
any message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from slack_bolt.adapter.socket_mode.aiohttp import AsyncSocketModeHandler

from backends.base import Backend
from bot.app.runtime import running_deployer, secret_problems
from bot.app.service import Deployer
from bot.chat import inbox
from bot.config.sections import SlackSettings
from bot.config.settings import Settings
from bot.models.errors import ConfigError
from bot.operations.metrics import CONTENT_TYPE
from bot.requests.admission import problems_at_start
from bot.requests.grammar import is_whole
from handlers.messages.core import secrets_missing
from handlers.messages.slack import (
    bad_http_address,
    serving_http,
    serving_socket,
    token_malformed,
    token_missing,
)
from handlers.slack.app import SlackBot, make_client
from handlers.slack.threads import SlackThreads

log = logging.getLogger(__name__)

_BOT_TOKEN = re.compile(r"^xoxb-[A-Za-z0-9-]{10,}$")
_APP_TOKEN = re.compile(r"^xapp-[A-Za-z0-9-]{10,}$")
_SIGNING_SECRET = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Secrets:
    bot_token: str
    app_token: str | None = None
    signing_secret: str | None = None

    def __repr__(self) -> str:  # never print a token, even in a traceback
        return "Secrets(<hidden>)"


def _secret(
    environ: Mapping[str, str], variable: str, what: str, shape: re.Pattern[str], rule: str
) -> str:
    value = environ.get(variable, "").strip()
    if not value:
        raise ConfigError(token_missing(variable, what))
    if not shape.match(value):
        raise ConfigError(token_malformed(variable, what, rule))
    return value


def read_secrets(slack: SlackSettings, environ: Mapping[str, str], *, http: bool) -> Secrets:
    """The tokens this mode needs, checked; `ConfigError` names the variable at fault."""
    bot = _secret(environ, slack.bot_token_env, "bot token", _BOT_TOKEN, "start with xoxb-")
    if http:
        secret = _secret(
            environ,
            slack.signing_secret_env,
            "signing secret",
            _SIGNING_SECRET,
            "be 32 hexadecimal characters",
        )
        return Secrets(bot, signing_secret=secret)
    app = _secret(environ, slack.app_token_env, "app-level token", _APP_TOKEN, "start with xapp-")
    return Secrets(bot, app_token=app)


def parse_http(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not is_whole(port) or int(port) > 65535:
        raise ConfigError(bad_http_address(text))
    return host.strip("[]"), int(port)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def serve(
    settings: Settings,
    *,
    http: str | None,
    environ: Mapping[str, str],
    ready: Callable[[str], None] = say,
    stop: asyncio.Event | None = None,
) -> int:
    """Run until SIGINT/SIGTERM (or `stop`); running deploys get their grace period."""
    address = parse_http(http) if http else None
    secrets = await _secrets(settings, environ, http=address is not None)
    stop = stop or _stop_on_signals()
    client = make_client(secrets.bot_token, settings.slack.api_base_url)
    threads = SlackThreads(client, settings.slack)
    # Slack hears of jobs through the store's outbox (threads), not as a live listener.
    async with running_deployer(settings, runner_kind="serve", start=False) as deployer:
        bot = SlackBot(deployer, threads, client, signing_secret=secrets.signing_secret)
        threads.outboxes.on_throttled = deployer.metrics.slack_throttled.inc
        # Only now, with the threads bound: what recovery says must reach Slack. The
        # recoveries themselves go on in the background (`/readyz`).
        await deployer.start(settle=False)
        # Told at start, not at the first request: a wrong password, an untrusted
        # certificate, a misspelt network. In the background: a slow backend does not
        # hold up serving the others.
        checking = asyncio.create_task(
            _tell_problems(deployer.backends, settings.defaults.template)
        )
        # Commands a stopped process acknowledged but never answered (bot/chat/inbox.py).
        sweeping = asyncio.create_task(bot.sweeping(), name="inbox-sweep")
        # Whether the database answers: /readyz, /metrics and the acknowledgements read it.
        watching = asyncio.create_task(deployer.storewatch.loop(), name="store-watch")
        listen = settings.metrics.listen
        metrics = await serve_metrics(deployer, listen) if listen and address is None else None
        try:
            if address is not None:
                await run_http(bot, address, ready, stop)
            else:
                assert secrets.app_token is not None
                await run_socket(bot, secrets.app_token, ready, stop)
        finally:
            await _stop(
                settings.ownership.stop_s, bot, deployer, threads, checking, sweeping, watching
            )
            if metrics is not None:
                await metrics.cleanup()
    return 0


async def _stop(
    stop_s: float,
    bot: SlackBot,
    deployer: Deployer,
    threads: SlackThreads,
    *tasks: asyncio.Task[None],
) -> None:
    """Hand the work back within about twice `stop_s` ([ownership] stop_s): answers and
    running deploys get `stop_s`; then unsent answers stay in the inbox and running
    deploys are cancelled, their rollbacks given `stop_s` more; queued jobs go back."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + stop_s
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await bot.settle(within_s=stop_s)
    await inbox.settle_refusals(within_s=max(0.0, deadline - loop.time()))
    # Running jobs finish (or roll back) first, so their outcomes can still be told;
    # what is not told by then waits in the outbox for another process.
    await deployer.close(grace_s=max(0.0, deadline - loop.time()), rollback_s=stop_s)
    # Then what it has to say, within the rest of the two `stop_s`.
    await threads.close(grace_s=max(0.5, deadline + stop_s - loop.time()))


async def _secrets(settings: Settings, environ: Mapping[str, str], *, http: bool) -> Secrets:
    """Slack's tokens; every missing secret (Slack's, the backends', NetBox's) named
    at once, before anything starts."""
    problems = await secret_problems(settings, environ)
    try:
        secrets = read_secrets(settings.slack, environ, http=http)
    except ConfigError as exc:
        if not problems:
            raise
        problems.insert(0, exc.message)
    if problems:
        raise ConfigError(secrets_missing(problems))
    return secrets


async def _tell_problems(backends: Mapping[str, Backend], default_template: str) -> None:
    """Into the log, which `serve` also writes to stderr."""
    for problem in await problems_at_start(backends, default_template):
        log.warning("%s", problem)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def http_app(bot: SlackBot) -> web.Application:
    """Bolt's aiohttp app (signature-checked /slack/events) plus /healthz."""
    app = bot.app.web_app(path="/slack/events")

    async def healthz(_request: web.Request) -> web.Response:
        queue = bot.deployer.queue
        return web.json_response(
            {"ok": True, "running": queue.running_count, "waiting": queue.waiting_count}
        )

    async def readyz(_request: web.Request) -> web.Response:
        """Ready once this runner has registered and made its first claims, and while
        the database answers (bot/ownership/storewatch.py); the recoveries it started may still
        be running (`recovering`). /healthz stays 200 meanwhile: the process is alive."""
        deployer = bot.deployer
        watch = deployer.storewatch
        ready = deployer.ready.is_set() and watch.reachable
        body = {
            "ready": ready,
            "runner": deployer.runner.id,
            "recovering": len(deployer.ownership.recovering),
            "store": "reachable" if watch.reachable else f"not answering: {watch.problem}",
        }
        return web.json_response(body, status=200 if ready else 503)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler(bot.deployer))
    return app


def metrics_handler(deployer: Deployer) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Prometheus' scrape (bot/operations/metrics.py), read from the store at each request."""

    async def scrape(_request: web.Request) -> web.Response:
        body = await deployer.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    return scrape


async def serve_metrics(deployer: Deployer, listen: str) -> web.AppRunner:
    """In Socket Mode there is no HTTP server: `[metrics] listen` starts a small one."""
    host, port = parse_http(listen)
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(deployer))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def run_http(
    bot: SlackBot, address: tuple[str, int], ready: Callable[[str], None], stop: asyncio.Event
) -> None:
    # Requests under way when it stops get a moment (Slack gives up after 3 s anyway),
    # not aiohttp's default minute.
    runner = web.AppRunner(http_app(bot), access_log=None, shutdown_timeout=3.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, address[0], address[1])
        await site.start()
        host, port = runner.addresses[0][:2]
        ready(serving_http(f"http://{host}:{port}"))
        await stop.wait()
    finally:
        await runner.cleanup()


async def run_socket(
    bot: SlackBot, app_token: str, ready: Callable[[str], None], stop: asyncio.Event
) -> None:
    handler = AsyncSocketModeHandler(bot.app, app_token)
    await handler.connect_async()  # type: ignore[no-untyped-call]  # untyped in slack_bolt
    try:
        ready(serving_socket())
        await stop.wait()
    finally:
        await handler.close_async()  # type: ignore[no-untyped-call]  # untyped in slack_bolt
