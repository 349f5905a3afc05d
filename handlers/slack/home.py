"""The App Home tab: a person's VMs, their quota, what waits for their approval, and
their recent jobs, published with `views.publish` when they open it.

It is published again when one of their jobs changes in this process (made, ready,
failed, destroyed) and after a click on its own buttons, but only for people who
opened it here since the process started: everyone else sees it fresh when they open
it. The buttons are the ones messages carry (Destroy, Approve, Reject: same action ids,
same handlers in interact.py), so the core decides exactly as it does for a message.
A home view holds at most 100 blocks; longer lists end with "… and N more".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime, tzinfo
from typing import Any

from slack_bolt.async_app import AsyncApp
from slack_sdk.errors import SlackApiError
from slack_sdk.models.blocks import (
    ActionsBlock,
    Block,
    ButtonElement,
    ContextBlock,
    MarkdownTextObject,
    SectionBlock,
)
from slack_sdk.models.views import View
from slack_sdk.web.async_client import AsyncWebClient

from bot.app.queries import VMPage
from bot.app.service import Deployer
from bot.models import Job, JobState, RollbackReport, utcnow
from bot.models.errors import UserError
from bot.requests.quotas import Standing
from handlers.messages.destroys import destroy_summary
from handlers.messages.lifecycle import (
    HOME_APPROVALS,
    HOME_NO_JOBS,
    HOME_NO_VMS,
    HOME_RECENT,
    HOME_VMS,
    home_more,
    home_recent_row,
    quota_used,
)
from handlers.messages.listing import list_row
from handlers.messages.slack import approval_summary
from handlers.messages.text import escape
from handlers.slack import views
from handlers.slack.zones import Zones

log = logging.getLogger(__name__)
HOME_BLOCKS_MAX = 100  # Slack's limit for a home view
VMS_READ = 60  # more than fit: the rest is counted, not shown
RECENT = 10
# The blocks kept back for the sections after the VMs (headers, "more" lines, recent).
_RESERVED = 8


class HomeTabs:
    """Who opened the home here, and publishing it for them. It listens to the core like
    a front end (a `Progress`), but only starts a publish in a task: the core's own work
    never waits for Slack."""

    def __init__(
        self,
        deployer: Deployer,
        client: AsyncWebClient,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        zones: Zones,
    ) -> None:
        self.deployer = deployer
        self.client = client
        self.spawn = spawn
        self.zones = zones  # lease ends in the reader's zone, as in threads and DMs
        self.seen: set[str] = set()
        self._due: set[str] = set()  # publishes started and not yet made: one is enough
        # One publish at a time per person, so an older read never lands after a newer one.
        self._turns: dict[str, asyncio.Lock] = {}

    def register(self, app: AsyncApp) -> None:
        async def on_home_opened(event: dict[str, Any]) -> None:  # Bolt acks events itself
            if event.get("tab", "home") == "home" and event.get("user"):
                self.refresh(str(event["user"]), opened=True)

        app.event("app_home_opened")(on_home_opened)

    def refresh(self, user: str, *, opened: bool = False) -> None:
        """Publish `user`'s home soon, if they opened it here (`opened`: they just did)."""
        if opened:
            self.seen.add(user)
        if user in self.seen and user not in self._due:
            self._due.add(user)
            self.spawn(self.publish(user))

    async def publish(self, user: str) -> None:
        async with self._turns.setdefault(user, asyncio.Lock()):
            self._due.discard(user)  # a change from here on publishes again
            try:
                zone = await self.zones.of(user)
                view = await home_view(self.deployer, user, utcnow(), zone)
                await self.client.views_publish(user_id=user, view=view)
            except SlackApiError as exc:
                log.error("could not publish %s's App Home: %s", user, exc.response.get("error"))

    async def job_updated(self, job: Job, note: str = "") -> None:
        """A job of theirs was made or changed state: its requester's home is stale.
        Approvers' homes wait until they open the tab again: publishing every approver's
        home on every request would cost more than it helps."""
        self.refresh(job.requester)

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        pass

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        pass

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        self.refresh(job.requester)

    async def job_note(self, job: Job, text: str) -> None:
        pass


