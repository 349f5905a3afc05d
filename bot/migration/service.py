"""The migration as a service of the core (`Deployer.migrations`): plans made and kept
(a plan made from chat has no file: it is kept in the store and applied by its id),
plans loaded by file or id, and applied (bot/migration/apply.py) with the build kind of
this process. The source is opened only through its read-only session type
(bot/migration/sources.py), each time anew and closed again.

Who may: from chat, approvers only (`check_approver`, asked by the `Deployer`'s chat
methods); the command line runs as the operator of the installation, like `gc`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path

from backends.base import Backend
from backends.building import BuildsTemplates
from backends.migrating import ReadOnlySource, Scope
from bot.approvals.decisions import Approvals
from bot.config.settings import Settings
from bot.kinds.build.service import Builds
from bot.migration import sources
from bot.migration.apply import (
    Applied,
    Outcome,
    check_age,
    check_findings,
    check_source,
    rebuilds_document,
    rebuilds_from_document,
    rebuilds_of,
    refresh,
    start,
    stored_target,
    target_profiles,
    wait_for_builds,
)
from bot.migration.plan import Plan, PlanFileError, make_plan, plan_from_document, read_plan
from bot.models import utcnow
from bot.models.builds import Build
from bot.models.errors import BackendError, JobNotFound, NotAllowed, RequestInvalid, UserError
from bot.models.plans import PLAN_ID_RE, KeptPlan, MigrationApply, apply_id_of, new_apply_id
from bot.ownership.claims import Clock
from store.db import Store


class Migrations:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        backends: Mapping[str, Backend],
        builds: Builds,
        approvals: Approvals,
        environ: Mapping[str, str],
        clock: Clock = utcnow,
    ) -> None:
        self.settings, self.store, self.backends = settings, store, backends
        self.builds, self.approvals = builds, approvals
        self.environ, self.clock = environ, clock

    async def check_approver(self, user: str) -> None:
        if not await self.approvals.is_approver(user):
            raise NotAllowed(
                f"Only approvers plan and apply migrations; the approvers are "
                f"{self.approvals.approvers_text()}."
            )

    # --- the plan -------------------------------------------------------------------

    def open_source(self, name: str) -> ReadOnlySource:
        """The read-only source of a plan being applied: a vSphere backend of the
        configuration, or the OVA's URL a plan made with --from-ova (command line) read."""
        if name.startswith(("http://", "https://")):
            return sources.ova_source(name, self.settings.images.connect_timeout_s)
        return self.open_backend(name)

    def open_backend(self, name: str) -> ReadOnlySource:
        """The read-only session of the configured backend `name`: what a plan made from
        chat may read (never a URL a chat user typed: the bot would fetch it)."""
        config = next((c for c in self.settings.backends if c.name == name), None)
        if config is None:
            known = ", ".join(c.name for c in self.settings.backends)
            if name.startswith(("http://", "https://")):
                raise RequestInvalid([
                    f"--from takes the name of a configured backend ({known}), not a URL; "
                    "an OVA is planned from the command line (deploybot migrate plan "
                    "--from-ova URL)."
                ])  # fmt: skip
            raise RequestInvalid([f"There is no backend {name!r} to migrate from; use {known}."])
        return sources.open_source(config, self.environ)

    def builder(self, name: str) -> BuildsTemplates:
        """The target: a backend of this process that builds templates."""
        return self.builds.builder(name)

    async def plan(
        self, source: str, target: str, scope: Scope, user: str
    ) -> tuple[KeptPlan, Plan]:
        """Read the source (read-only) and the target's built templates, classify, and
        keep the plan in the store; refuses a source or target that does not answer."""
        sources.check_distinct(self.settings.backends, source, target)
        builder = self.builder(target)
        opened = self.open_backend(source)
        try:
            versions = await builder.template_versions()
            profiles = self.settings.images.all_profiles()
            storage = await sources.target_storage_type(self.backends[target])
            made = await make_plan(
                opened, target, versions, profiles, scope, self.clock(),
                subnets=self.settings.subnets, storage_type=storage,
            )  # fmt: skip
        except BackendError as exc:
            raise UserError(plan_failed(exc, source, target)) from None
        finally:
            await opened.close()
        return await self.keep(made, user), made

    async def keep(self, plan: Plan, user: str) -> KeptPlan:
        return await keep_plan(self.store, plan, user)

    async def load(self, ref: str) -> Plan:
        return await load_plan(self.store, ref)

    # --- the apply ------------------------------------------------------------------

    async def apply(
        self,
        plan: Plan,
        user: str,
        *,
        origin: str | None = None,
        hand_off: bool = False,
        plan_id: str | None = None,
        dedupe_key: str | None = None,
    ) -> Applied:
        """Check the plan (its age, its source read again), then ask for the builds it
        needs. `hand_off`: queued builds are left to a serving process (the command
        line's --no-wait) rather than run here. Asked from chat (`origin`, a kept plan's
        `plan_id`) with builds still in flight, the apply is recorded: its final table
        is told in `origin` when the last of them ends (`record`; `dedupe_key`: the
        command's inbox key, so a redelivered command records no second apply)."""
        check_age(plan, self.clock(), self.settings.migration.plan_valid_s)
        check_findings(plan, self.settings.images.all_profiles(), self.settings.subnets)
        sources.check_distinct(self.settings.backends, plan.source, plan.target)
        builder = self.builder(plan.target)
        source = self.open_source(plan.source)
        # The store's builds before the target's templates: a build that publishes in
        # between is then seen as published (or its template seen), never as neither.
        wanted = {r.profile for r in rebuilds_of(plan)}
        known = await self.store.builds.of_profiles(plan.target, wanted)
        try:
            await check_source(plan, source)
            target = await builder.template_versions()
        except BackendError as exc:
            raise UserError(apply_failed(exc, plan)) from None
        finally:
            await source.close()

        async def request(profile: str) -> Build:
            return await self.builds.request(
                profile, plan.target, user, origin=origin, hand_off=hand_off
            )

        async def again(profile: str) -> list[Build]:
            return await self.store.builds.of_profiles(plan.target, [profile])

        applied = await start(plan, request, known, target, again)
        kept = plan_id is not None and PLAN_ID_RE.fullmatch(plan_id) is not None
        if origin is None or plan_id is None or not kept:
            return applied
        if all(r.ended for r in applied.rebuilds):
            return applied
        return await self.record(applied, plan_id, user, origin, dedupe_key)

    async def record(
        self, applied: Applied, plan_id: str, user: str, origin: str, key: str | None = None
    ) -> Applied:
        """Keep the apply with its builds (store/applies.py): whichever process ends the
        last of them keeps, in that same transaction, the notice of its end. An apply of
        this plan kept already for this command (`key`) or live in this channel stands
        for this one: its end is told once (`joined`)."""
        record = MigrationApply(
            id=new_apply_id() if key is None else apply_id_of(key),
            plan_id=plan_id,
            requester=user,
            origin=origin,
            rebuilds=json.dumps(rebuilds_document(applied), sort_keys=True),
            build_ids=tuple(r.build.id for r in applied.rebuilds if r.build is not None),
        )
        kept = await self.store.migration_applies.record(record)
        return replace(applied, recorded=kept.id, joined=kept.id != record.id)

    async def ended(self, apply_id: str) -> tuple[MigrationApply, Outcome] | None:
        """A recorded apply at its end, from the store alone (its plan, its builds, the
        templates they published): Slack delivery asks no backend. None when the record
        or its plan is gone."""
        record = await self.store.migration_applies.get(apply_id)
        if record is None:
            return None
        try:
            plan = await self.load(record.plan_id)
        except UserError:
            return None
        rebuilds = await rebuilds_from_document(json.loads(record.rebuilds), self.store.builds.get)
        applied = Applied(plan, rebuilds, recorded=record.id)
        return record, Outcome(applied, stored_target(applied))

    async def wait(
        self,
        applied: Applied,
        settle: Callable[[], Awaitable[None]],
        changed: Callable[[Build], Awaitable[None]],
        poll_s: float,
    ) -> Applied:
        """Until every build of `applied` has ended (bot/migration/apply.py)."""
        return await wait_for_builds(applied, self.store.builds.get, settle, changed, poll_s)

    async def outcome(self, applied: Applied) -> Outcome:
        """The apply as it stands: its builds read again, the target's templates now."""
        fresh = await refresh(applied, self.store.builds.get)
        try:
            versions = await self.builder(applied.plan.target).template_versions()
        except BackendError as exc:
            raise UserError(outcome_failed(exc, applied.plan.target)) from None
        return Outcome(fresh, target_profiles(versions))


