"""The Proxmox VE API as the backend sees it: requests, auth, errors, tasks.

The requests go through `http.Transport` (aiohttp, on the event loop). This module keeps
the three rules every caller relies on:

* Auth: an API token when one is configured (one header, no expiry, no CSRF), else a
  ticket from username/password, renewed well before its 2 h lifetime and once more
  when the server answers 401 (a restarted node forgets its tickets).
* Errors: every failure of a request becomes a `backends.base` error carrying the
  server's own message (the HTTP reason phrase, plus the per-parameter `errors` of a 400).
* Tasks: `wait_task` is the one waiter every mutating call goes through.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from backends.advice import cause, tls_advice, unresolved
from backends.base import (
    BackendError,
    PermanentError,
    RetryableError,
    Unreachable,
    VMNotFound,
)
from backends.proxmox.http import HttpError, LoginRefused, Transport
from backends.proxmox.pacing import Pace, PollTiming
from backends.proxmox.taskwatch import TaskWatcher, Upid

log = logging.getLogger(__name__)

# 595-599 are pveproxy's own codes for a node it could not reach (AnyEvent::HTTP).
_UNREACHABLE_CODES = frozenset({502, 503, 504, 595, 596, 597, 598, 599})
# A file lock (flock) another task held for too long; and the config's `lock` key, set
# by an operation that runs for minutes (qemu-server's check_lock: "VM is locked (backup)").
_LOCKED = re.compile(r"can't lock file|got timeout")
_HELD = re.compile(r"\bis locked \(([\w-]+)\)")
_RUNNING = re.compile(r"is running - destroy failed")
_MISSING = re.compile(r"Configuration file '[^']*' does not exist")
_EXISTS = re.compile(r"already exists")
_WARNINGS = re.compile(r"WARNINGS: \d+")
_LOG_LIMIT = 1000


class LockContention(RetryableError):
    """Someone else holds the VM's or the storage's lock; a later try may get it."""


class ConfigLocked(LockContention):
    """The VM's config carries a `lock` (backup, snapshot, migrate, clone, ...): nothing
    will work on it before that operation ends and removes it."""

    def __init__(self, message: str, lock: str, *, vm_id: str | None = None) -> None:
        super().__init__(message, vm_id=vm_id)
        self.lock = lock


class StillRunning(PermanentError):
    """`VM <id> is running - destroy failed`: the VM must be stopped first."""


class AlreadyExists(PermanentError):
    """The id asked for is taken (a clone target, a `nextid` check)."""


class Forbidden(PermanentError):
    """HTTP 403: the API user may not do this, or may not even see what it asked for."""


class TaskFailed(PermanentError):
    """A task ended with an error; `exitstatus` is Proxmox's own text."""

    def __init__(self, message: str, exitstatus: str, *, vm_id: str | None = None) -> None:
        super().__init__(message, vm_id=vm_id)
        self.exitstatus = exitstatus


class TaskLockTimeout(LockContention):
    """A task that died waiting for a lock: nothing was done, so it can be run again."""


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


def _param_errors(errors: object) -> str:
    if isinstance(errors, dict) and errors:
        return "; ".join(f"{k}: {str(v).strip()}" for k, v in sorted(errors.items()))
    return ""


def map_error(
    exc: Exception, what: str, endpoint: str, context: ErrorContext | None = None
) -> BackendError | None:
    """The backends.base error for a failed request; None for anything else
    (a bug, which must surface as one). `context` lets the permanent ones (credentials,
    certificate, host name) say which setting to check."""
    ctx = context or ErrorContext(endpoint.rsplit(":", 1)[0], endpoint)
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, HttpError):
        return _refusal(exc, what, endpoint, ctx)
    if isinstance(exc, aiohttp.ClientConnectorCertificateError) and isinstance(
        exc.certificate_error, ssl.SSLError
    ):
        advice = tls_advice(ctx.backend, endpoint, ctx.ca_bundle, exc.certificate_error)
        return PermanentError(f"{what}: {advice}")
    if isinstance(exc, aiohttp.ClientSSLError):
        tls = cause(exc, ssl.SSLError) or getattr(exc, "os_error", None)
        if isinstance(tls, ssl.SSLError) and not isinstance(tls, ssl.SSLEOFError):
            advice = tls_advice(ctx.backend, endpoint, ctx.ca_bundle, tls)
            return PermanentError(f"{what}: {advice}")
        return PermanentError(
            f"{what}: TLS verification of {endpoint} failed: set ca_bundle to the CA that "
            "signed the Proxmox certificate (or, knowingly, verify_tls = false)"
        )
    if isinstance(exc, TimeoutError):  # aiohttp's own timeouts are TimeoutErrors too
        return Unreachable(f"{what}: {endpoint} did not answer in time")
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Permanent: a retry resolves the same name with the same DNS.
        if isinstance(unknown := exc.os_error, socket.gaierror):
            return PermanentError(f"{what}: {unresolved(ctx.backend, ctx.host, unknown)}")
        return Unreachable(f"{what}: cannot reach {endpoint} ({exc.os_error.strerror or exc})")
    if isinstance(exc, LoginRefused):
        return PermanentError(f"{what}: login failed ({exc}): {ctx.refused(endpoint)}")
    if isinstance(exc, aiohttp.ClientError):
        return Unreachable(f"{what}: talking to {endpoint} failed ({type(exc).__name__})")
    return None


