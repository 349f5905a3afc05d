"""The job queue: bounded concurrency, FIFO per backend, cancellable, drainable.

Limits are a global count and a per-backend count. Jobs wait in one FIFO per backend;
whenever a job ends, the oldest waiting job whose backend has room starts, so one busy
hypervisor cannot starve the others and no backend ever runs more than its limit.
The queue keeps only ids: the store holds the jobs, so a restart re-queues from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Waiting:
    seq: int
    job_id: str


class JobQueue:
    def __init__(
        self,
        run: Callable[[str], Awaitable[object]],
        *,
        max_running: int,
        max_per_backend: int,
    ) -> None:
        self._run = run
        self.max_running = max_running
        self.max_per_backend = max_per_backend
        self._waiting: dict[str, deque[_Waiting]] = {}
        self._running: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._per_backend: dict[str, int] = {}
        self._seq = 0
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.peak_per_backend: dict[str, int] = {}
        self.on_room: Callable[[], None] | None = None  # a slot freed: look for work
        self.started_order: list[str] = []
        # Jobs whose task ended on an exception, with it: such a job may be left without
        # a final state (a write that failed), and its runner finishes it (bot/ownership/claims.py).
        self.crashed: dict[str, Exception] = {}

    # --- state --------------------------------------------------------------------

    def is_running(self, job_id: str) -> bool:
        return job_id in self._running

    def is_waiting(self, job_id: str) -> bool:
        return any(w.job_id == job_id for q in self._waiting.values() for w in q)

    def running_ids(self) -> list[str]:
        return list(self._running)

    def waiting_ids(self) -> list[str]:
        return [w.job_id for q in self._waiting.values() for w in q]

    def room(self) -> int:
        """How many more jobs this process could start now (claims take no more)."""
        if self._closed:
            return 0
        return max(0, self.max_running - len(self._running) - self.waiting_count)

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def waiting_count(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def running_on(self, backend: str) -> int:
        return self._per_backend.get(backend, 0)

    def waiting_on(self, backend: str) -> int:
        return len(self._waiting.get(backend, ()))

    # --- operations ---------------------------------------------------------------

    def submit(self, job_id: str, backend: str) -> None:
        if self._closed:
            raise RuntimeError("the queue is shutting down")
        self._seq += 1
        self._waiting.setdefault(backend, deque()).append(_Waiting(self._seq, job_id))
        self._idle.clear()
        self._pump()

    def cancel(self, job_id: str) -> Literal["waiting", "running"] | None:
        """Drop a waiting job, or cancel a running one (its pipeline then rolls back)."""
        for queue in self._waiting.values():
            for item in queue:
                if item.job_id == job_id:
                    queue.remove(item)
                    self._check_idle()
                    return "waiting"
        if job_id in self._running:
            self._running[job_id][1].cancel()
            return "running"
        return None

    async def drain(self) -> None:
        """Wait until nothing is waiting or running (tests use this instead of sleeping)."""
        await self._idle.wait()

    async def shutdown(self, grace_s: float, rollback_s: float | None = None) -> None:
        """Stop starting jobs; give running ones `grace_s`, then cancel them (they roll back).

        Waiting jobs stay queued in the store and start again on the next run. With
        `rollback_s`, rollbacks still going that long after the cancel are left running
        (a stopping server: the runner that takes the job over finishes it).
        """
        self._closed = True
        self._waiting.clear()
        tasks = [task for _backend, task in self._running.values()]
        if not tasks:
            self._idle.set()
            return
        _done, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            _done, left = await asyncio.wait(pending, timeout=rollback_s)
            if left:
                log.warning("leaving %d job(s) still rolling back to another runner", len(left))
        self._idle.set()

    # --- machinery ----------------------------------------------------------------

    def _pump(self) -> None:
        while not self._closed and len(self._running) < self.max_running:
            candidates = [
                (q[0].seq, backend)
                for backend, q in self._waiting.items()
                if q and self._per_backend.get(backend, 0) < self.max_per_backend
            ]
            if not candidates:
                break
            _seq, backend = min(candidates)
            item = self._waiting[backend].popleft()
            self._start(item.job_id, backend)
        self._check_idle()

    def _start(self, job_id: str, backend: str) -> None:
        count = self._per_backend.get(backend, 0) + 1
        self._per_backend[backend] = count
        self.peak_per_backend[backend] = max(self.peak_per_backend.get(backend, 0), count)
        self.started_order.append(job_id)
        task = asyncio.create_task(self._guard(job_id), name=f"job-{job_id}")
        self._running[job_id] = (backend, task)
        task.add_done_callback(lambda _t: self._finished(job_id))

    async def _guard(self, job_id: str) -> None:
        try:
            await self._run(job_id)
        except asyncio.CancelledError:
            pass  # the pipeline already recorded the cancel and rolled back
        except Exception as exc:
            log.exception("job %s: the runner failed", job_id)
            self.crashed[job_id] = exc

    def _finished(self, job_id: str) -> None:
        backend, _task = self._running.pop(job_id)
        self._per_backend[backend] -= 1
        self._pump()
        if self.on_room is not None and self.room() > 0:
            self.on_room()

    def _check_idle(self) -> None:
        if not self._running and not any(self._waiting.values()):
            self._idle.set()