def plan_failed(exc: BackendError, source: str, target: str) -> str:
    """A plan whose source or target failed: a passing fault says when to plan again, a
    permanent one what to fix (trying again would fail the same way)."""
    said = f"migrate plan: {exc.message}. Nothing was changed, and no plan was kept"
    if exc.retryable:
        return f"{said}; plan again once {source} and {target} answer."
    return f"{said}; fix what this says (the backend's entry or its account), then plan again."


def apply_failed(exc: BackendError, plan: Plan) -> str:
    said = f"migrate apply: {exc.message}. Nothing was started"
    if exc.retryable:
        return f"{said}; try again when {plan.source} and {plan.target} answer."
    return (
        f"{said}; fix what this says (the backend's entry or its account), then make a new "
        f"plan (migrate plan --from {plan.source} --to {plan.target}) and apply that."
    )


def outcome_failed(exc: BackendError, target: str) -> str:
    if exc.retryable:
        return (
            f"{target} did not answer when asked for its templates ({exc.message}); "
            f"`template list --backend {target}` shows them once it does."
        )
    return (
        f"{target} refused the list of its templates ({exc.message}); fix what this says "
        f"(its entry or its account), then `template list --backend {target}` shows them."
    )


async def keep_plan(store: Store, plan: Plan, user: str) -> KeptPlan:
    """Keep `plan` in the store, to be applied by its id (from chat or the command line)."""
    document = json.dumps(plan.document(), sort_keys=True, ensure_ascii=False)
    kept = KeptPlan(digest=plan.digest, document=document, created_by=user)
    return await store.migration_plans.keep(kept)


async def load_plan(store: Store, ref: str) -> Plan:
    """The plan a person named: a kept plan's id, or (the command line) a plan file's
    path. Its facts must still hash to its digest, and a kept one's to its row's."""
    if not PLAN_ID_RE.fullmatch(ref):
        return await asyncio.to_thread(_plan_file, Path(ref))
    kept = await store.migration_plans.get(ref)
    if kept is None:
        raise JobNotFound(f"There is no migration plan {ref}; make one with migrate plan.")
    try:
        document = json.loads(kept.document)
    except json.JSONDecodeError:
        document = None  # refused below as not a plan
    plan = plan_from_document(document, f"plan {ref}")
    if plan.digest != kept.digest:
        raise PlanFileError(f"plan {ref}: its digest was changed; make a new plan.")
    return plan


def _plan_file(path: Path) -> Plan:
    if not path.exists():
        raise JobNotFound(
            f"{str(path)[:80]}: neither a plan file nor a plan id (like m2k7tqa2bc); give "
            "the file migrate plan --out wrote, or the id it printed."
        )
    return read_plan(path)