def _refusal(exc: HttpError, what: str, endpoint: str, ctx: ErrorContext) -> BackendError:
    """An answer of 400 or more, by its status and Proxmox's message."""
    code, reason = exc.status, exc.reason.strip()
    detail = _param_errors(exc.errors)
    message = f"{what}: {reason}" + (f" ({detail})" if detail else "")
    if code == 400 and _EXISTS.search(detail):
        return AlreadyExists(message)
    if code == 403:
        return Forbidden(message)
    if code in (400, 501):
        return PermanentError(message)
    if code == 401:
        return PermanentError(f"{what}: {ctx.refused(endpoint)} ({reason})")
    if code in _UNREACHABLE_CODES:
        return Unreachable(f"{what}: {endpoint} answered {code} {reason}")
    if held := _HELD.search(reason):
        return ConfigLocked(message, held.group(1))
    if _LOCKED.search(reason):
        return LockContention(message)
    if _RUNNING.search(reason):
        return StillRunning(message)
    if _MISSING.search(reason):
        return VMNotFound(message)
    if _EXISTS.search(reason):
        return AlreadyExists(message)
    return PermanentError(message)


@dataclass(frozen=True)
class ErrorContext:
    """What an error message needs to name the setting to check."""

    host: str
    backend: str
    ca_bundle: str | None = None
    credentials: Credentials | None = None

    def refused(self, endpoint: str) -> str:
        creds = self.credentials
        if creds is None:
            return f"{endpoint} refused our credentials"
        where = f"[[backends]] {self.backend}"
        if creds.uses_token:
            return (
                f"the API token {creds.user}!{creds.token_id} was refused by {endpoint}: "
                f"check ${creds.secret_source} (and `user`, `token_id` in {where})"
            )
        return (
            f"the password of {creds.user} was refused by {endpoint}: check "
            f"${creds.secret_source} (and `user` in {where})"
        )


