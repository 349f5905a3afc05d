"""The Deployer's template builds: asked for, queued, run, and recovered after a crash.

A build goes through the same job queue as deploys (its id starts with `b`, so the
queue's runner hands it to `BuildRunner`), is owned by a runner with a lease like a job,
and a build whose runner died is rolled back by the next process that takes over work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from backends.base import Backend, BackendError, VMRef
from backends.building import BuildsTemplates
from bot.builds.runner import BuildNotes, BuildRunner, Prepare
from bot.errors import Conflict, NotAllowed, RequestInvalid
from bot.images import ProfileError, prepare_image
from bot.models import Job, JobState, utcnow
from bot.models.builds import Build, BuildState
from bot.parser import DeployArgs
from bot.settings import Settings
from bot.waiting import protected
from store.db import DuplicateActive, Store

if TYPE_CHECKING:
    from bot.destroy import Destroyer
    from bot.intake import Intake
    from bot.pipeline import Pipeline
    from bot.queue import JobQueue

log = logging.getLogger(__name__)


class _Smoke:
    """`SmokeDeploys` on the Deployer's own intake, pipeline and destroyer."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        intake: Intake,
        pipeline: Pipeline,
        destroyer: Destroyer,
        owner: str,
        lease_until: Callable[[], datetime],
    ) -> None:
        self.settings, self.store, self.intake = settings, store, intake
        self.pipeline, self.destroyer = pipeline, destroyer
        self.owner, self.lease_until = owner, lease_until

    async def record(self, build: Build, template: str) -> Job:
        args = DeployArgs(
            name=f"smoke-{build.id[1:9]}",
            template=template,
            on=build.backend,
            subnet=self.settings.images.smoke_subnet,
        )
        return await self.intake.request(
            args, build.requester, can_wait_for_approval=False, smoke=True
        )

    async def run(self, job_id: str) -> Job | None:
        return await self.pipeline.run(job_id)

    async def destroy(self, job: Job, build: Build) -> Job | None:
        moved = await self.store.transition(
            job.id,
            [JobState.SUCCEEDED],
            JobState.DESTROYING,
            destroy_by=f"template build {build.id}",
            destroy_asked_at=utcnow(),
            owner=self.owner,
            lease_until=self.lease_until(),
        )
        current = await self.store.get_job(job.id)
        if not moved or current is None:
            return current
        return await self.destroyer.run(current)


class Builds:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        queue: JobQueue,
        owner: str,
        lease_until: Callable[[], datetime],
        notes: BuildNotes,
        prepare: Prepare = prepare_image,
    ) -> None:
        self.settings, self.store, self.backends = settings, store, backends
        self.queue, self.owner, self.lease_until = queue, owner, lease_until
        self.notes = notes
        self.prepare = prepare
        self.runner: BuildRunner | None = None  # set by `wire`, once the deploy parts exist

    def listen(self, notes: BuildNotes) -> None:
        """Where builds' progress goes from now on (a front end, the CLI's terminal)."""
        self.notes = notes
        if self.runner is not None:
            self.runner.notes = notes

    def wire(self, intake: Intake, pipeline: Pipeline, destroyer: Destroyer) -> None:
        smoke = _Smoke(
            self.settings, self.store, intake, pipeline, destroyer, self.owner, self.lease_until
        )
        self.runner = BuildRunner(
            self.settings, self.store, dict(self.backends), self.owner, self.notes, smoke,
            self.prepare,
        )  # fmt: skip

    def builder(self, backend: str) -> BuildsTemplates:
        found = self.backends.get(backend)
        if found is None:
            known = ", ".join(sorted(self.backends))
            raise RequestInvalid([f"There is no backend {backend!r}; use one of {known}."])
        if not isinstance(found, BuildsTemplates):
            raise RequestInvalid(
                [
                    f"{backend} cannot build templates (only Proxmox, vSphere and the "
                    "simulator can); build on one of those."
                ]
            )
        return found

    async def request(
        self,
        profile: str,
        backend: str,
        requester: str,
        *,
        placement: str | None = None,
        storage: str | None = None,
        name: str | None = None,
        origin: str | None = None,
    ) -> Build:
        """Validate and record one build, and queue it here."""
        try:
            chosen = self.settings.images.profile(profile)
        except ProfileError as exc:
            raise RequestInvalid([f"{exc}."]) from None
        policy = self.settings.approval
        if policy.deployers and requester not in policy.deployers:
            raise NotAllowed(f"{requester} is not on the list of people who may deploy.")
        builder = self.builder(backend)
        name = name or chosen.name
        try:
            seen = await builder.template_versions(name)
        except BackendError as exc:
            raise RequestInvalid([f"{backend}: {exc.message}"]) from None
        build = Build(
            state=BuildState.QUEUED,
            requester=requester,
            profile=chosen.name,
            backend=backend,
            name=name,
            version=1,
            placement=placement,
            storage=storage,
            cpu=chosen.cpu,
            owner=self.owner,
            lease_until=self.lease_until(),
            installation=self.store.installation_id,
            origin=origin,
        )
        try:
            stored = await self.store.builds.insert(
                build, at_least=max((v.version for v in seen), default=0) + 1
            )
        except DuplicateActive:
            raise Conflict(
                f"A build of {name} on {backend} is already under way; wait for it to end "
                "(`deploybot template list`)."
            ) from None
        self.queue.submit(stored.id, stored.backend)
        return stored

    async def run(self, build_id: str) -> Build | None:
        assert self.runner is not None, "Builds.wire() first"
        return await self.runner.run(build_id)

    async def recover(self, now: datetime | None = None) -> list[Build]:
        """Roll back the builds whose runner died (their lease lapsed): what they made is
        removed, as their own rollback would have."""
        done = []
        for build in await self.store.builds.abandoned(now or utcnow()):
            taken = await self.store.builds.update(build.id, build.owner, owner=self.owner)
            if not taken:
                continue  # another process took it first
            done.append(await protected(self._undo_interrupted(build)))
        return done

    async def _undo_interrupted(self, build: Build) -> Build:
        left: list[str] = []
        if build.smoke_job:
            job = await self.store.get_job(build.smoke_job)
            if job is not None and job.state is JobState.SUCCEEDED and self.runner:
                await self.runner.smoke.destroy(job, build)
        backend = self.backends.get(build.backend)
        if build.vm_id is not None and isinstance(backend, BuildsTemplates):
            ref = _template_ref(build)
            try:
                await backend.destroy_template(ref)
            except BackendError as exc:
                left.append(f"template {build.vm_id}: {exc.message}")
        if build.state is BuildState.RUNNING:
            await self.store.builds.move(
                build.id, [BuildState.RUNNING], BuildState.ROLLING_BACK, self.owner
            )
        final = await self.store.builds.move(
            build.id,
            [BuildState.ROLLING_BACK],
            BuildState.FAILED,
            self.owner,
            finished_at=utcnow(),
            failed_step=build.step,
            error="interrupted: the process running it stopped; what it made was removed",
            wreckage="; ".join(left) or None,
        )
        return final or build


def _template_ref(build: Build) -> VMRef:
    assert build.vm_id is not None
    return VMRef(build.vm_id, build.id, build.vm_placement, build.installation)
