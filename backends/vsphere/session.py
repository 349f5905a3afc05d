# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""One vSphere session: login and re-login, blocking calls in a thread pool, task waiting
through the PropertyCollector, and the mapping of faults to backend errors.

pyvmomi blocks, so every piece of work is a function run in the session's thread pool
(`Session.run`). Waiting never polls: `Op.watch` takes a PropertyCollector of its own
(an idle one of the session, else a new one), long-polls `WaitForUpdatesEx` on the
watched object and destroys its filter (or, for a task that ended, leaves it: it sends
nothing more), so any number of concurrent waits share the session without stealing
each other's updates.

A caller that gives up (a step timeout, a cancel) does not leave a change running
unseen: the task being waited for is cancelled (or the long poll ended) and
`Session.run` returns only once the thread has finished, at most `cancel_wait_s` later,
so a rollback that follows sees the final state of the hypervisor. A read is simply
left to end on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pyVmomi import vim, vmodl
from pyVmomi.SoapAdapter import SoapStubAdapter

from backends.advice import tls_advice, unresolved
from backends.base import PermanentError, RetryableError, Unreachable
from backends.vsphere.conn import QUIET, Conn, Props, Stub
from bot.models.errors import BackendError, InternalSignal

log = logging.getLogger(__name__)
T = TypeVar("T")

# vSphere 6.5: every vCenter and ESXi since speaks it. Pinned rather than negotiated
# because pyVim's version probe opens a connection without any timeout.
API_VERSION = "vim.version.version12"
# The longest single WaitForUpdatesEx: the server holds the request at most this long.
WAIT_SLICE_S = 30
RETRYABLE_FAULTS = (
    vim.fault.NotAuthenticated,
    vim.fault.TaskInProgress,
    vim.fault.ConcurrentAccess,
    vim.fault.Timedout,
    vmodl.fault.HostCommunication,
    vmodl.fault.RequestCanceled,
)
# TLS errors that mean the connection was cut, not that the certificate is refused.
_CUT_OFF = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to log in; the password is kept apart from anything printable."""

    name: str
    host: str
    port: int
    user: str
    password_env: str
    verify_tls: bool
    ca_bundle: Path | None
    threads: int
    request_timeout_s: float
    cancel_wait_s: float

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


class OpAbandoned(InternalSignal):
    """The caller gave up on this operation; its thread stops at the next chance."""


class Op:
    """One piece of work running in a worker thread, and the way to stop it.

    `cancel` (from another thread) cancels the task being waited for, or ends the long
    poll of a watch without a task. A cancelled task is still waited for until it ends
    (at most `grace_s`), so the caller learns its final state before rolling back.
    """

    def __init__(self, conn: Conn, grace_s: float) -> None:
        self.conn = conn
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._cancelled_at: float | None = None
        self._task: Any = None
        self._collector: Any = None

    def check(self) -> None:
        if self._cancelled_at is not None:
            raise OpAbandoned()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled_at = time.monotonic()
            task, collector = self._task, self._collector
        if task is not None:
            _cancel_task(task)
        elif collector is not None:
            with contextlib.suppress(*QUIET):
                collector.CancelWaitForUpdates()

    def wait(self, task: Any) -> Any:
        """Wait for a task's end; return its result or raise its fault."""
        with self._lock:
            self._task = task
            cancelled = self._cancelled_at is not None
        if cancelled:
            _cancel_task(task)
        paths = ["info.state", "info.error", "info.result"]
        try:
            info = self.watch(task, vim.Task, paths, _ended, ends_quiet=True)
        finally:
            with self._lock:
                self._task = None
        if info["info.state"] == vim.TaskInfo.State.error:
            raise task_fault(info.get("info.error"))
        return info.get("info.result")

    def watch(
        self,
        obj: Any,
        kind: Any,
        paths: list[str],
        done: Callable[[Props], T | None],
        *,
        ends_quiet: bool = False,
    ) -> T:
        """Long-poll `paths` of `obj` until `done(properties so far)` answers non-None.

        The collector is an idle one of the session, if any (`Conn.take_collector`),
        which no one else uses while we wait. Our filter is destroyed afterwards unless
        `ends_quiet` (a task, which changes no more once it ended) and we saw the end:
        then it may stay on the collector. A task wait costs 2 requests, plus one per
        further update; any other wait 3."""
        query = vmodl.query.PropertyCollector
        spec = query.FilterSpec(
            objectSet=[query.ObjectSpec(obj=obj, skip=False)],
            propSet=[query.PropertySpec(type=kind, pathSet=paths, all=False)],
        )
        pc, login, ended, pc_filter = self._filtered(spec)
        with self._lock:
            self._collector = pc
        reusable = False
        try:
            answer = self._updates(pc, done, obj)
            if ends_quiet:
                ended, reusable = ended + 1, True
            return answer
        finally:
            with self._lock:
                self._collector = None
            if not reusable:
                with contextlib.suppress(*QUIET):
                    pc_filter.DestroyPropertyFilter()
                    reusable = True
            if reusable:
                self.conn.give_back(pc, login, ended)
            else:  # a filter may be left on it that still sends: nobody else may use it
                with contextlib.suppress(*QUIET):
                    pc.DestroyPropertyCollector()

    def _filtered(self, spec: Any) -> tuple[Any, int, int, Any]:
        """A collector for one waiter (`Conn.take_collector`) with our filter on it."""
        for attempt in (1, 2):
            pc, login, ended = self.conn.take_collector()
            try:
                return pc, login, ended, pc.CreateFilter(spec, False)
            except vmodl.fault.ManagedObjectNotFound:
                # An idle collector of a session that expired meanwhile (the call
                # logged in again, and the next take makes a new one), or one the
                # server dropped.
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _updates(self, pc: Any, done: Callable[[Props], T | None], obj: Any) -> T:
        options = vmodl.query.PropertyCollector.WaitOptions(maxWaitSeconds=WAIT_SLICE_S)
        state: Props = {}
        version = ""
        while True:
            try:
                update = pc.WaitForUpdatesEx(version, options)
            except vmodl.fault.RequestCanceled:
                update = None  # our own cancel ended the long poll: decided below
            if update is not None:
                version = update.version
                for filter_update in update.filterSet:
                    for change in _changes(filter_update, obj):
                        state[change.name] = change.val
                answer = done(state)
                if answer is not None:
                    return answer
            self._stop_if_given_up()

    def _stop_if_given_up(self) -> None:
        cancelled_at = self._cancelled_at
        if cancelled_at is None:
            return
        if self._task is None or time.monotonic() - cancelled_at > self.grace_s:
            raise OpAbandoned()


