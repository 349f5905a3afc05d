"""The Proxmox VE API as the backend sees it: requests, auth, errors, tasks.

The requests go through `http.Transport` (aiohttp, on the event loop). This module keeps
the three rules every caller relies on:

* Auth: an API token when one is configured (one header, no expiry, no CSRF), else a
  ticket from username/password, renewed well before its 2 h lifetime and once more
  when the server answers 401 (a restarted node forgets its tickets).
* Errors: every failure of a request becomes a `backends.base` error carrying the
  server's own message (the HTTP reason phrase, plus the per-parameter `errors` of a 400;
  backends/proxmox/apierrors.py).
* Tasks: `wait_task` is the one waiter every mutating call goes through.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends import troubles
from backends.base import PermanentError
from backends.proxmox.apierrors import (
    HELD,
    LOCKED,
    READ_AGAIN,
    ConfigLocked,
    ErrorContext,
    TaskFailed,
    TaskLockTimeout,
    map_error,
)
from backends.proxmox.http import ApiSettings, Credentials, Transport
from backends.proxmox.pacing import Pace
from backends.proxmox.taskwatch import TaskWatcher, Upid
from bot.models.errors import BackendError

log = logging.getLogger(__name__)

_WARNINGS = re.compile(r"WARNINGS: \d+")
_LOG_LIMIT = 1000


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
        # Changes (POST, PUT, DELETE) this process sent, counted when sent and answered:
        # a VM listing kept for reuse is stale once it moved (Inventory.vms).
        self.changes = 0
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
        changes = method != "GET"
        self.changes += changes  # a listing asked while a change is under way is stale
        try:
            answer = await self._http.request(method, path.strip("/"), params)
        except Exception as exc:
            what = what or f"{method} /{path.strip('/')}"
            mapped = map_error(exc, what, self.endpoint, self._context)
            if mapped is None:
                raise
            raise mapped from None
        finally:
            self.changes += changes
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
        the error and the last lines of its log. A poll that fails in a way a later one
        may not (`READ_AGAIN`: the server out of reach, a lock, a 500 such as "unable to
        read task index") is repeated, with the polling's backoff, until the task's
        status is read or the caller's own timeout: the task runs on regardless, and no
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
        try:
            return await self._until_over(upid, what, node, began, deadline, vm_id, pace)
        finally:
            self.changes += 1  # what the task changed is in place: older listings are stale

    async def _until_over(
        self,
        upid: str,
        what: str,
        node: str,
        began: float,
        deadline: float,
        vm_id: str | None,
        pace: Pace | None,
    ) -> str:
        loop = asyncio.get_running_loop()
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
                try:
                    status = await self.task_status(node, upid, what)
                except READ_AGAIN as exc:  # decides nothing: asked again after a pause
                    log.info("%s: polling %s: %s", self.name, upid, exc.message)
                    troubles.trouble(f"{exc.message} (asking again: the task runs on regardless)")
                    pause = self.settings.polling.interval_s(loop.time() - began)
                    await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                    status = None
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
        if held := HELD.search(exitstatus):
            raise ConfigLocked(message, held.group(1), vm_id=vm_id)
        if LOCKED.search(exitstatus):
            raise TaskLockTimeout(message, vm_id=vm_id)
        raise TaskFailed(message, exitstatus, vm_id=vm_id)

    async def task_status(self, node: str, upid: str, what: str) -> dict[str, Any]:
        """One task's status. A failure that asking again may cure is `READ_AGAIN`:
        the callers ask again (the task runs on whether or not it can be read)."""
        self.task_polls += 1
        status: dict[str, Any] = await self.get(f"nodes/{node}/tasks/{upid}/status", what)
        return status

    def polling_nodes(self) -> list[str]:
        """The nodes whose task waits are being polled right now."""
        return sorted(node for node, w in self._watchers.items() if w.running)

    def forget_watcher(self, node: str, watcher: TaskWatcher) -> None:
        if self._watchers.get(node) is watcher:
            del self._watchers[node]

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
