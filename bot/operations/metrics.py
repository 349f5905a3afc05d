"""Prometheus metrics: what operators put on dashboards and alert on.

One `Metrics` per core (bot/app/compose.py), on a registry of its own (several cores share a
test process). Two kinds of figure:

- what this process saw, counted as it happens (it listens as a `Progress`): step
  durations per backend, step and outcome; jobs it finished, by state; rollbacks;
  approval waits; Slack calls refused with 429;
- what is true now, read at each scrape: this process's queue per backend; whether each
  backend answers (asked at most every 30 s); and from the store (the same for every
  replica: take `max` across them) jobs by state, jobs with wreckage left, notices
  still to tell in chat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.base import Backend
from bot.jobs.queue import JobQueue
from bot.models import Job, JobState, RollbackReport, utcnow
from bot.ownership.storewatch import StoreWatch
from store.db import Store

log = logging.getLogger(__name__)
# Steps take from a second (config) to many minutes (a full clone on slow storage).
STEP_BUCKETS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800)
APPROVAL_BUCKETS_S = (60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LOOK_EVERY_S = 30.0
LOOK_TIMEOUT_S = 5.0


class Metrics:
    """A `Progress` listener that counts, and the scrape of what is true now."""

    def __init__(
        self,
        store: Store,
        storewatch: StoreWatch,
        backends: Mapping[str, Backend],
        queue: JobQueue,
    ) -> None:
        self.store, self.storewatch, self.backends = store, storewatch, backends
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Histogram(
            "deploybot_step_duration_seconds",
            "How long each pipeline step took, by backend, step and outcome (ok/failed).",
            ["backend", "step", "outcome"],
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.finished = Counter(
            "deploybot_jobs_finished_total",
            "Jobs this process ran to a final state, by backend and state.",
            ["backend", "state"],
            registry=r,
        )
        self.rollbacks = Counter(
            "deploybot_rollbacks_total",
            "Rollbacks this process ran, by backend and whether they left wreckage.",
            ["backend", "complete"],
            registry=r,
        )
        self.approval_wait = Histogram(
            "deploybot_approval_wait_seconds",
            "From request to decision, for requests that needed approval.",
            ["decision"],
            buckets=APPROVAL_BUCKETS_S,
            registry=r,
        )
        self.slack_throttled = Counter(
            "deploybot_slack_throttled_total",
            "Slack Web API calls answered 429 after the SDK's own retries.",
            registry=r,
        )
        self._stored = Gauge(
            "deploybot_jobs", "Jobs in the store by state (all replicas).", ["state"], registry=r
        )
        self._wreckage = Gauge(
            "deploybot_jobs_with_wreckage",
            "Finished jobs whose rollback left something behind (all replicas).",
            registry=r,
        )
        self._backlog = Gauge(
            "deploybot_chat_backlog",
            "Notices the store still holds for chat, undelivered (all replicas).",
            registry=r,
        )
        self._up = Gauge(
            "deploybot_backend_up",
            "1 when the backend answered its last look (its templates), 0 when not.",
            ["backend"],
            registry=r,
        )
        self._store_up = Gauge(
            "deploybot_store_up",
            "1 when the database answered this process's last probe, 0 when not.",
            registry=r,
        )
        self._looked: dict[str, float] = {}  # backend -> when it was last looked at
        r.register(_Queue(queue, backends))

    async def render(self) -> bytes:
        """The exposition text, with the store's figures read now; while the database
        does not answer, its figures are the last ones read, and `deploybot_store_up` 0."""
        watch = self.storewatch
        self._store_up.set(1 if watch.reachable else 0)
        if watch.reachable:
            try:
                async with asyncio.timeout(LOOK_TIMEOUT_S):
                    await self._read_store()
            except TimeoutError:  # slow is not down (a burst): the last figures stand
                log.info("metrics: the store's figures took over %g s", LOOK_TIMEOUT_S)
            except Exception as exc:  # the scrape still answers: the gauge says why not
                watch.seen(f"{type(exc).__name__} while reading the figures")
                self._store_up.set(0)
        await asyncio.gather(*(self._look(name) for name in self.backends))
        return generate_latest(self.registry)

    async def _read_store(self) -> None:
        store = self.store
        counts = await store.jobs.count_by_state()
        for state in JobState:
            self._stored.labels(state.value).set(counts.get(state.value, 0))
        self._wreckage.set(len(await store.jobs.with_wreckage()))
        self._backlog.set(await store.outbox.pending())

    async def _look(self, name: str) -> None:
        """Ask the backend something cheap, at most every LOOK_EVERY_S whatever the
        scrape rate; a slow answer counts as down."""
        now = time.monotonic()
        if now - self._looked.get(name, -LOOK_EVERY_S) < LOOK_EVERY_S:
            return
        self._looked[name] = now
        try:
            async with asyncio.timeout(LOOK_TIMEOUT_S):
                await self.backends[name].templates()
            self._up.labels(name).set(1)
        except Exception:  # any failure is "down"; the reason is the backend's log's
            self._up.labels(name).set(0)

    # --- as a Progress listener ------------------------------------------------------

    async def job_updated(self, job: Job, note: str = "") -> None:
        decided = {JobState.QUEUED, JobState.REJECTED, JobState.EXPIRED}
        if job.approval_reason is not None and job.state in decided:
            waited = (utcnow() - job.created_at).total_seconds()
            self.approval_wait.labels(job.state.value).observe(max(0.0, waited))

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        pass

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        outcome = "ok" if ok else "failed"
        self.steps.labels(job.backend, step, outcome).observe(max(0.0, duration_s))

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        self.finished.labels(job.backend, job.state.value).inc()
        if rollback is not None:
            complete = "true" if not job.wreckage else "false"
            self.rollbacks.labels(job.backend, complete).inc()

    async def job_note(self, job: Job, text: str) -> None:
        pass


class _Queue(Collector):
    """This process's queue, read at scrape time."""

    def __init__(self, queue: JobQueue, backends: Mapping[str, Backend]) -> None:
        self.queue, self.backends = queue, backends

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queue = self.queue
        running = GaugeMetricFamily(
            "deploybot_running", "Jobs this process runs now, by backend.", labels=["backend"]
        )
        waiting = GaugeMetricFamily(
            "deploybot_queued",
            "Jobs waiting in this process's queue for a slot, by backend.",
            labels=["backend"],
        )
        for backend in self.backends:
            running.add_metric([backend], queue.running_on(backend))
            waiting.add_metric([backend], queue.waiting_on(backend))
        yield running
        yield waiting
