"""The task waits on one node, polled together and paced by what each task is expected
to take (`pacing`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from backends import troubles
from backends.base import PermanentError
from backends.proxmox.apierrors import READ_AGAIN
from backends.proxmox.http import ApiSettings
from backends.proxmox.pacing import Pace, Schedule
from bot.models.errors import BackendError

log = logging.getLogger(__name__)
_LIST_LIMIT = 1000  # tasks listed per poll (the server's default is 50)


class TaskSource(Protocol):
    """What a watcher asks of its endpoint (backends/proxmox/api.PveApi)."""

    name: str
    settings: ApiSettings
    task_polls: int  # every look at a task, counted by whoever makes it

    async def get(self, path: str, what: str = "", **params: Any) -> Any: ...

    async def task_status(self, node: str, upid: str, what: str) -> dict[str, Any]: ...

    def forget_watcher(self, node: str, watcher: TaskWatcher) -> None:
        """The watcher of `node` has no waits left and stopped: start a new one next."""
        ...


@dataclass(eq=False)
class _Waiter:
    upid: str
    what: str
    began: float  # when the wait began: its schedule counts from there
    schedule: Schedule
    pace: Pace | None
    # The task's final status, or None: "no longer listed as running, ask it".
    future: asyncio.Future[dict[str, Any] | None]
    told: list[str] | None = None  # its caller's (backends.troubles): failed looks

    def missed(self, sent: float, exc: BackendError) -> None:
        """A look at it failed (READ_AGAIN): looked at again later, and its caller told."""
        self.schedule.miss(sent - self.began)
        if self.told is not None:
            self.told[:] = [f"{exc.message} (asking again: the task runs on regardless)"]

    def due(self) -> float:
        return self.began + self.schedule.next_at()

    def done(self, status: dict[str, Any] | None, sent: float) -> None:
        """The task is over, as the look sent at `sent` found. That send time, not the
        answer's arrival, is what a schedule can aim at: learning the arrival would add
        the request's own time to the estimate at every look that came late, and under
        load (fifty deploys' requests queued) the estimates would creep up."""
        if self.future.done():
            return
        if status is not None and self.pace is not None:
            self.pace.learn(self.schedule, sent - self.began, sent)
        self.future.set_result(status)


class TaskWatcher:
    """The task waits on one node, polled together. While any wait is pending one loop
    polls, when the earliest wait is due (its `Schedule`: at the task's expected end,
    then geometrically later; fast polling for a task of unknown length). A lone wait
    asks for its task's status (as many requests as a wait of its own); two or more
    share `GET /nodes/{node}/tasks?source=all&since=...`, which lists the node's tasks
    since the oldest wait's began: running ones as `RUNNING` without an `endtime`,
    finished ones with their `endtime` and exit status, which ends their waits with no
    request of their own. A task missing from the list (started too recently to be
    listed) is resolved with None for its waiter to ask its status once. Every look at
    a wait, its own or shared, counts as a look for its schedule. A look that fails in
    a way a later one may not (`READ_AGAIN`: the node out of reach, a 500) ends no
    wait: each is looked at again on its schedule's backoff, and its caller is told
    (`backends.troubles`); only a task's own exit status, or the caller's timeout, ends
    its wait."""

    def __init__(self, api: TaskSource, node: str) -> None:
        self.api = api
        self.node = node
        self.waiters: set[_Waiter] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    async def wait(
        self, upid: str, what: str, began: float, pace: Pace | None
    ) -> dict[str, Any] | None:
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        timing = self.api.settings.polling
        schedule = pace.schedule(timing) if pace else Schedule(None, timing)
        waiter = _Waiter(upid, what, began, schedule, pace, future, troubles.current())
        self.waiters.add(waiter)
        self._wake.set()  # a new wait may be due earlier than the others
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run(), name=f"pve-tasks-{self.node}")
        try:
            return await future  # cancelling this wait cancels its future only
        finally:
            self.waiters.discard(waiter)

    @property
    def running(self) -> bool:
        return self._loop is not None and not self._loop.done()

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)

    def _pending(self) -> list[_Waiter]:
        return [w for w in self.waiters if not w.future.done()]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while pending := self._pending():
                due = min(w.due() for w in pending)
                now = loop.time()
                if now < due:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(due - now):
                            await self._wake.wait()
                    continue
                try:
                    await self._poll(pending, now)
                except Exception as exc:  # a permanent refusal, or a bug: every wait learns
                    for waiter in pending:
                        if not waiter.future.done():
                            waiter.future.set_exception(exc)
        finally:
            for waiter in self._pending():  # only when the loop was stopped (close())
                waiter.future.set_exception(
                    PermanentError(f"{waiter.what}: the client was closed while waiting")
                )
            if not self.waiters:
                self.api.forget_watcher(self.node, self)

    async def _poll(self, pending: list[_Waiter], sent: float) -> None:
        api = self.api
        if len(pending) == 1:
            (waiter,) = pending
            try:
                status = await api.task_status(self.node, waiter.upid, waiter.what)
            except READ_AGAIN as exc:
                log.info("%s: polling %s: %s", api.name, waiter.upid, exc.message)
                waiter.missed(sent, exc)
                return
            if status.get("status") == "stopped":
                waiter.done(status, sent)
            else:
                waiter.schedule.saw_running(sent - waiter.began)
            return
        # The running tasks and the finished ones (with their exit status) since the
        # oldest wait's task began: one answer ends every wait whose task is over.
        params: dict[str, Any] = {"source": "all", "limit": _LIST_LIMIT}
        starts = [upid_starttime(w.upid) for w in pending]
        if None not in starts:
            params["since"] = min(s for s in starts if s is not None)
        try:
            api.task_polls += 1
            listed = await api.get(
                f"nodes/{self.node}/tasks", f"listing the tasks of node {self.node}", **params
            )
        except READ_AGAIN as exc:  # one failed read decides nothing: asked again
            log.info("%s: polling the tasks of %s: %s", api.name, self.node, exc.message)
            for waiter in pending:
                waiter.missed(sent, exc)
            return
        items = {str(i.get("upid")): i for i in listed if isinstance(i, dict)}
        for waiter in pending:
            if waiter.future.done():
                continue
            item = items.get(waiter.upid)
            if item is None:  # too new to be listed, or past the limit: ask it
                waiter.future.set_result(None)
            elif item.get("endtime") is None or item.get("status") == "RUNNING":
                waiter.schedule.saw_running(sent - waiter.began)
            elif exitstatus := str(item.get("status") or ""):
                waiter.done({"status": "stopped", "exitstatus": exitstatus}, sent)
            else:  # over, but without a status: ask it
                waiter.future.set_result(None)


class Upid(str):
    """A task's id as the API answered it, and when that answer arrived (loop time).
    The task began just before: its wait counts from there, not from whenever its
    caller gets round to waiting (after a store write, say), which would make every
    look that much later."""

    answered_at: float

    def __new__(cls, value: str, answered_at: float) -> Upid:
        upid = super().__new__(cls, value)
        upid.answered_at = answered_at
        return upid


def upid_starttime(upid: str) -> int | None:
    """When a task began (UNIX time, the UPID's fifth field in hex); None if unreadable."""
    try:
        return int(upid.split(":")[4], 16)
    except (IndexError, ValueError):
        return None
