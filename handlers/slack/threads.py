"""Slack threads: the `Progress` the core reports to, shown as one message per deploy.

Each deploy gets a parent message in the channel where it was asked for ("web01
10.0.0.50 on sim: deploying"), kept current with `chat.update`, and a thread with one
line per step and its duration, ending with `ssh USER@ADDRESS` or with what failed and
what the rollback did. A request that needs approval also gets a card with Approve /
Reject buttons in the approvals channel, replaced by the decision once there is one.

Nothing here calls Slack directly: each thread and card only records what is still to
be said and hands itself to the channel's outbox (handlers/slack/outbox.py), which
paces and coalesces the calls. Where a thread lives is kept on the job (`thread_ref`,
`approval_ref`), so after a restart the bot keeps updating the same messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from slack_sdk.web.async_client import AsyncWebClient

from bot.models import ApprovalState, Job, JobState, RollbackReport
from bot.service import Deployer
from bot.settings import SlackSettings
from handlers import messages
from handlers.slack import views
from handlers.slack.outbox import Outboxes

log = logging.getLogger(__name__)
REPLY_MAX = 3500  # characters per coalesced thread reply


def ref(channel: str, ts: str) -> str:
    return f"{channel}/{ts}"


def parse_ref(text: str | None) -> tuple[str, str] | None:
    if not text or "/" not in text:
        return None
    channel, ts = text.split("/", 1)
    return channel, ts


@dataclass(eq=False)
class JobThread:
    """One deploy's parent message and thread, and what is still to be posted to it."""

    job: Job
    channel: str
    deployer: Deployer
    ts: str | None = None
    step: str | None = None
    shown: str | None = None  # the headline Slack currently shows
    lines: list[str] = field(default_factory=list)
    dead: bool = False

    @property
    def headline(self) -> str:
        """Mrkdwn: the job's name and place come from the request, so they are escaped."""
        return messages.slack_headline(self.job, self.step)

    def pending(self) -> bool:
        return not self.dead and (
            self.ts is None or bool(self.lines) or self.shown != self.headline
        )

    async def flush_one(self, client: AsyncWebClient) -> None:
        headline = self.headline
        blocks = views.parent(self.job, headline)
        if self.ts is None:
            answer = await client.chat_postMessage(
                channel=self.channel, text=headline, blocks=blocks
            )
            self.ts, self.shown = str(answer["ts"]), headline
            await self.deployer.set_refs(self.job.id, thread_ref=ref(self.channel, self.ts))
        elif self.lines:
            batch = _batch(self.lines)
            await client.chat_postMessage(
                channel=self.channel, thread_ts=self.ts, text="\n".join(batch)
            )
            del self.lines[: len(batch)]
        else:
            await client.chat_update(channel=self.channel, ts=self.ts, text=headline, blocks=blocks)
            self.shown = headline

    def give_up(self) -> None:
        self.dead = True


def _batch(lines: list[str]) -> list[str]:
    """As many pending lines as fit in one reply (at least one, cut if it is huge)."""
    batch: list[str] = []
    size = 0
    for line in lines:
        if batch and size + len(line) + 1 > REPLY_MAX:
            break
        batch.append(line if len(line) <= REPLY_MAX else views.fit(line, REPLY_MAX))
        size += len(line) + 1
    return batch


@dataclass(eq=False)
class ApprovalCard:
    """The approval request with its buttons, and the decision that replaces them."""

    job: Job
    channel: str
    deployer: Deployer
    ts: str | None = None
    outcome: str | None = None  # mrkdwn: the decision that replaces the buttons
    shown: str | None = None
    dead: bool = False

    def pending(self) -> bool:
        return not self.dead and (self.ts is None or self.outcome != self.shown)

    async def flush_one(self, client: AsyncWebClient) -> None:
        outcome = self.outcome
        if outcome is None:
            blocks = views.approval_request(self.job)
            text = views.mrkdwn(messages.approval_needed(self.job))
        else:
            blocks = views.approval_decided(self.job, outcome)
            text = outcome
        if self.ts is None:
            answer = await client.chat_postMessage(channel=self.channel, text=text, blocks=blocks)
            self.ts = str(answer["ts"])
            await self.deployer.set_refs(self.job.id, approval_ref=ref(self.channel, self.ts))
        else:
            await client.chat_update(channel=self.channel, ts=self.ts, text=text, blocks=blocks)
        self.shown = outcome

    def give_up(self) -> None:
        self.dead = True


