"""The queue on its own, with a runner whose jobs the test releases one by one."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from bot.jobs.queue import JobQueue


class Gate:
    """A runner: each job waits for the test to release it, and reports concurrency."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.running: set[str] = set()
        self.peak = 0
        self.changed = asyncio.Condition()

    async def run(self, job_id: str) -> None:
        self.started.append(job_id)
        self.running.add(job_id)
        self.peak = max(self.peak, len(self.running))
        async with self.changed:
            self.changed.notify_all()
        try:
            await self.release[job_id].wait()
        except asyncio.CancelledError:
            self.cancelled.append(job_id)
            raise
        finally:
            self.running.discard(job_id)

    async def until_started(self, count: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.started) >= count)


def backend_of(job_id: str) -> str:
    return job_id.split("-")[0]


async def test_limits_hold_and_each_backend_is_fifo() -> None:
    gate = Gate()
    queue = JobQueue(gate.run, max_running=3, max_per_backend=2)
    jobs = [f"{b}-{i}" for i in range(5) for b in ("pve", "esx")]
    for job in jobs:
        queue.submit(job, backend_of(job))
    await gate.until_started(3)
    assert queue.running_count == 3
    assert gate.started == ["pve-0", "esx-0", "pve-1"]
    # Release in an arbitrary order; the invariants must hold throughout.
    for job in [
        "pve-0",
        "esx-0",
        "pve-1",
        "esx-1",
        "pve-2",
        "esx-2",
        "pve-3",
        "esx-3",
        "pve-4",
        "esx-4",
    ]:
        await gate.until_started(min(len(jobs), jobs.index(job) + 1))
        gate.release[job].set()
    await queue.drain()
    assert gate.peak <= 3
    assert max(queue.peak_per_backend.values()) <= 2
    for backend in ("pve", "esx"):
        order = [j for j in gate.started if backend_of(j) == backend]
        assert order == [f"{backend}-{i}" for i in range(5)]


async def test_a_busy_backend_does_not_starve_another() -> None:
    gate = Gate()
    queue = JobQueue(gate.run, max_running=4, max_per_backend=1)
    for i in range(3):
        queue.submit(f"pve-{i}", "pve")
    queue.submit("esx-0", "esx")
    await gate.until_started(2)
    assert gate.started == ["pve-0", "esx-0"]
    for job in ["pve-0", "esx-0", "pve-1", "pve-2"]:
        gate.release[job].set()
    await queue.drain()
    assert gate.started == ["pve-0", "esx-0", "pve-1", "pve-2"]


async def test_cancel_waiting_and_running_jobs() -> None:
    gate = Gate()
    queue = JobQueue(gate.run, max_running=1, max_per_backend=1)
    queue.submit("a", "x")
    queue.submit("b", "x")
    await gate.until_started(1)
    assert queue.cancel("b") == "waiting"
    assert queue.cancel("a") == "running"
    assert queue.cancel("nope") is None
    await queue.drain()
    assert gate.started == ["a"]
    assert gate.cancelled == ["a"]


async def test_shutdown_lets_running_jobs_finish_within_grace() -> None:
    gate = Gate()
    queue = JobQueue(gate.run, max_running=2, max_per_backend=2)
    for job in ("a", "b", "c"):
        queue.submit(job, "x")
    await gate.until_started(2)
    gate.release["a"].set()
    gate.release["b"].set()
    await queue.shutdown(grace_s=5)
    assert gate.cancelled == []
    assert gate.started == ["a", "b"]  # c stays queued (in the store) for the next start


async def test_shutdown_cancels_what_outlives_the_grace() -> None:
    gate = Gate()
    queue = JobQueue(gate.run, max_running=2, max_per_backend=2)
    queue.submit("stuck", "x")
    await gate.until_started(1)
    await queue.shutdown(grace_s=0.01)
    assert gate.cancelled == ["stuck"]
    assert queue.running_count == 0