async def home_view(deployer: Deployer, user: str, now: datetime, zone: tzinfo = UTC) -> View:
    page = await deployer.list_vms(user, 1, VMS_READ)
    pending: list[Job] = []
    if await deployer.is_approver(user):  # never one's own: nobody approves those
        pending = [j for j in await deployer.pending_approvals() if _asker(j) != user]
    recent = await deployer.history(limit=RECENT, requester=user)
    try:
        standings = await deployer.quota_standing(user)
    except UserError as exc:  # a group that cannot be listed: the home still opens
        log.warning("no quota on %s's App Home: %s", user, exc.message)
        standings = []
    blocks = home_blocks(page, standings, pending, recent, now, zone)
    return View(type="home", blocks=blocks)


def _asker(job: Job) -> str:
    """Who asked for what waits: the requester, or for a destroy whoever asked it."""
    if job.state is JobState.DESTROY_REQUESTED and job.destroy_by:
        return job.destroy_by
    return job.requester


def home_blocks(
    page: VMPage,
    standings: Sequence[Standing],
    pending: Sequence[Job],
    recent: Sequence[Job],
    now: datetime,
    zone: tzinfo = UTC,
) -> list[Block]:
    blocks: list[Block] = [views.header(HOME_VMS)]
    quota = [quota_used(s) for s in standings]
    if quota:
        blocks.append(_context("\n".join(quota)))
    room = HOME_BLOCKS_MAX - _RESERVED - len(blocks) - (2 * len(pending[:1]))
    blocks += _vm_rows(page, now, room, zone)
    if pending:
        blocks.append(views.header(HOME_APPROVALS))
        room = (HOME_BLOCKS_MAX - len(blocks) - 4) // 2  # 2 blocks each; more, recent
        for job in pending[:room]:
            blocks += _decision(job)
        if len(pending) > room:
            blocks.append(_context(home_more(len(pending) - room, "the approvals channel")))
    blocks.append(views.header(HOME_RECENT))
    rows = [home_recent_row(j, now) for j in recent] or [HOME_NO_JOBS]
    blocks.append(SectionBlock(text=MarkdownTextObject(text=views.fit("\n".join(rows), 3000))))
    return blocks


def _vm_rows(page: VMPage, now: datetime, room: int, zone: tzinfo) -> list[Block]:
    if not page.jobs:
        return [SectionBlock(text=MarkdownTextObject(text=escape(HOME_NO_VMS)))]
    shown = page.jobs[: max(1, room - 1)]
    rows: list[Block] = []
    for job in shown:
        row = views.fit(list_row(job, now, zone), views.SECTION_MAX)
        button = views.destroy_button(job) if job.state is JobState.SUCCEEDED else None
        rows.append(SectionBlock(text=MarkdownTextObject(text=row), accessory=button))
    if page.total > len(shown):
        rows.append(_context(home_more(page.total - len(shown), "/deploy list")))
    return rows


def _decision(job: Job) -> list[Block]:
    """A deploy's or a destroy's approval, with the buttons of the approvals channel's
    card (block ids carry the job: a view's block ids must be unique)."""
    destroy = job.state is JobState.DESTROY_REQUESTED
    text = destroy_summary(job) if destroy else approval_summary(job)
    return [
        SectionBlock(
            block_id=f"summary-{job.id}",
            text=MarkdownTextObject(text=views.fit(text, views.SECTION_MAX)),
        ),
        ActionsBlock(
            block_id=f"decision-{job.id}",
            elements=[
                ButtonElement(
                    text="Approve",
                    action_id=views.APPROVE,
                    value=job.id,
                    style="danger" if destroy else "primary",
                ),
                ButtonElement(text="Reject", action_id=views.REJECT, value=job.id),
            ],
        ),
    ]


def _context(text: str) -> ContextBlock:
    """Plain text as a context line (escaped: it may quote group ids from the config)."""
    return ContextBlock(elements=[MarkdownTextObject(text=views.fit(views.mrkdwn(text), 3000))])
