"""What every part of Slack delivery shares (split from handlers/slack/threads.py): the
threads, cards and direct messages this process writes, and the count of parts each
notice still waits for. Each part is recorded in the store as it reaches Slack, so a
restart repeats only the others; a notice is marked delivered once every part is.
`SlackThreads` (threads.py) builds on this, through `BuildDelivery` (buildthreads.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime

from slack_sdk.web.async_client import AsyncWebClient

from bot.kinds import Rows
from bot.models.notices import Notice
from bot.sections import SlackSettings
from bot.service import Deployer
from handlers.slack.items import (
    ApprovalCard,
    BuildCard,
    BuildThread,
    DirectMessages,
    JobThread,
    Part,
)
from handlers.slack.outbox import Outboxes
from handlers.slack.zones import Zones


class Delivery:
    """The state of `SlackThreads`, and the parts of notices (see threads.py)."""

    def __init__(self, client: AsyncWebClient, settings: SlackSettings) -> None:
        self.settings = settings
        self.outboxes = Outboxes(client, settings.posts_per_second)
        self.threads: dict[str, JobThread] = {}
        self.cards: dict[str, ApprovalCard] = {}
        self.destroy_cards: dict[str, ApprovalCard] = {}
        self.dms: dict[str, DirectMessages] = {}
        # Template builds (ids starting with `b`): their threads and approval cards.
        self.build_threads: dict[str, BuildThread] = {}
        self.build_cards: dict[str, BuildCard] = {}
        self.zones = Zones(client)  # people's time zones, for lease times
        self._deployer: Deployer | None = None
        self._parts: Counter[int] = Counter()  # notice id -> parts not yet in Slack
        self._sent_before: dict[int, frozenset[str]] = {}  # parts a restart must not repeat
        self._sent: list[tuple[int, str]] = []  # parts in Slack, to record in the store
        self._delivered: list[int] = []  # to mark in the store
        self._held: set[str] = set()  # jobs whose delivery claim this process holds
        # What record each held id's notices follow: its kind's rows (bot/kinds/), looked
        # up once: a job's kind never changes.
        self._rows: dict[str, Rows] = {}
        self._cursor = 0
        self._orphans_at: datetime | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._poll_lock = asyncio.Lock()

    @property
    def deployer(self) -> Deployer:
        if self._deployer is None:
            raise RuntimeError("SlackThreads.bind(deployer) was not called")
        return self._deployer

    @property
    def me(self) -> str:
        return self.deployer.runner.id

    # --- parts ------------------------------------------------------------------------

    def _hold(self, notice: Notice) -> int:
        """While a notice's parts are being queued, none may finish it early."""
        assert notice.id is not None
        self._parts[notice.id] += 1
        self._sent_before[notice.id] = notice.sent
        return notice.id

    def _release(self, notice: int) -> None:
        self._sent_before.pop(notice, None)
        self._settle(notice)

    def _part(self, notice: int, name: str) -> Part | None:
        """A part of `notice` to put in Slack; None when Slack has it already (an earlier
        process delivered it before it stopped)."""
        if name in self._sent_before.get(notice, ()):
            return None
        self._parts[notice] += 1
        return Part(notice, name)

    def _done(self, parts: list[Part]) -> None:
        for part in parts:
            self._sent.append((part.notice, part.name))
            self._settle(part.notice)
        self._wake.set()  # recorded at once: a kill now must not repeat it

    def _settle(self, notice: int) -> None:
        self._parts[notice] -= 1
        if self._parts[notice] <= 0:
            self._finish_parts([notice])

    def _finish_parts(self, ids: list[int]) -> None:
        for notice in ids:
            self._parts.pop(notice, None)
            self._delivered.append(notice)
        self._wake.set()

    def _dm(self, user: str) -> DirectMessages:
        dm = self.dms.get(user)
        if dm is None:
            dm = self.dms[user] = DirectMessages(user, self._done)
        return dm
