"""The build kind: a template built from a profile (bot/kinds/build/). Its jobs are the rows
of their own table, `builds`: the store answers this kind for them (store/jobs.kind_of),
and builds whose runner died are rolled back by `sweep` rather than taken over one by
one."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from bot.kinds import Rows
from bot.models import Job
from bot.models.builds import BUILD_KIND, Build

if TYPE_CHECKING:
    from bot.kinds.build.service import Builds
    from bot.ownership.claims import Ended


class BuildKind:
    name = BUILD_KIND  # what the store answers for a row of `builds`
    noun = "build"
    rows: Rows = "builds"

    def __init__(self, builds: Builds) -> None:
        self.builds = builds

    async def run(self, job_id: str) -> object:
        return await self.builds.run(job_id)

    async def recover(self, job: Job, ended: Ended | None) -> bool:
        raise TypeError(f"job {job.id} is a `jobs` row, never a build's")

    def sweep(self) -> Coroutine[Any, Any, object] | None:
        return self.builds.recover()

    async def decide(
        self,
        ref: str,
        approver: str,
        approved: bool,
        reason: str | None = None,
        dedupe_key: str | None = None,
    ) -> Build:
        return await self.builds.decide(ref, approver, approved, reason, dedupe_key)

    async def may_decide(self, ref: str, approver: str) -> Build:
        return await self.builds.check_decider(ref, approver)

    async def cancel(self, ref: str, user: str) -> Build:
        return await self.builds.cancel(ref, user)
