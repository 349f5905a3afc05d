"""What one Slack message (or run of messages) still has to say, and the one call that says it.

Each deploy gets a parent message in the channel where it was asked for ("web01
10.0.0.50 on sim: deploying"), kept current with `chat.update`, and a thread with one
line per step and its duration, ending with `ssh USER@ADDRESS` or with what failed and
what the rollback did. A request that needs approval also gets a card with Approve /
Reject buttons, replaced by the decision once there is one. A requester whose deploy
ended also hears it by direct message (another channel, so another rate budget).

Every part an item shows comes from a notice in the store's outbox; once the call that
carries a part succeeded, the item hands the part to `done`, which records it in the
store, and the notice is marked delivered when all its parts are
(handlers/slack/threads.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from slack_sdk.web.async_client import AsyncWebClient

from bot.app.service import Deployer
from bot.models import Job
from bot.models.builds import Build
from handlers.messages.builds import build_approval_needed, build_headline
from handlers.messages.destroys import destroy_needed
from handlers.messages.slack import approval_needed, slack_headline
from handlers.slack import views

REPLY_MAX = 3500  # characters per coalesced thread reply


class Part(NamedTuple):
    """One part of what a notice changes in Slack: a `line` of a thread, the `headline`
    of its parent, a direct message (`dm`), an approval `card`. Each is recorded in the
    store once Slack has it, so a restart repeats only the parts that are not."""

    notice: int
    name: str


Done = Callable[[list[Part]], None]


CARRIES = "outcome"  # a parent posted after its job ended: it shows the outcome itself


def ref(channel: str, ts: str, *, carries: bool = False) -> str:
    """Where a message is, kept in the store: `channel/ts`, and `/outcome` when it is a
    parent that carries its job's outcome (so an edit by a later process keeps it)."""
    return f"{channel}/{ts}/{CARRIES}" if carries else f"{channel}/{ts}"


def parse_ref(text: str | None) -> tuple[str, str] | None:
    if not text or "/" not in text:
        return None
    channel, ts = text.split("/")[:2]
    return channel, ts


def carries_outcome(text: str | None) -> bool:
    return text is not None and text.endswith(f"/{CARRIES}")


@dataclass
class Line:
    text: str  # mrkdwn
    part: Part  # the part of a notice it shows
    urgent: bool = False


def batch(lines: list[Line]) -> list[Line]:
    """As many pending lines as fit in one message (at least one, cut if it is huge)."""
    taken: list[Line] = []
    size = 0
    for line in lines:
        if taken and size + len(line.text) + 1 > REPLY_MAX:
            break
        if len(line.text) > REPLY_MAX:
            line = Line(views.fit(line.text, REPLY_MAX), line.part, line.urgent)
        taken.append(line)
        size += len(line.text) + 1
    return taken


