"""The local front end: chat-like threads on a terminal, and an interactive shell.

`TerminalThread` is the Progress a terminal shows: every job's lines carry its name and
id, so concurrent deploys stay readable when they interleave. `Shell` reads lines as a
chat would (`/deploy ...`, `as bob`, `approve j4k7tqa2`) and answers through the same
parser, service and queue the Slack front end uses.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from bot.app.service import Deployer
from bot.models import Job, JobState, RollbackReport
from bot.models.builds import Build
from handlers.commands import COMMANDS, answer
from handlers.messages import usage
from handlers.messages.builds import build_end, build_headline
from handlers.messages.core import (
    finished,
    headline,
    job_update,
    step_finished,
    step_started,
    switched_user,
)


class TerminalThread:
    """A Progress that prints each job as a thread of lines."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self._opened: set[str] = set()

    def _say(self, job: Job, text: str) -> None:
        for line in text.splitlines():
            self.out.write(f"  [{job.name} {job.short_id}] {line}\n")
        self.out.flush()

    async def job_updated(self, job: Job, note: str = "") -> None:
        if job.id not in self._opened:
            self._opened.add(job.id)
            self.out.write(f"┌ {headline(job)} (job {job.id})\n")
        if job.state is JobState.QUEUED and note == "" and job.approval_reason:
            self._say(job, "approved; queued.")
            return
        self._say(job, job_update(job, note))

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        self._say(job, step_started(step, detail))

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        self._say(job, step_finished(step, duration_s, ok, detail))

    async def job_note(self, job: Job, text: str) -> None:
        self._say(job, text)

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        self._say(job, "\n".join(finished(job, rollback)))
        self.out.write(f"└ {headline(job)}\n")
        self.out.flush()


class Shell:
    """One terminal chat: the current user types, the bot answers."""

    def __init__(self, deployer: Deployer, user: str, out: TextIO | None = None) -> None:
        self.deployer = deployer
        self.user = user
        self.out = out or sys.stdout

    def _reply(self, lines: list[str]) -> None:
        for line in lines:
            self.out.write(f"bot: {line}\n")
        self.out.flush()

    async def handle(self, line: str) -> bool:
        """Handle one typed line; False when the user wants to leave."""
        text = line.strip()
        words = text.split()
        if not words:
            return True
        head = words[0].lower()
        if head in ("quit", "exit", "/quit"):
            return False
        if head in ("as", "/as"):
            if len(words) != 2:
                self._reply(["Say who you want to be: as NAME (e.g. as bob)."])
            else:
                self.user = words[1]
                self._reply([switched_user(self.user)])
            return True
        shortcuts = [word for word in COMMANDS.keywords() if word != "help"]
        if head in ("help", "/help"):
            self._reply(usage.shell_help(shortcuts))
            return True
        if head == "/deploy":
            command = text[len(words[0]) :]
        elif head in shortcuts:  # every command of the registry, without /deploy
            command = text
        else:
            self._reply([usage.unknown_shell_input(shortcuts)])
            return True
        self._reply(await answer(self.deployer, self.user, command))
        return True

    async def run(self) -> None:
        self._reply([f"You are {self.user}. Type help for the commands, quit to leave."])
        while True:
            self.out.write(f"{self.user}> ")
            self.out.flush()
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:  # end of input
                break
            if not await self.handle(line):
                break
        if self.deployer.queue.running_count or self.deployer.queue.waiting_count:
            self._reply(["Waiting for running deploys to finish..."])
            await self.deployer.drain()


class TerminalBuilds:
    """Build progress (bot/kinds/build/) as a thread of lines, like a deploy's."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    async def build_note(self, build: Build, text: str) -> None:
        for line in text.splitlines():
            self.out.write(f"  [{build.versioned_name} {build.short_id}] {line}\n")
        self.out.flush()

    async def build_finished(self, build: Build) -> None:
        for line in build_end(build):
            self.out.write(f"  [{build.versioned_name} {build.short_id}] {line}\n")
        self.out.write(f"└ {build_headline(build)}\n")
        self.out.flush()