def _changes(filter_update: Any, obj: Any) -> list[Any]:
    """The property changes of `obj` alone: a reused collector may also report the
    final state of the ended tasks whose filters it keeps."""
    mine = (o for o in filter_update.objectSet or [] if o.obj._moId == obj._moId)
    return [c for o in mine for c in o.changeSet or []]


def _ended(info: Props) -> Props | None:
    states = (vim.TaskInfo.State.success, vim.TaskInfo.State.error)
    return info if info.get("info.state") in states else None


def _cancel_task(task: Any) -> None:
    # Not every task can be cancelled (a power-on cannot); then it runs to its end.
    with contextlib.suppress(*QUIET):
        task.CancelTask()


def task_fault(error: Any) -> Exception:
    """The fault of a failed task (pyvmomi gives the MethodFault itself for the
    LocalizedMethodFault in `info.error`), with a message."""
    fault = error if isinstance(error, vmodl.MethodFault) else getattr(error, "fault", None)
    text = getattr(error, "localizedMessage", "") or ""
    if not isinstance(fault, vmodl.MethodFault):
        return PermanentError(f"the task failed: {text or error}")
    if not getattr(fault, "msg", "") and text:
        setattr(fault, "msg", text)  # noqa: B010 (pyvmomi's stubs lack `msg`)
    return fault


def fault_text(fault: Any) -> str:
    """What a fault says; vcsim puts only the Go type name into `msg`, which says nothing."""
    msg = str(getattr(fault, "msg", "") or "")
    if msg and not msg.startswith("*types."):
        return msg
    messages = [m.message for m in getattr(fault, "faultMessage", None) or [] if m.message]
    if messages:
        return "; ".join(messages)
    if isinstance(fault, vim.fault.InvalidPowerState):
        return f"the VM is {fault.existingState}"
    if isinstance(fault, vim.fault.DuplicateName):
        return f"the name {fault.name!r} is already in use"
    if isinstance(fault, vim.fault.FileFault):
        return f"{type(fault).__name__.rsplit('.', 1)[-1]}: {fault.file}"
    return str(type(fault).__name__)


StubFactory = Callable[[Any, Callable[[Stub], None]], Stub]