class _Thread:
    """What a job's and a build's threads share: the parent message carries the headline
    (kept current), the thread the lines; each notice is marked done once Slack shows it.

    A parent posted only once the outcome is known (a backlogged channel reaches it
    late) carries the outcome itself, below the headline, and the progress that was
    waiting to be said before it is dropped: one post instead of a parent and a reply
    of steps nobody needs any more."""

    channel: str
    done: Done
    ts: str | None
    shown: str | None
    lines: list[Line]
    headline_for: list[Part]
    dead: bool
    carried: list[str]  # mrkdwn: the outcome the parent shows below its headline
    unkept: str | None  # where the parent is, posted but not yet kept in the store
    covered: list[Part]  # the parts the parent shows, said once `unkept` is kept

    @property
    def headline(self) -> str:
        raise NotImplementedError

    def _blocks(self, headline: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def _keep_ref(self, thread_ref: str) -> None:
        """Remember where the thread is (kept so a restart can find it)."""
        raise NotImplementedError

    def pending(self) -> bool:
        return not self.dead and (
            self.ts is None
            or bool(self.lines)
            or self.shown != self.headline
            or self.unkept is not None
        )

    def urgent(self) -> bool:
        return any(line.urgent for line in self.lines)

    def show_headline(self, part: Part) -> None:
        """The headline must show what `part`'s notice changed (already shown: done, or
        once the parent's place is kept)."""
        if self.ts is not None and self.shown == self.headline:
            if self.unkept is not None:
                self.covered.append(part)
            else:
                self.done([part])
        else:
            self.headline_for.append(part)

    def _message(self, headline: str, carried: list[str]) -> tuple[str, list[dict[str, Any]]]:
        """The parent's text and blocks: the headline, and the outcome it carries."""
        if not carried:
            return headline, self._blocks(headline)
        outcome = views.fit("\n".join(carried), REPLY_MAX)
        return f"{headline}\n{outcome}", [*self._blocks(headline), *views.answer([outcome])]

    def _late(self) -> list[Line]:
        """The lines up to the last outcome among them (none without an outcome)."""
        last = max((n for n, line in enumerate(self.lines) if line.urgent), default=-1)
        return self.lines[: last + 1]

    async def flush_one(self, client: AsyncWebClient) -> None:
        if self.unkept is None:
            await self._say_one(client)
        if self.unkept is not None:
            # The parent is in Slack; where it is must be kept before its parts count as
            # said, so a restart finds it. A database away raises here (StoreError): the
            # outbox tries again later and only this is done again, never the post.
            await self._keep_ref(self.unkept)
            self.unkept = None
            covered, self.covered = self.covered, []
            self.done(covered)

    async def _say_one(self, client: AsyncWebClient) -> None:
        headline = self.headline
        if self.ts is None:
            late = self._late()
            carried = [line.text for line in late if line.urgent]
            text, blocks = self._message(headline, carried)
            shows = list(self.headline_for)  # what the posted headline shows (more may come)
            answer = await client.chat_postMessage(channel=self.channel, text=text, blocks=blocks)
            self.ts, self.shown, self.carried = str(answer["ts"]), headline, carried
            self.unkept = ref(self.channel, self.ts, carries=bool(carried))
            del self.lines[: len(late)]  # said by the parent, or progress it supersedes
            del self.headline_for[: len(shows)]
            self.covered = [*shows, *(line.part for line in late)]
        elif self.lines:
            sent = batch(self.lines)
            await client.chat_postMessage(
                channel=self.channel, thread_ts=self.ts, text="\n".join(s.text for s in sent)
            )
            del self.lines[: len(sent)]
            self.done([s.part for s in sent])
        else:
            text, blocks = self._message(headline, self.carried)
            await client.chat_update(channel=self.channel, ts=self.ts, text=text, blocks=blocks)
            self.shown = headline
            self._headline_shown()

    def _headline_shown(self) -> None:
        covered, self.headline_for = self.headline_for, []
        self.done(covered)

    def give_up(self) -> None:
        """Slack refused for good (channel gone): what it had to say is dropped."""
        self.dead = True
        self.done([*self.covered, *self.headline_for, *(line.part for line in self.lines)])
        self.covered, self.headline_for, self.lines = [], [], []

    def abandon(self) -> None:
        """Another process delivers this thread now: say nothing more, finish nothing."""
        self.dead = True


@dataclass(eq=False)
class JobThread(_Thread):
    """One deploy's parent message and thread, and what is still to be posted to it."""

    job: Job
    channel: str
    deployer: Deployer
    done: Done
    ts: str | None = None
    step: str | None = None
    shown: str | None = None  # the headline Slack currently shows
    lines: list[Line] = field(default_factory=list)
    headline_for: list[Part] = field(default_factory=list)  # parts shown by the headline
    dead: bool = False
    carried: list[str] = field(default_factory=list)
    unkept: str | None = None
    covered: list[Part] = field(default_factory=list)

    @property
    def headline(self) -> str:
        """Mrkdwn: the job's name and place come from the request, so they are escaped."""
        return slack_headline(self.job, self.step)

    def _blocks(self, headline: str) -> list[dict[str, Any]]:
        return views.parent(self.job, headline)

    async def _keep_ref(self, thread_ref: str) -> None:
        await self.deployer.personal.set_refs(self.job.id, thread_ref=thread_ref)


class _Card:
    """What approval cards share: posted with buttons, then edited to show the decision;
    the notices it shows are done once it shows its outcome."""

    channel: str
    done: Done
    ts: str | None
    outcome: str | None
    shown: str | None
    waiting: list[Part]
    dead: bool
    unkept: str | None  # where the card is, posted but not yet kept in the store

    def _request(self) -> tuple[list[dict[str, Any]], str]:
        """The card's blocks and text while it waits for a decision."""
        raise NotImplementedError

    def _decided(self, outcome: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def _keep_ref(self, card_ref: str) -> None:
        raise NotImplementedError

    def pending(self) -> bool:
        return not self.dead and (
            self.ts is None or self.outcome != self.shown or self.unkept is not None
        )

    def urgent(self) -> bool:
        return self.ts is None  # approvers are waited for: the card goes first

    def will_show(self, part: Part) -> None:
        if self.pending():
            self.waiting.append(part)
        else:
            self.done([part])

    async def flush_one(self, client: AsyncWebClient) -> None:
        if self.unkept is None:
            await self._show(client)
        if self.unkept is not None:  # as a thread's parent: kept again after a StoreError
            await self._keep_ref(self.unkept)
            self.unkept = None
        if not self.pending():
            covered, self.waiting = self.waiting, []
            self.done(covered)

    async def _show(self, client: AsyncWebClient) -> None:
        outcome = self.outcome
        if outcome is None:
            blocks, text = self._request()
        else:
            # A decision quotes a reason of any length: its notification text is cut.
            blocks, text = self._decided(outcome), views.fit(outcome, views.SECTION_MAX)
        if self.ts is None:
            answer = await client.chat_postMessage(channel=self.channel, text=text, blocks=blocks)
            self.ts = str(answer["ts"])
            self.unkept = ref(self.channel, self.ts)
        else:
            await client.chat_update(channel=self.channel, ts=self.ts, text=text, blocks=blocks)
        self.shown = outcome

    def give_up(self) -> None:
        self.dead = True
        covered, self.waiting = self.waiting, []
        self.done(covered)

    def abandon(self) -> None:
        """Another process delivers this card now: show nothing more, finish nothing."""
        self.dead = True


@dataclass(eq=False)
class ApprovalCard(_Card):
    """The approval request with its buttons, and the decision that replaces them."""

    job: Job
    channel: str
    deployer: Deployer
    done: Done
    ts: str | None = None
    outcome: str | None = None  # mrkdwn: the decision that replaces the buttons
    shown: str | None = None
    waiting: list[Part] = field(default_factory=list)  # parts shown once flushed
    dead: bool = False
    unkept: str | None = None
    destroy: bool = False  # the card asks for a destroy (bot/kinds/deploy/destroy.py), not a deploy

    def _request(self) -> tuple[list[dict[str, Any]], str]:
        blocks = (views.destroy_request if self.destroy else views.approval_request)(self.job)
        needed = destroy_needed if self.destroy else approval_needed
        return blocks, views.mrkdwn(needed(self.job))

    def _decided(self, outcome: str) -> list[dict[str, Any]]:
        decided = views.destroy_decided if self.destroy else views.approval_decided
        return decided(self.job, outcome)

    async def _keep_ref(self, card_ref: str) -> None:
        if self.destroy:
            await self.deployer.personal.set_refs(self.job.id, destroy_ref=card_ref)
        else:
            await self.deployer.personal.set_refs(self.job.id, approval_ref=card_ref)


@dataclass(eq=False)
class DirectMessages:
    """Outcomes told to one person by direct message, several in one message when they
    pile up (a person with many deploys must not wait for one message per second)."""

    channel: str  # the user's id: Slack posts it in the app's conversation with them
    done: Done
    lines: list[Line] = field(default_factory=list)
    dead: bool = False

    def pending(self) -> bool:
        return not self.dead and bool(self.lines)

    def urgent(self) -> bool:
        return True

    async def flush_one(self, client: AsyncWebClient) -> None:
        sent = batch(self.lines)
        await client.chat_postMessage(channel=self.channel, text="\n".join(s.text for s in sent))
        # By identity: `drop` may have taken lines out while the post was on its way.
        self.lines = [line for line in self.lines if all(line is not s for s in sent)]
        self.done([s.part for s in sent])

    def give_up(self) -> None:
        self.dead = True
        covered, self.lines = [s.part for s in self.lines], []
        self.done(covered)

    def drop(self, notices: set[int]) -> None:
        """Say nothing more of these notices (another process delivers their jobs now)."""
        if notices:
            self.lines = [line for line in self.lines if line.part.notice not in notices]


@dataclass(eq=False)
class OneMessage:
    """One message with blocks, posted once: a lease reminder with its buttons (Extend /
    Destroy now) to a member's id, which Slack posts in the app's conversation with
    them; a migration apply's final table to the channel it was asked from."""

    channel: str  # a channel's id, or a member's id for a direct message
    text: str  # mrkdwn: the notification
    blocks: list[dict[str, Any]]
    part: Part
    done: Done
    sent: bool = False
    dead: bool = False

    def pending(self) -> bool:
        return not self.dead and not self.sent

    def urgent(self) -> bool:
        return True

    async def flush_one(self, client: AsyncWebClient) -> None:
        await client.chat_postMessage(channel=self.channel, text=self.text, blocks=self.blocks)
        self.sent = True
        self.done([self.part])

    def give_up(self) -> None:
        self.dead = True
        self.done([self.part])


@dataclass(eq=False)
class BuildThread(_Thread):
    """One template build's parent message and thread (`/deploy template build`): its
    progress lines, and its end (published, or why not and what was removed)."""

    build: Build
    channel: str
    deployer: Deployer
    done: Done
    ts: str | None = None
    shown: str | None = None
    lines: list[Line] = field(default_factory=list)
    headline_for: list[Part] = field(default_factory=list)
    dead: bool = False
    carried: list[str] = field(default_factory=list)
    unkept: str | None = None
    covered: list[Part] = field(default_factory=list)

    @property
    def headline(self) -> str:
        return views.mrkdwn(build_headline(self.build))

    def _blocks(self, headline: str) -> list[dict[str, Any]]:
        return views.build_parent(self.build, headline)

    async def _keep_ref(self, thread_ref: str) -> None:
        await self.deployer.personal.set_build_refs(self.build.id, thread_ref=thread_ref)


@dataclass(eq=False)
class BuildCard(_Card):
    """A template build's approval request with its buttons, then its decision."""

    build: Build
    channel: str
    deployer: Deployer
    done: Done
    ts: str | None = None
    outcome: str | None = None  # mrkdwn: the decision that replaces the buttons
    shown: str | None = None
    waiting: list[Part] = field(default_factory=list)
    dead: bool = False
    unkept: str | None = None

    def _request(self) -> tuple[list[dict[str, Any]], str]:
        blocks = views.build_approval_request(self.build)
        return blocks, views.mrkdwn(build_approval_needed(self.build))

    def _decided(self, outcome: str) -> list[dict[str, Any]]:
        return views.build_approval_decided(self.build, outcome)

    async def _keep_ref(self, card_ref: str) -> None:
        await self.deployer.personal.set_build_refs(self.build.id, approval_ref=card_ref)
