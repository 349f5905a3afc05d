"""One template build, step by step, with an undo stack (issue 17).

    preflight -> image -> create -> smoke -> publish

Like a deploy (bot/kinds/deploy/pipeline.py): each step has a timeout, a step that creates something
records its durable id and pushes its undo *before* the call, and a failure or a cancel
runs the undo stack in reverse, shielded, so nothing a failed build made is left. The
build's row says who runs it (`owner`, with a claim renewed by bot/ownership/claims.py), so a
build whose process died is rolled back by the next process that starts.

The smoke step is a real deploy through the normal pipeline (a job of its own, recorded
by the intake without approval, quota or lease: the build's approval covers it), run in
the build's own queue slot, then destroyed the way `/deploy destroy` destroys. Only a
template whose smoke deploy answered on SSH is published.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backends.base import VMRef
from backends.building import BuildPlan, BuildsTemplates, BuildTarget
from bot.config.settings import Settings
from bot.images.customize import CustomizeError
from bot.images.fetch import FetchError
from bot.images.prepare import PreparedImage, prepare_image
from bot.images.profiles import Platform, Profile, ProfileError
from bot.jobs.waiting import protected, retrying
from bot.kinds.build.parts import (
    BuildNotes,
    SmokeDeploys,
    build_notice,
)
from bot.kinds.deploy.runs import StepFailed, describe
from bot.models import JobState, utcnow
from bot.models.builds import Build, BuildState
from bot.models.errors import BackendError, UserError
from bot.models.notices import BUILD_FINISHED, BUILD_NOTE, BUILD_STARTED
from store.db import Store

log = logging.getLogger(__name__)
Prepare = Callable[..., Awaitable[PreparedImage]]


@dataclass
class _Undo:
    what: str
    action: Callable[[], Awaitable[None]]
    timeout_s: float


@dataclass
class _Run:
    build: Build
    backend: BuildsTemplates
    profile: Profile
    plan: BuildPlan
    target: BuildTarget | None = None
    ref: VMRef | None = None
    image: PreparedImage | None = None
    undo: list[_Undo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_for(build: Build, profile: Profile) -> BuildPlan:
    """What the backend is told about a build (the digest joins once the image is verified)."""
    return BuildPlan(
        job_id=build.id,
        profile=profile.name,
        os_family=profile.os_family,
        version=build.version,
        name=build.name,
        cpu=profile.cpu,
        ostype=profile.ostype,
        nic=profile.nic,
        disk_bus=profile.disk_bus,
        user=profile.user,
        built_at=build.created_at,
        source_digest=build.source_digest or "",
        placement=build.placement,
        storage=build.storage,
        installation=build.installation,
    )


class BuildRunner:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: dict[str, Any],
        owner: str,
        notes: BuildNotes,
        smoke: SmokeDeploys,
        prepare: Prepare = prepare_image,
    ) -> None:
        """`prepare` makes the image (bot/images.prepare_image); the demo's simulator
        takes none, so it is never called for it."""
        self.settings = settings
        self.store = store
        self.backends = backends
        self.owner = owner
        self.notes = notes
        self.smoke = smoke
        self.prepare = prepare

    async def run(self, build_id: str) -> Build | None:
        """Run a queued build to published, failed or cancelled."""
        build = await self.store.builds.move(
            build_id,
            [BuildState.QUEUED],
            BuildState.RUNNING,
            self.owner,
            [build_notice(build_id, BUILD_STARTED)],
            started_at=utcnow(),
        )
        if build is None:
            return await self.store.builds.get(build_id)
        backend = self.backends.get(build.backend)
        try:
            profile = self.settings.images.profile(build.profile)
        except ProfileError as exc:  # the configuration changed since it was asked for
            return await protected(self._unstartable(build, f"{exc}"))
        if backend is None:
            why = f"the backend {build.backend} is no longer configured"
            return await protected(self._unstartable(build, why))
        run = _Run(build, backend, profile, plan_for(build, profile))
        try:
            await self._steps(run)
        except asyncio.CancelledError:
            return await protected(self._roll_back(run, BuildState.CANCELLED, None))
        except StepFailed as failure:
            return await protected(self._roll_back(run, BuildState.FAILED, failure))
        return await protected(self._publish(run))

    # --- steps ----------------------------------------------------------------------

    async def _steps(self, run: _Run) -> None:
        t = self.settings.timeouts
        images = self.settings.images
        await self._step(run, "preflight", self._preflight, t.check_free_s)
        await self._step(run, "image", self._image, images.download_timeout_s)
        await self._step(run, "create", self._create, images.create_timeout_s)
        await self._step(run, "smoke", self._smoke, images.smoke_timeout_s)

    async def _step(
        self, run: _Run, step: str, body: Callable[[_Run], Awaitable[None]], timeout_s: float
    ) -> None:
        await self._update(run, step=step)
        try:
            async with asyncio.timeout(timeout_s):
                await body(run)
        except TimeoutError:
            raise StepFailed(step, f"did not finish within {timeout_s:g} s") from None
        except BackendError as exc:
            raise StepFailed(step, exc.message) from None
        except (FetchError, CustomizeError) as exc:
            raise StepFailed(step, str(exc)) from None
        except UserError as exc:  # the smoke deploy's request refused (bot/requests/intake.py)
            raise StepFailed(step, exc.message) from None
        except (StepFailed, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("build %s: unexpected error in step %s", run.build.id, step)
            raise StepFailed(step, "internal error (the details are in the bot's log)") from None

    async def _retrying(self, action: Callable[[], Awaitable[Any]]) -> Any:
        return await retrying(action, self.settings.timeouts)

    async def _preflight(self, run: _Run) -> None:
        # Before anything is downloaded or made: a smoke deploy that would be refused
        # fails the build now, not after the image, the upload and the template.
        await self.smoke.check(run.build, run.plan.versioned_name)
        run.target = await self._retrying(lambda: run.backend.build_preflight(run.plan))
        assert run.target is not None
        await self._update(run, vm_placement=run.target.placement)
        for line in run.target.notes:
            await self._say(run, line)
        await self._say(
            run,
            f"pre-flight passed: {run.plan.versioned_name} on {run.target.placement}, "
            f"storage {run.target.storage}, CPU baseline {run.plan.cpu}",
        )

    async def _image(self, run: _Run) -> None:
        platform = run.backend.image_platform
        if platform is None:
            await self._say(run, f"{run.build.backend} takes no image: nothing to download")
            return

        async def progress(line: str) -> None:
            await self._say(run, line)

        images = self.settings.images
        run.image = await self.prepare(
            run.profile,
            images.cache_dir,
            _platform(platform),
            accelerator=images.accelerator,
            timeouts=images.fetch_timeouts,
            customize_timeout_s=images.customize_timeout_s,
            progress=progress,
        )
        assert run.image is not None
        path = run.image.path
        run.undo.append(_Undo("remove the prepared image", lambda: _unlink(path), 30))
        await self._update(run, source_digest=run.image.source_digest)
        # The plan was made before the digest was known: the template's mark carries it.
        run.plan = replace(run.plan, source_digest=run.image.source_digest)
        if not run.image.changed and run.profile.format == "qcow2":
            # Nothing to change: the hypervisor may fetch the upstream file itself.
            run.plan = replace(run.plan, source_url=run.profile.url)

    async def _create(self, run: _Run) -> None:
        assert run.target is not None
        target = run.target
        ref = await self._retrying(lambda: run.backend.prepare_build(run.plan, target))
        run.ref = ref
        # Recorded before the template exists: a crash from here on still knows what to remove.
        await self._update(run, vm_id=ref.vm_id, vm_placement=ref.placement)
        timeout_s = self.settings.timeouts.destroy_s
        run.undo.append(
            _Undo(
                f"remove template {ref.vm_id}",
                lambda: self._retrying(lambda: run.backend.destroy_template(ref)),
                timeout_s,
            )
        )
        image = run.image.path if run.image else None
        note = await run.backend.create_template(run.plan, target, ref, image)
        if note:
            await self._say(run, note)
        await self._say(run, f"template {run.plan.versioned_name} created (VM {ref.vm_id})")

    async def _smoke(self, run: _Run) -> None:
        job = await self.smoke.record(run.build, run.plan.versioned_name)
        await self._update(run, smoke_job=job.id)
        run.undo.append(
            _Undo(f"remove smoke VM {job.name}", lambda: self._unsmoke(run, job.id), 600)
        )
        await self._say(run, f"smoke test: deploying {job.name} from {run.plan.versioned_name}")
        done = await self.smoke.run(job.id)
        if done is None or done.state is not JobState.SUCCEEDED:
            why = done.error if done is not None and done.error else "it did not succeed"
            raise StepFailed("smoke", f"the smoke deploy {job.name} failed: {why}")
        await self._say(run, f"smoke test passed: {done.ssh_line} answered")
        gone = await self.smoke.destroy(done, run.build)
        if gone is None or gone.state is not JobState.DESTROYED:
            raise StepFailed("smoke", f"the smoke VM {job.name} could not be destroyed")
        run.undo.pop()

    async def _unsmoke(self, run: _Run, job_id: str) -> None:
        """The smoke VM, if its deploy succeeded (a failed one rolled itself back)."""
        job = await self.store.jobs.get(job_id)
        if job is not None and job.state is JobState.SUCCEEDED:
            await self.smoke.destroy(job, run.build)

    # --- endings --------------------------------------------------------------------

    async def _unstartable(self, build: Build, why: str) -> Build | None:
        """Nothing was made: fail it at once (running -> rolling back -> failed)."""
        if await self.store.builds.move(
            build.id, [BuildState.RUNNING], BuildState.ROLLING_BACK, self.owner
        ):
            failed = await self.store.builds.move(
                build.id,
                [BuildState.ROLLING_BACK],
                BuildState.FAILED,
                self.owner,
                [build_notice(build.id, BUILD_FINISHED)],
                finished_at=utcnow(),
                failed_step="preflight",
                error=why,
            )
            if failed is not None:
                await self.notes.build_finished(failed)
                return failed
        return await self.store.builds.get(build.id)

    async def _publish(self, run: _Run) -> Build | None:
        assert run.ref is not None
        ref = run.ref
        try:
            async with asyncio.timeout(self.settings.timeouts.identity_s):
                await self._retrying(lambda: run.backend.publish_template(run.plan, ref))
        except (BackendError, TimeoutError) as exc:
            reason = exc.message if isinstance(exc, BackendError) else "timed out"
            return await self._roll_back(run, BuildState.FAILED, StepFailed("publish", reason))
        await self._cleanup_image(run)
        await self._say(run, f"published: {run.plan.name} is now version {run.plan.version}")
        build = await self.store.builds.move(
            run.build.id,
            [BuildState.RUNNING],
            BuildState.PUBLISHED,
            self.owner,
            [build_notice(run.build.id, BUILD_FINISHED)],
            finished_at=utcnow(),
            step=None,
            notes=tuple(run.notes),
        )
        if build is not None:
            await self.notes.build_finished(build)
        return build

    async def _cleanup_image(self, run: _Run) -> None:
        for undo in [u for u in run.undo if u.what == "remove the prepared image"]:
            await undo.action()

    async def _roll_back(
        self, run: _Run, final: BuildState, failure: StepFailed | None
    ) -> Build | None:
        moved = await self.store.builds.move(
            run.build.id, [BuildState.RUNNING], BuildState.ROLLING_BACK, self.owner
        )
        if moved is None:
            log.warning("build %s: no longer ours; its rollback goes on elsewhere", run.build.id)
            return await self.store.builds.get(run.build.id)
        if failure is not None:
            await self._say(run, f"{failure.step} failed: {failure.reason}")
        left = []
        for undo in reversed(run.undo):
            try:
                async with asyncio.timeout(undo.timeout_s):
                    await undo.action()
                await self._say(run, f"rollback: {undo.what}")
            except Exception as exc:  # reported, never raised over the original error
                reason = exc.message if isinstance(exc, BackendError) else describe(exc)
                log.warning("build %s: undo %r failed: %s", run.build.id, undo.what, reason)
                left.append(f"{undo.what}: {reason}")
        build = await self.store.builds.move(
            run.build.id,
            [BuildState.ROLLING_BACK],
            final,
            self.owner,
            [build_notice(run.build.id, BUILD_FINISHED)],
            finished_at=utcnow(),
            failed_step=failure.step if failure else run.build.step,
            error=failure.reason if failure else "cancelled",
            wreckage="; ".join(left) or None,
            notes=tuple(run.notes),
        )
        if build is not None:
            await self.notes.build_finished(build)
        return build

    # --- records --------------------------------------------------------------------

    async def _update(self, run: _Run, **fields: Any) -> None:
        if not await self.store.builds.update(run.build.id, self.owner, **fields):
            raise StepFailed(run.build.step or "build", "another process took this build over")
        run.build = run.build.model_copy(update=fields)

    async def _say(self, run: _Run, line: str) -> None:
        """A line of progress: kept on the build's row with its notice for chat, in one
        transaction (a runner that lost the build keeps quiet in the store)."""
        run.notes.append(line)
        log.info("build %s: %s", run.build.id, line)
        await self.store.builds.update(
            run.build.id,
            self.owner,
            [build_notice(run.build.id, BUILD_NOTE, line)],
            notes=tuple(run.notes),
        )
        await self.notes.build_note(run.build, line)


def _platform(name: str) -> Platform:
    if name not in ("proxmox", "vsphere"):
        raise StepFailed("image", f"no image preparation for platform {name!r}")
    return "proxmox" if name == "proxmox" else "vsphere"


async def _unlink(path: Path) -> None:
    await asyncio.to_thread(path.unlink, True)