class Session:
    """The backend's one session, connected on first use, and its thread pool.

    `stub` makes the SOAP stub every call goes through (a read-only session's refuses
    what is not a read: backends/vsphere/readonly.py)."""

    def __init__(self, endpoint: Endpoint, password: str, stub: StubFactory = Stub) -> None:
        self.endpoint = endpoint
        self._stub = stub
        self._password = password  # only ever handed to SessionManager.Login
        self._threads = ThreadPoolExecutor(endpoint.threads, thread_name_prefix=endpoint.name)
        self._conn: Conn | None = None
        self._connecting = asyncio.Lock()

    def api_calls(self) -> Counter[str]:
        """SOAP calls so far by method name (`Fetch` is one single property read)."""
        return Counter(self._conn.stub.calls) if self._conn else Counter()

    def api_bytes(self) -> Counter[str]:
        """SOAP bytes so far: request bodies "sent", response bodies "received"."""
        return Counter(self._conn.stub.bytes) if self._conn else Counter()

    async def connection(self) -> Conn:
        async with self._connecting:
            if self._conn is None:
                future = asyncio.get_running_loop().run_in_executor(self._threads, self._connect)
                try:
                    self._conn = await future
                except Exception as exc:
                    raise self.error(exc) from exc
            return self._conn

    def _connect(self) -> Conn:
        ep = self.endpoint
        soap = SoapStubAdapter(
            host=ep.host,
            port=ep.port,
            version=API_VERSION,
            sslContext=self.ssl_context(),
            poolSize=ep.threads,
            httpConnectionTimeout=ep.request_timeout_s,
        )
        stub = self._stub(soap, self._login)
        self._login(stub)
        content = vim.ServiceInstance("ServiceInstance", stub).RetrieveContent()
        api_type = content.about.apiType
        if api_type not in ("VirtualCenter", "HostAgent"):
            raise PermanentError(f"{ep.where} is {api_type!r}, neither vCenter nor ESXi")
        about = content.about.fullName
        log.info("backend %s: logged in to %s (%s) as %s", ep.name, ep.where, about, ep.user)
        return Conn(stub, content, vcenter=api_type == "VirtualCenter")

    def _login(self, stub: Stub) -> None:
        content: Any = vim.ServiceInstance("ServiceInstance", stub).RetrieveContent()
        stub.user_session = content.sessionManager.Login(self.endpoint.user, self._password, None)

    def ssl_context(self) -> ssl.SSLContext:
        if not self.endpoint.verify_tls:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return context
        bundle = self.endpoint.ca_bundle
        try:
            return ssl.create_default_context(cafile=str(bundle) if bundle else None)
        except (OSError, ssl.SSLError) as exc:
            raise PermanentError(
                f"backend {self.endpoint.name}: ca_bundle {bundle}: {exc}"
            ) from None

    async def run(
        self, work: Callable[[Op], T], vm_id: str | None = None, *, changes: bool = True
    ) -> T:
        """Run `work` in the pool. A cancelled caller stops it and, when the work
        `changes` the inventory, waits for its thread to end; a read is left behind."""
        conn = await self.connection()
        op = Op(conn, self.endpoint.cancel_wait_s)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._threads, work, op)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await self._abandon(op, future, changes)
            raise
        except Exception as exc:
            raise self.error(exc, vm_id) from exc

    async def _abandon(self, op: Op, future: asyncio.Future[Any], wait: bool) -> None:
        future.add_done_callback(_consume)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.endpoint.cancel_wait_s):
                await loop.run_in_executor(self._threads, op.cancel)
                if wait:
                    await asyncio.wait([future])

    def error(self, exc: BaseException, vm_id: str | None = None) -> BaseException:
        """Vendor exceptions as backend errors; anything else is a bug and stays itself."""
        ep = self.endpoint
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, vim.fault.InvalidLogin):
            return PermanentError(
                f"the password of {ep.user} was refused by {ep.where}: check "
                f"${ep.password_env} (and `user` in [[backends]] {ep.name})"
            )
        if isinstance(exc, vmodl.MethodFault):
            kind = RetryableError if isinstance(exc, RETRYABLE_FAULTS) else PermanentError
            return kind(f"{ep.name}: {fault_text(exc)}", vm_id=vm_id)
        if isinstance(exc, ssl.SSLError) and not isinstance(exc, _CUT_OFF):
            return PermanentError(tls_advice(ep.name, ep.where, ep.ca_bundle, exc))
        if isinstance(exc, socket.gaierror):
            # Permanent: a name that does not resolve now will not resolve on a retry
            # without someone fixing the configuration or the machine's DNS.
            return PermanentError(unresolved(ep.name, ep.host, exc))
        if isinstance(exc, OSError | http.client.HTTPException):
            # Refused, timed out, cut off or a 5xx: the API does not answer (yet).
            return Unreachable(f"{ep.where} does not answer ({exc})", vm_id=vm_id)
        return exc

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    logout = conn.content.sessionManager.Logout
                    await loop.run_in_executor(self._threads, logout)
            conn.stub.soap.DropConnections()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _consume(future: asyncio.Future[Any]) -> None:
    """Mark an abandoned call's outcome as read: nobody waits for it any more."""
    if not future.cancelled():
        future.exception()
