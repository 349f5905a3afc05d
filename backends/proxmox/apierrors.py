"""How the Proxmox API's failures become `backends.base` errors (split from
backends/proxmox/api.py): the exception kinds callers tell apart (a lock, a task that
failed, an id taken, a refusal), and `map_error`, which gives each failed request the
server's own message and, for the permanent ones, the setting to check."""

from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass

import aiohttp

from backends.advice import cause, tls_advice, unresolved
from backends.base import PermanentError, RetryableError, Unreachable, VMNotFound
from backends.proxmox.http import Credentials, HttpError, LoginRefused
from bot.models.errors import BackendError

# 595-599 are pveproxy's own codes for a node it could not reach (AnyEvent::HTTP).
_UNREACHABLE_CODES = frozenset({502, 503, 504, 595, 596, 597, 598, 599})
# A file lock (flock) another task held for too long; and the config's `lock` key, set
# by an operation that runs for minutes (qemu-server's check_lock: "VM is locked (backup)").
LOCKED = re.compile(r"can't lock file|got timeout")
HELD = re.compile(r"\bis locked \(([\w-]+)\)")
_RUNNING = re.compile(r"is running - destroy failed")
_MISSING = re.compile(r"Configuration file '[^']*' does not exist")
_EXISTS = re.compile(r"already exists")
# The guest agent (qemu-server's assert_agent_available and check_agent_error).
_AGENT_DOWN = re.compile(r"guest agent is not running", re.I)
_NO_SUCH_FILE = re.compile(r"^Agent error: failed to open file .*No such file or directory")


class LockContention(RetryableError):
    """Someone else holds the VM's or the storage's lock; a later try may get it."""


class ConfigLocked(LockContention):
    """The VM's config carries a `lock` (backup, snapshot, migrate, clone, ...): nothing
    will work on it before that operation ends and removes it."""

    def __init__(self, message: str, lock: str, *, vm_id: str | None = None) -> None:
        super().__init__(message, vm_id=vm_id)
        self.lock = lock


class ServerFailed(PermanentError):
    """HTTP 500 with a message no rule here knows ("unable to read task index"): the
    server failed at what it was asked. Final for a change, which it refused; a read of
    a task's state is asked again (`READ_AGAIN`): the task runs on regardless."""


class StillRunning(PermanentError):
    """`VM <id> is running - destroy failed`: the VM must be stopped first."""


class AlreadyExists(PermanentError):
    """The id asked for is taken (a clone target, a `nextid` check)."""


class Forbidden(PermanentError):
    """HTTP 403: the API user may not do this, or may not even see what it asked for."""


class AgentNotRunning(RetryableError):
    """HTTP 500 "QEMU guest agent is not running": the guest has not started its agent
    yet (or it stopped); asking later may find it up."""


class GuestFileMissing(PermanentError):
    """The guest agent could not open a file because it does not exist in the guest."""


class TaskFailed(PermanentError):
    """A task ended with an error; `exitstatus` is Proxmox's own text."""

    def __init__(self, message: str, exitstatus: str, *, vm_id: str | None = None) -> None:
        super().__init__(message, vm_id=vm_id)
        self.exitstatus = exitstatus


class TaskLockTimeout(LockContention):
    """A task that died waiting for a lock: nothing was done, so it can be run again."""


# What a read of a task's state may answer and still work when asked again: the node
# out of reach, a lock, the server failing at the read. Only the task's own exit status
# decides how the step went (api.wait_task).
READ_AGAIN: tuple[type[BackendError], ...] = (RetryableError, ServerFailed)


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
    if held := HELD.search(reason):
        return ConfigLocked(message, held.group(1))
    if LOCKED.search(reason):
        return LockContention(message)
    if _RUNNING.search(reason):
        return StillRunning(message)
    if _MISSING.search(reason):
        return VMNotFound(message)
    if _AGENT_DOWN.search(reason):
        return AgentNotRunning(message)
    if _NO_SUCH_FILE.search(reason):
        return GuestFileMissing(message)
    if _EXISTS.search(reason):
        return AlreadyExists(message)
    if code == 500:
        return ServerFailed(message)
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
