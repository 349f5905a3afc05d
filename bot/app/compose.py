"""The composition root: every core service built once, in dependency order, each given
the collaborators it uses, nothing patched afterwards. `compose` returns the `Deployer`
(bot/app/service.py), the thin object the front ends hold; bot/app/runtime.py opens what it
needs (the store, the backends) and runs it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from functools import partial

from backends.base import Backend
from backends.ipam import open_ipam
from backends.ipam.base import Ipam
from bot.addresses.allocation import Addressing
from bot.app.queries import Queries
from bot.app.service import Deployer
from bot.approvals.audit import Audit
from bot.approvals.decisions import Approvals, Groups
from bot.chat.inbox import Inbox
from bot.chat.outbox import ChatOutbox
from bot.config.settings import Settings
from bot.jobs import logfields
from bot.jobs import refs as jobrefs
from bot.jobs.cancel import Cancels
from bot.jobs.progress import Fanout, Progress
from bot.jobs.queue import JobQueue
from bot.kinds import Kinds
from bot.kinds.build.kind import BuildKind
from bot.kinds.build.parts import BuildNotes, LoggedBuildNotes
from bot.kinds.build.service import Builds, DeploySmoke
from bot.kinds.deploy.destroy import Destroyer
from bot.kinds.deploy.kind import DeployKind
from bot.kinds.deploy.pipeline import Pipeline
from bot.kinds.deploy.preflight import Preflight
from bot.leases.enforce import Leases
from bot.migration.service import Migrations
from bot.models import Job, utcnow
from bot.models.errors import BackendError, ConfigError
from bot.operations.metrics import Metrics
from bot.ownership.claims import Clock, Ended, Ownership, Runner
from bot.ownership.storewatch import StoreWatch
from bot.people.personal import Personal
from bot.requests.intake import Intake
from bot.requests.quotas import Quotas
from bot.sshca.authority import HostCA, load_host_ca
from store.db import Store


def configured_ipam(settings: Settings) -> Ipam:
    try:
        return open_ipam(settings.ipam, os.environ)
    except BackendError as exc:  # NetBox's token is not in the environment
        raise ConfigError(f"[ipam]: {exc.message}") from None


def compose(
    settings: Settings,
    store: Store,
    backends: Mapping[str, Backend],
    progress: Progress | None = None,
    *,
    runner_kind: str = "shell",
    takes_over: bool = True,
    clock: Clock = utcnow,
    ipam: Ipam | None = None,
    build_notes: BuildNotes | None = None,
    host_ca: HostCA | None = None,
    preflight: Preflight | None = None,
) -> Deployer:
    """The core on `store` and `backends`, telling `progress` what happens.

    `takes_over=False` is a short-lived process (the one-shot `deploy`): it runs only the
    jobs it records, and never recovers or claims other runners' work. `ipam` defaults
    to the configured one (`[ipam]`); `build_notes` is where template builds' progress
    goes (a log by default); `host_ca` to the configured one (`[ssh]`: a `ConfigError`
    when its key is not in the environment)."""
    backends = dict(backends)
    host_ca = host_ca if host_ca is not None else load_host_ca(settings, os.environ)
    runner = Runner.here(runner_kind)
    logfields.set_runner(runner.id)
    # Whether the store answers (bot/ownership/storewatch.py): read by /readyz, /metrics, chat.
    storewatch = StoreWatch(store, settings.ownership.tick_s)
    addressing = Addressing(
        settings, store, backends, ipam if ipam is not None else configured_ipam(settings), clock
    )
    # The job kinds (bot/kinds/): what runs, recovers and decides each job. Registered
    # below, once what they use exists; the queue and the runner ask them per job.
    kinds = Kinds()

    async def run_queued(job_id: str) -> object:
        return await kinds.named(await store.jobs.kind_of(job_id)).run(job_id)

    async def recover(job: Job, ended: Ended | None) -> bool:
        return await kinds[job.kind].recover(job, ended)

    def local_work() -> Iterable[str]:
        # What runs here besides the queue, read at each renewal (bot/ownership/claims.py):
        # the destroys and the builds' recoveries, built below.
        return [*destroyer.tasks, *builds.recovering]

    queue = JobQueue(
        run_queued,
        max_running=settings.limits.max_running,
        max_per_backend=settings.limits.max_running_per_backend,
    )
    metrics = Metrics(store, storewatch, backends, queue)  # it listens like a front end
    fanout = Fanout(*([progress] if progress else []), metrics)
    ownership = Ownership(
        store,
        queue,
        settings.ownership,
        runner,
        takes_over=takes_over,
        recover=recover,
        sweep=kinds.sweep,
        local_work=local_work,
        clock=clock,
    )
    pipeline = Pipeline(
        settings, backends, store, fanout, ownership, addressing, host_ca, preflight
    )
    load = partial(jobrefs.load, store)
    groups = Groups()
    approvals = Approvals(settings, store, fanout, ownership.take, load, groups)
    destroyer = Destroyer(
        settings, store, backends, fanout, ownership, addressing, approvals, clock
    )
    leases = Leases(
        settings, store, backends, fanout, ownership, approvals, destroyer, clock, host_ca
    )
    quotas = Quotas(settings.quotas, store, lambda: groups.members)
    intake = Intake(
        settings, store, backends, addressing, queue, fanout, runner.id,
        ownership.claim_until, quotas, leases.grant,
    )  # fmt: skip
    # Template builds share the queue, the store's ownership and the deploy parts their
    # smoke test uses (bot/kinds/build/).
    smoke = DeploySmoke(
        settings, store, intake, pipeline, destroyer, runner.id, ownership.claim_until
    )
    builds = Builds(
        settings, store, backends, queue, runner.id, ownership.claim_until, smoke,
        build_notes or LoggedBuildNotes(), approvals=approvals,
    )  # fmt: skip
    cancels = Cancels(store, queue, fanout, addressing, approvals, destroyer)
    kinds.register(
        DeployKind(
            pipeline, backends, approvals, destroyer, addressing,
            partial(jobrefs.resolve, store), load, cancels.cancel,
        )
    )  # fmt: skip
    kinds.register(BuildKind(builds))
    queries = Queries(store, backends, quotas)
    return Deployer(
        settings=settings,
        store=store,
        backends=backends,
        progress=fanout,
        clock=clock,
        runner=runner,
        storewatch=storewatch,
        metrics=metrics,
        kinds=kinds,
        queue=queue,
        ownership=ownership,
        addressing=addressing,
        pipeline=pipeline,
        groups=groups,
        approvals=approvals,
        destroyer=destroyer,
        leases=leases,
        intake=intake,
        builds=builds,
        migrations=Migrations(settings, store, backends, builds, approvals, os.environ, clock),
        audit_log=Audit(store),
        queries=queries,
        personal=Personal(store, queries.templates),
        inbox=Inbox(store, ownership, storewatch, settings.ownership.tick_s),
        chat_outbox=ChatOutbox(store),
        host_ca=host_ca,
    )
