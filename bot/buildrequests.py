"""Template builds as front ends ask for them, mixed into `Deployer` (split from
bot/service.py): request, approve or reject a build (bot/builds/ does the work), and
remember where a front end shows one."""

from __future__ import annotations

from bot.auditing import Audited
from bot.builds import Builds
from bot.models.builds import Build
from bot.settings import Settings


class BuildRequests(Audited):
    """Mixed into `Deployer`: the attributes below are the deployer's."""

    settings: Settings
    builds: Builds

    async def request_build(
        self,
        profile: str,
        backend: str | None,
        user: str,
        *,
        placement: str | None = None,
        storage: str | None = None,
        name: str | None = None,
        origin: str | None = None,
        can_wait_for_approval: bool = True,
    ) -> Build:
        """Build a template from a profile (on the default backend unless `backend`):
        queued here, or awaiting an approver (`[approval] builds`)."""
        async with self._audited(user, f"template build {profile[:64]}"):
            return await self.builds.request(
                profile,
                backend or self.settings.default_backend,
                user,
                placement=placement,
                storage=storage,
                name=name,
                origin=origin,
                can_wait_for_approval=can_wait_for_approval,
            )

    async def decide_build(
        self,
        build_id: str,
        approver: str,
        approved: bool,
        note: str | None = None,
        *,
        dedupe_key: str | None = None,
    ) -> Build:
        """Approve or reject a template build awaiting approval (its card's buttons)."""
        verb = "approve" if approved else "reject"
        async with self._audited(approver, f"{verb} {build_id[:40]}"):
            return await self.builds.decide(build_id, approver, approved, note, dedupe_key)

    async def cancel_build(self, build_id: str, user: str) -> Build:
        """Cancel a template build (bot/builds/cancel.py); a running one rolls back."""
        async with self._audited(user, f"cancel {build_id[:40]}"):
            return await self.builds.cancel(build_id, user)

    async def may_decide_build(self, build_id: str, approver: str) -> Build:
        async with self._audited(approver, f"decide {build_id[:40]}"):
            return await self.builds.check_decider(build_id, approver)

    async def set_build_refs(
        self, build_id: str, *, thread_ref: str | None = None, approval_ref: str | None = None
    ) -> None:
        """Remember where a front end shows this build (kept so a restart can find it)."""
        fields = {"thread_ref": thread_ref, "approval_ref": approval_ref}
        await self.store.builds.update(build_id, None, (), **{k: v for k, v in fields.items() if v})
