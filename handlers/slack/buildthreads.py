"""Template builds in Slack: a build's notices (bot/kinds/build/) as lines of its thread, its
headline, its approval card and the decision that replaces the card's buttons, and the
end told to the requester by direct message. `SlackThreads` (threads.py) holds one
`BuildDelivery` and hands it the notices of the builds whose delivery it holds."""

from __future__ import annotations

from collections.abc import Callable

from bot.app.service import Deployer
from bot.models import utcnow
from bot.models.builds import Build, BuildState
from bot.models.notices import (
    BUILD_ASKED,
    BUILD_DECIDED,
    BUILD_FINISHED,
    BUILD_NOTE,
    MIGRATION_ENDED,
    Notice,
    NoticeKind,
)
from handlers.messages.builds import (
    build_card_outcome,
    build_outcome_dm,
    build_thread_update,
    slack_build_end,
)
from handlers.messages.migration import apply_ended_lines
from handlers.slack import views
from handlers.slack.delivery import Parts
from handlers.slack.items import (
    BuildCard,
    BuildThread,
    DirectMessages,
    Line,
    OneMessage,
    parse_ref,
)
from handlers.slack.outbox import Outboxes


class BuildDelivery:
    """What Slack delivery does with a build's notices: its threads and approval cards.

    `dm` gives the conversation with a person (shared with the jobs' messages);
    `approvals_channel` is where approval cards go (else the build's own channel)."""

    def __init__(
        self,
        deployer: Deployer,
        parts: Parts,
        outboxes: Outboxes,
        dm: Callable[[str], DirectMessages],
        approvals_channel: str | None,
    ) -> None:
        self._deployer = deployer
        self._parts = parts
        self._outboxes = outboxes
        self._dm = dm
        self._approvals_channel = approvals_channel
        self.threads: dict[str, BuildThread] = {}
        self.cards: dict[str, BuildCard] = {}

    async def release(self, build_id: str) -> bool:
        """A build's delivery claim goes once it ended and all of it is in Slack: True
        when it went."""
        build = await self._deployer.queries.build(build_id)
        items = (self.threads.get(build_id), self.cards.get(build_id))
        if any(item is not None and item.pending() for item in items):
            return False
        if not self._parts.quiet(build_id):
            return False
        if build is None or build.state.final or build.state is BuildState.PUBLISHED:
            me = self._deployer.runner.id
            await self._deployer.chat_outbox.release(build_id, me, utcnow())
            self.threads.pop(build_id, None)
            self.cards.pop(build_id, None)
            return True
        return False

    def forget(self, build_id: str) -> None:
        """Another process delivers this build's notices now: say nothing more of it."""
        for item in (self.threads.pop(build_id, None), self.cards.pop(build_id, None)):
            if item is not None:
                item.abandon()

    async def apply_all(self, build_id: str, notices: list[Notice]) -> int:
        """Apply a build's undelivered notices: how many were taken (all of them; those
        of a build that is gone are finished unshown)."""
        build = await self._deployer.queries.build(build_id)
        if build is None:
            self._parts.finish([n.id for n in notices if n.id is not None])
            return len(notices)
        for notice in notices:
            if notice.kind is NoticeKind.BUILD and notice.step == MIGRATION_ENDED:
                await self._migration_ended(notice)
            else:
                self.apply(build, notice)
        return len(notices)

    async def _migration_ended(self, notice: Notice) -> None:
        """The last build of a migration apply asked from chat ended: its final table,
        drawn from the store (no backend is asked), posted once in the channel it was
        asked from. A record or plan that is gone leaves nothing to show."""
        # Read before holding: a read that fails leaves the notice held by nobody, so the
        # build's claim goes and the orphan scan brings the notice back (held, it would
        # wait for a part that never comes, its claim renewed for ever).
        ended = await self._deployer.migrations.ended(notice.text)
        nid = self._parts.hold(notice)
        part = self._parts.part(nid, "end") if ended is not None else None
        if ended is not None and part is not None:
            record, outcome = ended
            head, *body = apply_ended_lines(record, outcome)
            text = views.mrkdwn(head)
            blocks = views.answer([text])
            blocks += views.answer([views.mrkdwn(line) for line in body], monospace=True)
            message = OneMessage(record.origin, text, blocks, part, self._parts.done)
            self._outboxes.touch(message)
        self._parts.release(nid)

    def apply(self, build: Build, notice: Notice) -> None:
        """A build's notice: a line in its thread (the end, urgent), its headline, and
        its approval card (asked for, then replaced by the decision)."""
        nid = self._parts.hold(notice)
        part = notice.step or ""
        if notice.kind is NoticeKind.BUILD:
            if part == BUILD_NOTE:
                self._say(build, views.mrkdwn(notice.text), nid)
            elif part == BUILD_FINISHED:
                text = views.mrkdwn(slack_build_end(build))
                self._say(build, text, nid, urgent=True)
                dm = self._parts.part(nid, "dm") if build.origin else None
                if dm is not None:  # the requester hears the end by direct message too
                    outcome = build_outcome_dm(build)
                    self._dm(build.requester).lines.append(Line(views.mrkdwn(outcome), dm))
                    self._outboxes.touch(self._dm(build.requester))
            else:
                said = build_thread_update(build, part, notice.text)
                self._say(build, views.mrkdwn(said), nid)
            if part == BUILD_ASKED and build.approval_reason:
                self._ask_approvers(build, nid)
            elif part == BUILD_DECIDED:
                self._decided(build, notice.text, nid)
        self._parts.release(nid)

    def _thread(self, build: Build) -> BuildThread | None:
        thread = self.threads.get(build.id)
        if thread is None:
            done = self._parts.done
            known = parse_ref(build.thread_ref)
            if known is not None:
                thread = BuildThread(build, known[0], self._deployer, done, ts=known[1])
            elif build.origin:
                thread = BuildThread(build, build.origin, self._deployer, done)
            else:
                return None  # asked for elsewhere (the shell): no Slack thread
            self.threads[build.id] = thread
        thread.build = build
        return thread

    def _say(self, build: Build, text: str, nid: int, *, urgent: bool = False) -> None:
        thread = self._thread(build)
        if thread is None:
            return
        line, headline = self._parts.part(nid, "line"), self._parts.part(nid, "headline")
        if line is not None:
            thread.lines.append(Line(text, line, urgent=urgent))
        if headline is not None:
            thread.show_headline(headline)
        self._outboxes.touch(thread)

    def _ask_approvers(self, build: Build, nid: int) -> None:
        if build.id in self.cards or build.approval_ref:
            return
        channel = self._approvals_channel or build.origin
        if channel is None:
            return
        card = BuildCard(build, channel, self._deployer, self._parts.done)
        self.cards[build.id] = card
        if build.state is not BuildState.AWAITING_APPROVAL:  # decided before it was shown
            card.outcome = build_card_outcome(build, build.error or "")
        self._show_card(card, nid)

    def _decided(self, build: Build, note: str, nid: int) -> None:
        card = self.cards.get(build.id)
        if card is None:
            known = parse_ref(build.approval_ref)
            if known is None:
                return  # never shown (no channel): nothing to replace
            done = self._parts.done
            card = BuildCard(build, known[0], self._deployer, done, ts=known[1])
            self.cards[build.id] = card
        card.build = build
        card.outcome = build_card_outcome(build, note)
        self._show_card(card, nid)

    def _show_card(self, card: BuildCard, nid: int) -> None:
        part = self._parts.part(nid, "card")
        if part is not None:
            card.will_show(part)
            self._outboxes.touch(card)
