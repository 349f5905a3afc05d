"""What a build runner works with besides the backend (split from bot/kinds/build/runner.py):
who hears of a build (`BuildNotes`), the deploy machinery its smoke step uses
(`SmokeDeploys`) and the notices chat must be given. A step fails with
`bot.kinds.deploy.runs.StepFailed`, as a deploy's does."""

from __future__ import annotations

import logging
from typing import Protocol

from bot.models import Job
from bot.models.builds import Build
from bot.models.notices import Notice, NoticeKind

log = logging.getLogger("bot.kinds.build.runner")


class BuildNotes(Protocol):
    """What a front end hears of a build: a line of progress, and its end."""

    async def build_note(self, build: Build, text: str) -> None: ...

    async def build_finished(self, build: Build) -> None: ...


class LoggedBuildNotes:
    """No front end listening: the runner's log lines are all there is."""

    async def build_note(self, build: Build, text: str) -> None:
        return None

    async def build_finished(self, build: Build) -> None:
        log.info("build %s ended %s", build.id, build.state.value)


class SmokeDeploys(Protocol):
    """The deploy machinery the smoke step uses (the Deployer's intake, pipeline and
    destroyer): check what a smoke deploy would be refused for (before anything is made),
    record a deploy, run it here, destroy its VM."""

    async def check(self, build: Build, template: str) -> None:
        """Raise the `UserError` the smoke deploy's request would meet, as far as it
        can be known before its template exists (its subnet, sizes, login)."""
        ...

    async def record(self, build: Build, template: str) -> Job: ...

    async def run(self, job_id: str) -> Job | None: ...

    async def destroy(self, job: Job, build: Build) -> Job | None: ...


def build_notice(build_id: str, part: str, text: str = "") -> Notice:
    """What chat must tell of a build (store/outbox.py keeps it only for builds someone
    follows there: asked in a channel, or waiting for an approver)."""
    return Notice(job_id=build_id, kind=NoticeKind.BUILD, step=part, text=text)