class SlackThreads:
    """The core's `Progress`, shown in Slack. `bind` it to the Deployer before use."""

    def __init__(self, client: AsyncWebClient, settings: SlackSettings) -> None:
        self.settings = settings
        self.outboxes = Outboxes(client, settings.posts_per_second)
        self.threads: dict[str, JobThread] = {}
        self.cards: dict[str, ApprovalCard] = {}
        self._deployer: Deployer | None = None

    def bind(self, deployer: Deployer) -> None:
        self._deployer = deployer

    @property
    def deployer(self) -> Deployer:
        if self._deployer is None:
            raise RuntimeError("SlackThreads.bind(deployer) was not called")
        return self._deployer

    # --- Progress -----------------------------------------------------------------

    async def job_updated(self, job: Job, note: str = "") -> None:
        approval = await self.deployer.store.get_approval(job.id)
        self._say(job, messages.slack_thread_update(job, note, approval))
        if job.state is JobState.AWAITING_APPROVAL:
            self._ask_approvers(job)
            return
        card = self._card(job)
        if card is not None and card.outcome is None:
            pending = approval is None or approval.state is ApprovalState.PENDING
            if job.state is JobState.CANCELLED and pending:
                card.outcome = views.mrkdwn(messages.approval_cancelled(note))
            else:
                card.outcome = messages.approval_outcome(job, approval)
            card.job = job
            self.outboxes.touch(card)

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        thread = self._thread(job)
        if thread is not None:
            thread.step = step  # shown in the parent's headline, not as a reply
            self.outboxes.touch(thread)

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        self._say(job, messages.slack_step(step, duration_s, ok, detail))

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        thread = self._thread(job)
        if thread is not None:
            thread.step = None
        self._say(job, messages.slack_finished(job, rollback))

    async def job_note(self, job: Job, text: str) -> None:
        self._say(job, text)

    # --- machinery ----------------------------------------------------------------

    def _say(self, job: Job, text: str) -> None:
        """Add a plain-text line (it may quote a reason or a backend's error) to the thread."""
        thread = self._thread(job)
        if thread is not None:
            thread.lines.append(views.mrkdwn(text))
            self.outboxes.touch(thread)

    def _thread(self, job: Job) -> JobThread | None:
        """This job's thread: known, found again from the job's refs, or new."""
        thread = self.threads.get(job.id)
        if thread is None:
            known = parse_ref(job.thread_ref)
            if known is not None:
                thread = JobThread(job, known[0], self.deployer, ts=known[1])
            elif job.origin:
                thread = JobThread(job, job.origin, self.deployer)
            else:
                return None  # asked for elsewhere (the shell, the CLI): no Slack thread
            self.threads[job.id] = thread
        thread.job = job
        return thread

    def _ask_approvers(self, job: Job) -> None:
        if job.id in self.cards or job.approval_ref:
            return
        channel = self.settings.approvals_channel or job.origin
        if channel is None:
            return
        card = self.cards[job.id] = ApprovalCard(job, channel, self.deployer)
        self.outboxes.touch(card)

    def _card(self, job: Job) -> ApprovalCard | None:
        card = self.cards.get(job.id)
        if card is None:
            known = parse_ref(job.approval_ref)
            if known is None:
                return None
            card = self.cards[job.id] = ApprovalCard(job, known[0], self.deployer, ts=known[1])
        return card

    async def idle(self) -> None:
        await self.outboxes.idle()

    async def close(self, grace_s: float = 5.0) -> None:
        await self.outboxes.close(grace_s)
