"""The HTTP transport to the Proxmox API: one aiohttp session per endpoint, on the loop.

Until 2026-12 this was proxmoxer (requests on a thread pool). Measured against the fake
(benchmarks/bench_proxmox.py), a request cost the bot 1.0-1.2 ms of CPU that way, on
worker threads serialised by the GIL, and 0.2 ms through aiohttp, with no thread hop.
Fifty deploys move in step, so their requests come in bursts of ~100 (the clones, then
each VM's check and config), and that cost was most of what they added to the
hypervisor's own time. What goes on the wire is what proxmoxer sent: GET and DELETE
parameters in the query, POST and PUT ones as a form, None values left out; an API
token in one header, else a ticket from `POST /access/ticket` as a cookie, with the
CSRF header on every write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from backends.proxmox.pacing import PollTiming
from bot.models.errors import InternalSignal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Credentials:
    """Who we are. The secrets never appear in repr, logs or messages."""

    user: str
    token_id: str | None = None
    token_secret: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    secret_source: str = ""  # the environment variable it came from, for messages

    @property
    def uses_token(self) -> bool:
        return self.token_id is not None


@dataclass(frozen=True)
class ApiSettings:
    host: str
    port: int
    verify: bool | str  # False, True (system CAs) or a CA bundle path
    request_timeout_s: float = 15.0
    max_parallel: int = 16
    ticket_renew_s: float = 3600.0
    polling: PollTiming = field(default_factory=PollTiming)
    task_timeout_s: float = 3600.0
    log_lines: int = 5


class HttpError(InternalSignal):
    """An answer of 400 or more: its status, Proxmox's message (pveproxy puts it in the
    HTTP reason phrase) and the per-parameter `errors` of a 400. Like `LoginRefused`, a
    detail of the transport: apierrors.map_error turns it into a `BackendError` before
    it leaves the API client (api.py)."""

    def __init__(self, status: int, reason: str, errors: object = None) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.errors = errors


class LoginRefused(InternalSignal):
    """`POST /access/ticket` did not give a ticket: user or password is wrong."""


def form(params: dict[str, Any]) -> list[tuple[str, str]]:
    """Parameters as the API reads them: None left out, a list as repeated keys, a bool
    as 0/1 (PVE's booleans), everything else as its text."""
    pairs: list[tuple[str, str]] = []
    for key, value in params.items():
        for item in value if isinstance(value, list | tuple) else [value]:
            if item is not None:
                pairs.append((key, str(int(item)) if isinstance(item, bool) else str(item)))
    return pairs


def _errors(body: bytes) -> object:
    try:
        found = json.loads(body)
    except ValueError:
        return None
    return found.get("errors") if isinstance(found, dict) else None


def _data(body: bytes, status: int) -> Any:
    try:
        return json.loads(body)["data"]
    except (ValueError, KeyError, TypeError):
        raise HttpError(status, "the answer is not the API's JSON") from None


def _tls(verify: bool | str) -> ssl.SSLContext | bool:
    """False (no verification), the system's CAs, or a CA bundle."""
    if verify is False:
        return False
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return ssl.create_default_context()


class Transport:
    """Requests to one endpoint, authenticated. Secrets live here only and never in a
    repr. The session belongs to the loop that made it; a new loop gets its own."""

    def __init__(
        self, settings: ApiSettings, credentials: Credentials, clock: Callable[[], float]
    ) -> None:
        self._settings = settings
        self._credentials = credentials
        self._clock = clock
        self._base = f"https://{settings.host}:{settings.port}/api2/json"
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticket: tuple[str, str] | None = None  # (ticket, CSRF token)
        self._login_at = 0.0
        self._login_lock: asyncio.Lock | None = None
        self.logins = 0

    def __repr__(self) -> str:
        return f"Transport({self._base}, user={self._credentials.user})"

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            s = self._settings
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=_tls(s.verify), limit=s.max_parallel),
                timeout=aiohttp.ClientTimeout(total=s.request_timeout_s),
                cookie_jar=aiohttp.DummyCookieJar(),  # the ticket is sent by hand
                trust_env=False,  # no *_PROXY variable routes the API anywhere else
            )
            self._loop, self._login_lock = loop, asyncio.Lock()
        return self._session

    async def request(self, method: str, path: str, params: dict[str, Any]) -> Any:
        """The answer's `data`; HttpError for a refusal. A ticket the server no longer
        knows (401: a restarted node forgets its tickets) is renewed once and the
        request sent again."""
        refused: str | None = None
        while True:
            headers, ticket = await self._auth(method, refused)
            pairs = form(params)
            query, data = (pairs, None) if method in ("GET", "DELETE") else (None, pairs)
            url = f"{self._base}/{path}"
            async with self._client().request(
                method, url, headers=headers, params=query, data=data
            ) as answer:
                body = await answer.read()
                if answer.status == 401 and ticket is not None and refused is None:
                    log.info("%s: ticket refused; logging in again", self._base)
                    refused = ticket
                    continue
                if answer.status >= 400:
                    raise HttpError(answer.status, answer.reason or "", _errors(body))
                return _data(body, answer.status)

    async def upload(
        self, path: str, params: dict[str, Any], file: Path, filename: str, timeout_s: float
    ) -> Any:
        """A multipart POST (`.../storage/{storage}/upload`): the parameters, then the
        file as the part `filename`, as the web UI sends it. The file is streamed from
        disk; the whole request may take `timeout_s`. A refused ticket is renewed once
        and the file sent again."""
        refused: str | None = None
        while True:
            headers, ticket = await self._auth("POST", refused)
            with file.open("rb") as stream:
                data = aiohttp.FormData()
                for key, value in form(params):
                    data.add_field(key, value)
                data.add_field(
                    "filename", stream, filename=filename, content_type="application/octet-stream"
                )
                timeout = aiohttp.ClientTimeout(
                    total=timeout_s, sock_connect=self._settings.request_timeout_s
                )
                url = f"{self._base}/{path}"
                async with self._client().post(
                    url, headers=headers, data=data, timeout=timeout
                ) as answer:
                    body = await answer.read()
            if answer.status == 401 and ticket is not None and refused is None:
                refused = ticket
                continue
            if answer.status >= 400:
                raise HttpError(answer.status, answer.reason or "", _errors(body))
            return _data(body, answer.status)

    async def _auth(self, method: str, refused: str | None) -> tuple[dict[str, str], str | None]:
        """The headers that authenticate a request, and the ticket in them (None with a
        token)."""
        creds = self._credentials
        if creds.uses_token:
            token = f"{creds.user}!{creds.token_id}={creds.token_secret}"
            return {"Authorization": f"PVEAPIToken={token}"}, None
        ticket, csrf = await self._login(refused)
        headers = {"Cookie": f"PVEAuthCookie={ticket}"}
        if method != "GET":
            headers["CSRFPreventionToken"] = csrf
        return headers, ticket

    async def _login(self, refused: str | None) -> tuple[str, str]:
        """A ticket, logging in when there is none, when it is older than
        `ticket_renew_s` (tickets live 2 h) or when the server refused it (`refused`,
        unless another request has replaced that one meanwhile: one login for all)."""
        self._client()
        assert self._login_lock is not None
        async with self._login_lock:
            held = self._ticket
            stale = self._clock() - self._login_at >= self._settings.ticket_renew_s
            if held is not None and not stale and held[0] != refused:
                return held
            self.logins += 1
            creds = self._credentials
            pairs = [("username", creds.user), ("password", creds.password or "")]
            async with self._client().post(f"{self._base}/access/ticket", data=pairs) as answer:
                body = await answer.read()
                if answer.status != 200:
                    raise LoginRefused(f"{answer.status} {answer.reason}")
            data = _data(body, answer.status)
            self._ticket = (str(data["ticket"]), str(data["CSRFPreventionToken"]))
            self._login_at = self._clock()
            return self._ticket

    async def close(self) -> None:
        session = self._session
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()
        self._session = None