class PveApi:
    """One Proxmox endpoint. `requests_sent` counts every API request; `task_polls`
    the share of them the task waiter made."""

    def __init__(
        self,
        name: str,
        settings: ApiSettings,
        credentials: Credentials,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.settings = settings
        self.endpoint = f"{settings.host}:{settings.port}"
        self.requests_sent = 0
        self.task_polls = 0
        self._credentials = credentials
        ca_bundle = settings.verify if isinstance(settings.verify, str) else None
        self._context = ErrorContext(settings.host, name, ca_bundle, credentials)
        self.clock = clock  # injectable: tests move time on to expire tickets
        self._http = Transport(settings, credentials, lambda: self.clock())
        self._watchers: dict[str, TaskWatcher] = {}  # node -> its waits' shared poller

    # --- requests -------------------------------------------------------------------

    async def get(self, path: str, what: str = "", **params: Any) -> Any:
        return await self.call("GET", path, what, params)

    async def post(self, path: str, what: str = "", **params: Any) -> Any:
        return await self.call("POST", path, what, params)

    async def put(self, path: str, what: str = "", **params: Any) -> Any:
        return await self.call("PUT", path, what, params)

    async def delete(self, path: str, what: str = "", **params: Any) -> Any:
        return await self.call("DELETE", path, what, params)

    async def call(self, method: str, path: str, what: str, params: dict[str, Any]) -> Any:
        self.requests_sent += 1
        try:
            answer = await self._http.request(method, path.strip("/"), params)
        except Exception as exc:
            what = what or f"{method} /{path.strip('/')}"
            mapped = map_error(exc, what, self.endpoint, self._context)
            if mapped is None:
                raise
            raise mapped from None
        if isinstance(answer, str) and answer.startswith("UPID:"):
            return Upid(answer, asyncio.get_running_loop().time())
        return answer

    async def upload(self, path: str, what: str, file: Path, filename: str, **params: Any) -> Any:
        """A file upload (multipart POST); the task's UPID as `call` returns it. The
        request may take as long as a task (`task_timeout_s`): the file travels in it."""
        self.requests_sent += 1
        timeout_s = self.settings.task_timeout_s
        try:
            answer = await self._http.upload(path.strip("/"), params, file, filename, timeout_s)
        except Exception as exc:
            mapped = map_error(
                exc, what or f"POST /{path.strip('/')}", self.endpoint, self._context
            )
            if mapped is None:
                raise
            raise mapped from None
        if isinstance(answer, str) and answer.startswith("UPID:"):
            return Upid(answer, asyncio.get_running_loop().time())
        return answer

    @property
    def logins(self) -> int:
        """Tickets asked for (`POST /access/ticket`): 0 with an API token."""
        return self._http.logins

    # --- tasks ------------------------------------------------------------------------

    async def wait_task(
        self, upid: str, what: str, *, vm_id: str | None = None, pace: Pace | None = None
    ) -> str:
        """Wait until the task `upid` has stopped; return its exit status on success
        (`OK` or `WARNINGS: N`). A failure raises TaskFailed (TaskLockTimeout when it
        died waiting for a file lock, ConfigLocked when the VM's config was locked) with
        the error and the last lines of its log. A poll
        that cannot reach the server is repeated: the task runs on regardless, and no
        caller may act on the VM before it has ended.

        The waits on one node share their polling (`TaskWatcher`): one list of the
        node's recent tasks serves them all, and says how the finished ones ended.
        `pace` names the operation, so the wait looks when such a task usually ends."""
        node = upid_node(upid)
        loop = asyncio.get_running_loop()
        # From the answer that started it (Upid), else now; never a time to come.
        began = min(loop.time(), getattr(upid, "answered_at", float("inf")))
        if pace is not None:
            pace.began_at = began
        deadline = began + self.settings.task_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    status = await self._watcher(node).wait(upid, what, began, pace)
            except TimeoutError:
                raise PermanentError(
                    f"{what}: task {upid} still running after {self.settings.task_timeout_s:g} s",
                    vm_id=vm_id,
                ) from None
            if status is None:  # no longer listed as running: its own status says how
                status = await self._task_status(node, upid, what)
            if status is not None and status.get("status") == "stopped":
                break
            if loop.time() >= deadline:  # listed as gone, yet running: not yet listed
                raise PermanentError(
                    f"{what}: task {upid} still running after {self.settings.task_timeout_s:g} s",
                    vm_id=vm_id,
                )
        exitstatus = str(status.get("exitstatus", ""))
        if exitstatus == "OK" or _WARNINGS.fullmatch(exitstatus):
            return exitstatus
        tail = await self._log_tail(node, upid, what)
        message = f"{what} failed: {exitstatus}" + (f" (task log: {tail})" if tail else "")
        if held := _HELD.search(exitstatus):
            raise ConfigLocked(message, held.group(1), vm_id=vm_id)
        if _LOCKED.search(exitstatus):
            raise TaskLockTimeout(message, vm_id=vm_id)
        raise TaskFailed(message, exitstatus, vm_id=vm_id)

    async def _task_status(self, node: str, upid: str, what: str) -> dict[str, Any] | None:
        """One task's status; None when the server could not be asked (try again later)."""
        try:
            self.task_polls += 1
            status: dict[str, Any] = await self.get(f"nodes/{node}/tasks/{upid}/status", what)
        except (Unreachable, LockContention) as exc:
            log.info("%s: polling %s: %s", self.name, upid, exc.message)
            return None
        return status

    def polling_nodes(self) -> list[str]:
        """The nodes whose task waits are being polled right now."""
        return sorted(node for node, w in self._watchers.items() if w.running)

    def _watcher(self, node: str) -> TaskWatcher:
        watcher = self._watchers.get(node)
        if watcher is None:
            watcher = self._watchers[node] = TaskWatcher(self, node)
        return watcher

    async def _log_tail(self, node: str, upid: str, what: str) -> str:
        """The last lines of a task's log, minus the `TASK ERROR` line that repeats the
        exit status; empty when the log cannot be read (the error is known already)."""
        try:
            self.task_polls += 1
            lines = await self.get(f"nodes/{node}/tasks/{upid}/log", what, limit=_LOG_LIMIT)
        except BackendError:
            return ""
        texts = [str(line.get("t", "")) for line in lines if isinstance(line, dict)]
        texts = [t for t in texts if t and not t.startswith("TASK ERROR:")]
        return " | ".join(texts[-self.settings.log_lines :])

    async def close(self) -> None:
        for watcher in list(self._watchers.values()):
            await watcher.stop()
        await self._http.close()


def upid_node(upid: str) -> str:
    """The node a task runs on: `UPID:{node}:{pid}:{pstart}:{starttime}:{type}:{id}:{user}:`."""
    parts = upid.split(":")
    if len(parts) < 9 or parts[0] != "UPID" or not parts[1]:
        raise PermanentError(f"the server answered {upid!r} where a task id (UPID) belongs")
    return parts[1]
