"""The Deployer's template builds: asked for, queued, run, and recovered after a crash.

A build goes through the same job queue as deploys (the queue's runner looks its kind
up and the build kind, bot/kinds/build/kind.py, hands it to `BuildRunner`), is owned by a
runner with a claim like a job, and a build whose runner died is rolled back by the next
process that takes over work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from backends.base import Backend, VMRef
from backends.building import BuildsTemplates
from bot.addresses import subnets
from bot.approvals.decisions import build_approval_reason
from bot.config.settings import Settings
from bot.images.prepare import prepare_image
from bot.images.profiles import ProfileError
from bot.jobs.waiting import protected
from bot.kinds.build.cancel import cancel_build
from bot.kinds.build.parts import BuildNotes, SmokeDeploys, build_notice
from bot.kinds.build.runner import BuildRunner, Prepare
from bot.models import Job, JobState, utcnow
from bot.models.builds import BUILD_ID_RE, Build, BuildState, template_name_problem
from bot.models.errors import (
    AmbiguousJob,
    BackendError,
    Conflict,
    Duplicate,
    JobNotFound,
    NotAllowed,
    RequestInvalid,
    TransitionRefused,
)
from bot.models.ids import MIN_JOB_REF
from bot.models.notices import BUILD_ASKED, BUILD_DECIDED, BUILD_FINISHED
from bot.requests.parsed import DeployArgs
from store.db import AlreadyDelivered, DuplicateActive, Store

if TYPE_CHECKING:
    from bot.approvals.decisions import Approvals
    from bot.jobs.queue import JobQueue
    from bot.kinds.deploy.destroy import Destroyer
    from bot.kinds.deploy.pipeline import Pipeline
    from bot.requests.intake import Intake


class DeploySmoke:
    """`SmokeDeploys` on the core's own intake, pipeline and destroyer (the composition
    root, bot/app/compose.py, builds one and hands it to `Builds`)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        intake: Intake,
        pipeline: Pipeline,
        destroyer: Destroyer,
        owner: str,
        claim_until: Callable[[], datetime],
    ) -> None:
        self.settings, self.store, self.intake = settings, store, intake
        self.pipeline, self.destroyer = pipeline, destroyer
        self.owner, self.claim_until = owner, claim_until

    def _args(self, build: Build, template: str) -> DeployArgs:
        return DeployArgs(
            name=f"smoke-{build.id[1:9]}",
            template=template,
            on=build.backend,
            subnet=self.settings.images.smoke_subnet,
        )

    async def check(self, build: Build, template: str) -> None:
        """What the intake would refuse of the smoke deploy without asking the backend
        (its template does not exist yet): its subnet, sizes, login; in the words of a
        build, whose requester cannot add subnet= to it."""
        args = self._args(build, template)
        chosen = subnets.choose(self.settings.subnets, args.subnet, build.backend, None)
        if isinstance(chosen, str):
            raise RequestInvalid([smoke_subnet_unknown(self.settings, build.backend)])
        await self.intake.offline_request(args, build.requester)

    async def record(self, build: Build, template: str) -> Job:
        return await self.intake.request(
            self._args(build, template), build.requester, can_wait_for_approval=False, smoke=True
        )

    async def run(self, job_id: str) -> Job | None:
        return await self.pipeline.run(job_id)

    async def destroy(self, job: Job, build: Build) -> Job | None:
        moved = await self.store.jobs.transition(
            job.id,
            [JobState.SUCCEEDED],
            JobState.DESTROYING,
            destroy_by=f"template build {build.id}",
            destroy_asked_at=utcnow(),
            owner=self.owner,
            lease_until=self.claim_until(),
        )
        current = await self.store.jobs.get(job.id)
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
        claim_until: Callable[[], datetime],
        smoke: SmokeDeploys,
        notes: BuildNotes,
        prepare: Prepare = prepare_image,
        approvals: Approvals | None = None,
    ) -> None:
        """`approvals` says who approves (bot/approvals/decisions.py); without it nobody does.
        `smoke` deploys and destroys each build's smoke test."""
        self.settings, self.store, self.backends = settings, store, backends
        self.queue, self.owner, self.claim_until = queue, owner, claim_until
        self.recovering: set[str] = set()  # builds being rolled back by `recover`
        self.approvals = approvals
        self.runner = BuildRunner(settings, store, dict(backends), owner, notes, smoke, prepare)

    def listen(self, notes: BuildNotes) -> None:
        """Where builds' progress goes from now on (a front end, the CLI's terminal)."""
        self.runner.notes = notes

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
        can_wait_for_approval: bool = True,
        hand_off: bool = False,
    ) -> Build:
        """Validate and record one build, and queue it here; or, when the approval policy
        (`[approval] builds`) wants an approver, record it awaiting approval. A caller
        that cannot wait for one (the one-shot CLI) is refused instead, with nothing
        recorded. With `hand_off` (a CLI that does not stay), a queued build is left to
        any runner (a serving process claims it) instead of run here."""
        try:
            chosen = self.settings.images.profile(profile)
        except ProfileError as exc:
            raise RequestInvalid([f"{exc}."]) from None
        policy = self.settings.approval
        if policy.deployers and requester not in policy.deployers:
            raise NotAllowed(
                f"{requester} is not on the list of people who may deploy.", people=(requester,)
            )
        builder = self.builder(backend)
        name = name or chosen.name
        if problem := template_name_problem(name):
            raise RequestInvalid([f"{problem}."])
        reason = build_approval_reason(policy, await self._approves(requester))
        if reason and not can_wait_for_approval:
            raise NotAllowed(
                f"This build needs approval ({reason}). Ask in Slack (`/deploy template "
                "build`) or in `deploybot shell`, where an approver can approve it; an "
                "approver's own build needs none."
            )
        try:
            seen = await builder.template_versions(name)
        except BackendError as exc:
            raise RequestInvalid([f"{backend}: {exc.message}"]) from None
        build = Build(
            state=BuildState.AWAITING_APPROVAL if reason else BuildState.QUEUED,
            requester=requester,
            profile=chosen.name,
            backend=backend,
            name=name,
            version=1,
            placement=placement,
            storage=storage,
            cpu=chosen.cpu,
            # Queued: reserved for this runner, which starts it here. Awaiting approval:
            # nobody's, until the approver's process takes it (`decide`). Handed off:
            # nobody's, until a runner claims it (bot/ownership/claims.py).
            owner=None if reason or hand_off else self.owner,
            lease_until=None if reason or hand_off else self.claim_until(),
            installation=self.store.installation_id,
            origin=origin,
            approval_reason=reason,
        )
        try:
            stored = await self.store.builds.insert(
                build,
                at_least=max((v.version for v in seen), default=0) + 1,
                notices=[build_notice(build.id, BUILD_ASKED)],
            )
        except DuplicateActive:
            raise Conflict(
                f"A build of {name} on {backend} is already under way; wait for it to end "
                "(`deploybot template list`)."
            ) from None
        if stored.state is BuildState.QUEUED and not hand_off:
            self.queue.submit(stored.id, stored.backend)
        return stored

    # --- approval -----------------------------------------------------------------------

    async def _approves(self, user: str) -> bool:
        return self.approvals is not None and await self.approvals.is_approver(user)

    async def get(self, build_id: str) -> Build:
        """The build a person named by its id or a prefix of it (at least 4 characters)."""
        found = await self.store.builds.get(build_id) if BUILD_ID_RE.fullmatch(build_id) else None
        if found is None and len(build_id) >= MIN_JOB_REF:
            matches = await self.store.builds.match(build_id, limit=2)
            if len(matches) > 1:
                raise AmbiguousJob(
                    f"{build_id} names more than one build; give more of its id.", matches
                )
            found = await self.store.builds.get(matches[0]) if matches else None
        if found is None:
            raise JobNotFound(
                f"There is no template build {build_id[:40]}; `deploybot template list` "
                "lists recent ones."
            )
        return found

    def expires_at(self, build: Build) -> datetime:
        return build.created_at + timedelta(seconds=self.settings.approval.expire_after_s)

    async def check_decider(self, build_id: str, approver: str) -> Build:
        """Refuse non-approvers, the requester, and builds no longer awaiting approval
        (one past its time expires now, even if the sweep has not run yet)."""
        build = await self.get(build_id)
        if not await self._approves(approver):
            who = self.approvals.approvers_text() if self.approvals else "nobody"
            raise NotAllowed(
                f"{approver} may not approve template builds; the approvers are {who}.",
                people=(approver, *self.settings.approval.approvers),
            )
        if approver == build.requester:
            raise NotAllowed("You cannot approve or reject your own build: ask another approver.")
        if build.state is BuildState.AWAITING_APPROVAL and self.expires_at(build) <= utcnow():
            await self._expire(build)
            build = await self.get(build.id)
        if build.state is not BuildState.AWAITING_APPROVAL:
            raise _undecidable(build)
        return build

    async def decide(
        self,
        build_id: str,
        approver: str,
        approved: bool,
        note: str | None = None,
        dedupe_key: str | None = None,
    ) -> Build:
        """Approve (queued, taken by this process's runner) or reject a build awaiting
        approval: one compare-and-set on its row, with its notice (and the click's
        `dedupe_key`), so of two approvers clicking at once exactly one decides, and a
        click delivered twice is recognised (`Duplicate`)."""
        if dedupe_key is not None and await self.store.jobs.delivered(dedupe_key):
            raise Duplicate(f"This decision on build {build_id} was already made.", build_id)
        build_id = (await self.check_decider(build_id, approver)).id
        now = utcnow()
        decided = {"decided_by": approver, "decided_at": now}
        told = [build_notice(build_id, BUILD_DECIDED, note or "")]
        if approved:
            fields: dict[str, object] = {"owner": self.owner, "lease_until": self.claim_until()}
        else:
            fields = {"finished_at": now, "error": note or "rejected"}
        try:
            moved = await self.store.builds.move(
                build_id,
                [BuildState.AWAITING_APPROVAL],
                BuildState.QUEUED if approved else BuildState.REJECTED,
                None,
                told,
                dedupe_key,
                **fields,
                **decided,
            )
        except AlreadyDelivered:
            raise Duplicate(
                f"This decision on build {build_id} was already made.", build_id
            ) from None
        if moved is None:  # another approver (or the expiry) was first
            raise _undecidable(await self.get(build_id))
        if moved.state is BuildState.QUEUED:
            self.queue.submit(moved.id, moved.backend)
        return moved

    async def _expire(self, build: Build, now: datetime | None = None) -> Build | None:
        return await self.store.builds.move(
            build.id,
            [BuildState.AWAITING_APPROVAL],
            BuildState.EXPIRED,
            None,
            [build_notice(build.id, BUILD_DECIDED)],
            finished_at=now or utcnow(),
            error="nobody approved it in time",
        )

    async def expire(self, now: datetime | None = None) -> list[Build]:
        """Expire the builds that waited for an approver longer than `expire_after_s`."""
        now = now or utcnow()
        cutoff = now - timedelta(seconds=self.settings.approval.expire_after_s)
        expired = []
        for build in await self.store.builds.awaiting(cutoff):
            moved = await self._expire(build, now)
            if moved is not None:
                expired.append(moved)
        return expired

    async def cancel(self, build_id: str, user: str) -> Build:
        """See bot/kinds/build/cancel.py."""
        build = await self.get(build_id)
        return await cancel_build(self.store, self.queue, build, user, await self._approves(user))

    async def run(self, build_id: str) -> Build | None:
        return await self.runner.run(build_id)

    async def recover(self, now: datetime | None = None) -> list[Build]:
        """Roll back the builds whose runner died (their claim lapsed): what they made is
        removed, as their own rollback would have."""
        done = []
        for build in await self.store.builds.abandoned(now or utcnow()):
            if build.id in self.recovering:
                continue  # being rolled back here already (a sweep and a hand-back)
            taken = await self.store.builds.update(
                build.id, build.owner, owner=self.owner, lease_until=self.claim_until()
            )
            if not taken:
                continue  # another process took it first
            self.recovering.add(build.id)  # renewed while it is undone (bot/ownership/claims.py)
            try:
                done.append(await protected(self._undo_interrupted(build)))
            finally:
                self.recovering.discard(build.id)
        return done

    async def _undo_interrupted(self, build: Build) -> Build:
        left: list[str] = []
        if build.smoke_job:
            job = await self.store.jobs.get(build.smoke_job)
            if job is not None and job.state is JobState.SUCCEEDED:
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
            [build_notice(build.id, BUILD_FINISHED)],
            finished_at=utcnow(),
            failed_step=build.step,
            error="interrupted: the process running it stopped; what it made was removed",
            wreckage="; ".join(left) or None,
        )
        return final or build


