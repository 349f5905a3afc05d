"""Template builds in Slack (split from handlers/slack/threads.py): a build's notices
(bot/builds/) as lines of its thread, its headline, its approval card and the decision
that replaces the card's buttons, and the end told to the requester by direct message."""

from __future__ import annotations

from bot.models import utcnow
from bot.models.builds import Build, BuildState
from bot.models.notices import (
    BUILD_ASKED,
    BUILD_DECIDED,
    BUILD_FINISHED,
    BUILD_NOTE,
    Notice,
    NoticeKind,
)
from handlers.messages.builds import (
    build_card_outcome,
    build_outcome_dm,
    build_thread_update,
    slack_build_end,
)
from handlers.slack import views
from handlers.slack.delivery import Delivery
from handlers.slack.items import BuildCard, BuildThread, Line, parse_ref


class BuildDelivery(Delivery):
    """Mixed into `SlackThreads`: what it does with a build's notices."""

    async def _release_build(self, build_id: str) -> None:
        """A build's delivery claim goes once it ended and all of it is in Slack."""
        parts = (self.build_threads.get(build_id), self.build_cards.get(build_id))
        if any(part is not None and part.pending() for part in parts):
            return
        build = await self.deployer.queries.build(build_id)
        if build is None or build.state.final or build.state is BuildState.PUBLISHED:
            await self.deployer.chat_outbox.release(build_id, self.me, utcnow())
            self._held.discard(build_id)
            self.build_threads.pop(build_id, None)
            self.build_cards.pop(build_id, None)

    def _apply_build(self, build: Build, notice: Notice) -> None:
        """A build's notice: a line in its thread (the end, urgent), its headline, and
        its approval card (asked for, then replaced by the decision)."""
        nid = self._hold(notice)
        part = notice.step or ""
        if notice.kind is NoticeKind.BUILD:
            if part == BUILD_NOTE:
                self._build_say(build, views.mrkdwn(notice.text), nid)
            elif part == BUILD_FINISHED:
                text = views.mrkdwn(slack_build_end(build))
                self._build_say(build, text, nid, urgent=True)
                dm = self._part(nid, "dm") if build.origin else None
                if dm is not None:  # the requester hears the end by direct message too
                    outcome = build_outcome_dm(build)
                    self._dm(build.requester).lines.append(Line(views.mrkdwn(outcome), dm))
                    self.outboxes.touch(self._dm(build.requester))
            else:
                said = build_thread_update(build, part, notice.text)
                self._build_say(build, views.mrkdwn(said), nid)
            if part == BUILD_ASKED and build.approval_reason:
                self._ask_build_approvers(build, nid)
            elif part == BUILD_DECIDED:
                self._build_decided(build, notice.text, nid)
        self._release(nid)

    def _build_thread(self, build: Build) -> BuildThread | None:
        thread = self.build_threads.get(build.id)
        if thread is None:
            known = parse_ref(build.thread_ref)
            if known is not None:
                thread = BuildThread(build, known[0], self.deployer, self._done, ts=known[1])
            elif build.origin:
                thread = BuildThread(build, build.origin, self.deployer, self._done)
            else:
                return None  # asked for elsewhere (the shell): no Slack thread
            self.build_threads[build.id] = thread
        thread.build = build
        return thread

    def _build_say(self, build: Build, text: str, nid: int, *, urgent: bool = False) -> None:
        thread = self._build_thread(build)
        if thread is None:
            return
        line, headline = self._part(nid, "line"), self._part(nid, "headline")
        if line is not None:
            thread.lines.append(Line(text, line, urgent=urgent))
        if headline is not None:
            thread.show_headline(headline)
        self.outboxes.touch(thread)

    def _ask_build_approvers(self, build: Build, nid: int) -> None:
        if build.id in self.build_cards or build.approval_ref:
            return
        channel = self.settings.approvals_channel or build.origin
        if channel is None:
            return
        card = BuildCard(build, channel, self.deployer, self._done)
        self.build_cards[build.id] = card
        if build.state is not BuildState.AWAITING_APPROVAL:  # decided before it was shown
            card.outcome = build_card_outcome(build, build.error or "")
        self._show_build_card(card, nid)

    def _build_decided(self, build: Build, note: str, nid: int) -> None:
        card = self.build_cards.get(build.id)
        if card is None:
            known = parse_ref(build.approval_ref)
            if known is None:
                return  # never shown (no channel): nothing to replace
            card = BuildCard(build, known[0], self.deployer, self._done, ts=known[1])
            self.build_cards[build.id] = card
        card.build = build
        card.outcome = build_card_outcome(build, note)
        self._show_build_card(card, nid)

    def _show_build_card(self, card: BuildCard, nid: int) -> None:
        part = self._part(nid, "card")
        if part is not None:
            card.will_show(part)
            self.outboxes.touch(card)