def smoke_subnet_unknown(settings: Settings, backend: str) -> str:
    """Why the smoke deploy has no subnet to take its address from, and the fix (an
    unknown `smoke_subnet` already stopped the start: bot/config/settings.py)."""
    names = ", ".join(str(s) for s in settings.subnets)
    return (
        f"the smoke deploy needs an address, and {backend} has no subnet of its own among "
        f"{names}: set smoke_subnet under [images] in the configuration to one of them (or "
        f"name {backend} in one subnet's `backends`)"
    )


def _undecidable(build: Build) -> TransitionRefused:
    """Why a build cannot be decided on: already decided (by whom, when), or expired."""
    if build.state is BuildState.EXPIRED:
        return TransitionRefused(
            f"Build {build.id} expired: nobody approved it in time. "
            f"{build.requester} can ask again.",
            people=(build.requester,),
        )
    if build.decided_by:
        when = f" at {build.decided_at:%H:%M} UTC" if build.decided_at else ""
        verb = "rejected" if build.state is BuildState.REJECTED else "approved"
        return TransitionRefused(
            f"Build {build.id} is not awaiting approval any more: {build.decided_by} "
            f"{verb} it{when}.",
            people=(build.decided_by,),
        )
    return TransitionRefused(
        f"Build {build.id} is {build.state.value}, not awaiting approval: nothing to decide."
    )


def _template_ref(build: Build) -> VMRef:
    assert build.vm_id is not None
    return VMRef(build.vm_id, build.id, build.vm_placement, build.installation)
