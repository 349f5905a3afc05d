"""Slack delivery: what the store's outbox says must be told, told in Slack.

The core writes a notice (bot.models.Notice) in the same transaction as each change a
person follows in chat (store/outbox.py). `SlackThreads` runs in every process with the
Slack front end: it claims the jobs whose notices nobody is delivering (a delivery claim per job,
so one process writes a thread at a time and in order), turns each notice into the
parts of messages it changes (handlers/slack/items.py), lets the per-channel outboxes
pace and coalesce the calls (handlers/slack/outbox.py), records each part in the store
as Slack takes it, and marks a notice delivered once every part of it is in Slack. A
process that dies leaves its notices undelivered; once its delivery claims lapse another process
(or its restart) claims them, rebuilds each thread from the job's stored references,
and says the parts not yet said.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from slack_sdk.web.async_client import AsyncWebClient

from bot.app.service import Deployer
from bot.config.sections import SlackSettings
from bot.jobs.waiting import woken
from bot.kinds import Rows
from bot.leases.terms import show_length
from bot.models import ApprovalState, Job, JobState, utcnow
from bot.models.notices import Notice, NoticeKind
from handlers.messages.core import slack_outcome_dm
from handlers.messages.destroys import destroy_decision
from handlers.messages.lifecycle import lease_reminder, lease_thread
from handlers.messages.slack import (
    approval_cancelled,
    approval_outcome,
    slack_finished,
    slack_step,
    slack_thread_update,
)
from handlers.slack import views
from handlers.slack.buildthreads import BuildDelivery
from handlers.slack.delivery import Parts
from handlers.slack.items import (
    ApprovalCard,
    DirectMessages,
    JobThread,
    Line,
    OneMessage,
    carries_outcome,
    parse_ref,
)
from handlers.slack.outbox import Outboxes
from handlers.slack.zones import Zones

log = logging.getLogger(__name__)
# What delivers the notices of one kind's record (see `_delivery`).
ApplyAll = Callable[[str, list[Notice]], Awaitable[int]]
Release = Callable[[str], Awaitable[bool]]
DELIVERY_CLAIM_S = 30.0  # another process takes a job's thread over after this
POLL_S = 0.2  # how often to look for notices written by other processes
ORPHAN_SCAN_S = 5.0  # how often to look for notices a dead process left
BATCH = 500


class SlackThreads:
    """The Slack side of the outbox. `bind` it to the Deployer; it starts delivering.

    It holds the count of parts each notice waits for (`Parts`, handlers/slack/delivery.py)
    and, once bound, the delivery of template builds' notices (`BuildDelivery`,
    handlers/slack/buildthreads.py); deploys' and destroys' it delivers itself."""

    def __init__(self, client: AsyncWebClient, settings: SlackSettings) -> None:
        self.settings = settings
        self.outboxes = Outboxes(client, settings.posts_per_second)
        self.zones = Zones(client)  # people's time zones, for lease times
        self.threads: dict[str, JobThread] = {}
        self.cards: dict[str, ApprovalCard] = {}
        self.destroy_cards: dict[str, ApprovalCard] = {}
        self.dms: dict[str, DirectMessages] = {}
        self._wake = asyncio.Event()
        self.parts = Parts(self._wake.set)
        self._deployer: Deployer | None = None
        self._builds: BuildDelivery | None = None
        self._held: set[str] = set()  # jobs whose delivery claim this process holds
        # What record each held id's notices follow: its kind's rows (bot/kinds/), looked
        # up once: a job's kind never changes.
        self._rows: dict[str, Rows] = {}
        self._cursor = 0
        self._orphans_at: datetime | None = None
        self._task: asyncio.Task[None] | None = None
        self._deliveries: dict[Rows, tuple[ApplyAll, Release]] = {}  # set by bind
        self._poll_lock = asyncio.Lock()

    def bind(self, deployer: Deployer) -> None:
        self._deployer = deployer
        self._builds = BuildDelivery(
            deployer, self.parts, self.outboxes, self._dm, self.settings.approvals_channel
        )
        self._deliveries = {
            "jobs": (self._apply_all, self._release),
            "builds": (self._builds.apply_all, self._builds.release),
        }
        deployer.chat_outbox.wake_on_notice(self._wake.set)
        self._task = asyncio.create_task(self._run(), name="slack-delivery")

    @property
    def deployer(self) -> Deployer:
        if self._deployer is None:
            raise RuntimeError("SlackThreads.bind(deployer) was not called")
        return self._deployer

    @property
    def builds(self) -> BuildDelivery:
        if self._builds is None:
            raise RuntimeError("SlackThreads.bind(deployer) was not called")
        return self._builds

    @property
    def me(self) -> str:
        return self.deployer.runner.id

    def _dm(self, user: str) -> DirectMessages:
        dm = self.dms.get(user)
        if dm is None:
            dm = self.dms[user] = DirectMessages(user, self.parts.done)
        return dm

    # --- the delivery loop -------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await woken(self._wake, POLL_S)
            self._wake.clear()
            try:
                await self.poll()
            except Exception:
                log.exception("Slack delivery: reading the outbox failed; trying again")

    async def poll(self) -> int:
        """Claim and apply what is new in the outbox; how many notices were applied."""
        async with self._poll_lock:
            outbox, now = self.deployer.chat_outbox, utcnow()
            until = now + timedelta(seconds=DELIVERY_CLAIM_S)
            # Claims first: after an outage they are renewed before anything else, so a
            # replica's orphan scan does not take them while parts wait to be recorded.
            self._lost(self._held - await outbox.renew(self.me, until))
            await self._mark()
            fresh = await outbox.new_since(self._cursor, BATCH)
            if fresh:
                self._cursor = max(n.id or 0 for n in fresh)
            jobs = {n.job_id for n in fresh}
            if self._orphans_at is None or now >= self._orphans_at:
                self._orphans_at = now + timedelta(seconds=ORPHAN_SCAN_S)
                jobs.update(await outbox.orphaned(now, BATCH))
            new = [j for j in jobs if j not in self._held]
            self._held |= await outbox.claim(new, self.me, now, until)
            applied = 0
            for job_id in sorted(jobs & self._held):
                if job_id in new:  # newly ours: all it has not said, from the first
                    notices = await outbox.undelivered(job_id)
                else:
                    notices = [n for n in fresh if n.job_id == job_id]
                applied += await self._apply_job(job_id, notices)
            return applied

    def _lost(self, job_ids: set[str]) -> None:
        """Claims that lapsed (the database was away longer than a claim) and that another
        deliverer took: theirs now. What this process still had to say of those jobs is
        dropped (its threads, cards and direct-message lines), not said; what Slack has
        already is still recorded."""
        for job_id in job_ids:
            log.warning("Slack delivery: job %s is delivered by another process now", job_id)
            self._held.discard(job_id)
            self._rows.pop(job_id, None)
            for item in (
                self.threads.pop(job_id, None),
                self.cards.pop(job_id, None),
                self.destroy_cards.pop(job_id, None),
            ):
                if item is not None:
                    item.abandon()
            self.builds.forget(job_id)
            notices = self.parts.forget(job_id)
            for dm in self.dms.values():
                dm.drop(notices)

    async def _apply_job(self, job_id: str, notices: list[Notice]) -> int:
        todo = [n for n in notices if n.id is not None and not self.parts.applying(n.id)]
        if not todo:
            return 0
        apply_all, _release = await self._delivery(job_id)
        return await apply_all(job_id, todo)

    async def _delivery(self, job_id: str) -> tuple[ApplyAll, Release]:
        """Who delivers this id's notices, by the record its kind keeps (bot/kinds/): a
        `Job`'s here, a template build's in `BuildDelivery`."""
        return self._deliveries[await self._rows_of(job_id)]

    async def _apply_all(self, job_id: str, todo: list[Notice]) -> int:
        job = await self.deployer.queries.job(job_id)
        if job is None:  # gone or quarantined: nothing can be shown
            self.parts.finish([n.id for n in todo if n.id is not None])
            return len(todo)
        for notice in todo:
            await self._apply(job, notice)
        return len(todo)

    async def _mark(self) -> None:
        """Record the parts now in Slack and mark the notices whose every part is;
        release finished jobs."""
        if self.parts.nothing_to_record():
            return
        ids, parts = self.parts.to_record()
        try:
            await self.deployer.chat_outbox.mark_delivered(ids, utcnow(), parts)
        except BaseException as error:  # the store is away (or we are stopping): keep them
            self.parts.not_recorded()
            log.warning(
                "Slack delivery: %d part(s) of notices in Slack are not recorded yet (%s);"
                " kept to record at the next look",
                len(parts) + len(ids),
                type(error).__name__,
            )
            raise
        self.parts.recorded()
        for job_id in list(self._held):
            _apply_all, release = await self._delivery(job_id)
            if await release(job_id):
                self._held.discard(job_id)
                self._rows.pop(job_id, None)

    async def _release(self, job_id: str) -> bool:
        """A job's delivery claim goes once it ended and all of it is in Slack and
        recorded: True when it went. Runs under the poll lock: no notice of the job is
        applied between the check and the release."""
        job = await self.deployer.queries.job(job_id)
        if job is not None and not job.state.final:
            return False
        if self._busy(job_id) or not self.parts.quiet(job_id):
            return False
        await self.deployer.chat_outbox.release(job_id, self.me, utcnow())
        self.threads.pop(job_id, None)
        self.cards.pop(job_id, None)
        self.destroy_cards.pop(job_id, None)
        return True

    async def _rows_of(self, job_id: str) -> Rows:
        """Which record this id's notices follow: its kind's rows (a `Job` or a `Build`)."""
        rows = self._rows.get(job_id)
        if rows is None:
            rows = self._rows[job_id] = (await self.deployer.kind_of(job_id)).rows
        return rows

    def _busy(self, job_id: str) -> bool:
        thread, card = self.threads.get(job_id), self.cards.get(job_id)
        doomed = self.destroy_cards.get(job_id)
        return any(part is not None and part.pending() for part in (thread, card, doomed))

    # --- from notices to parts ----------------------------------------------------

    async def _apply(self, job: Job, notice: Notice) -> None:
        nid = self.parts.hold(notice)
        match notice.kind:
            case NoticeKind.UPDATED:
                await self._updated(job, notice, nid)
            case NoticeKind.STEP_STARTED:
                thread = self._thread(job)
                if thread is not None:
                    thread.step = notice.step  # shown in the headline, not as a reply
                    self._headline(thread, nid)
            case NoticeKind.STEP_FINISHED:
                text = slack_step(
                    notice.step or "", notice.duration_s or 0.0, bool(notice.ok), notice.text
                )
                self._say(job, views.mrkdwn(text), nid)
            case NoticeKind.NOTE:
                self._say(job, views.mrkdwn(notice.text), nid)
            case NoticeKind.FINISHED:
                self._finished(job, notice, nid)
            case NoticeKind.LEASE:
                await self._lease(job, notice, nid)
        self.parts.release(nid)

    async def _updated(self, job: Job, notice: Notice, nid: int) -> None:
        """The thread says the state the change made ("queued"), even when the job has
        moved on by the time it is told; the headline and card show the job as it is."""
        approval = await self.deployer.queries.approval(job.id)
        then = job.model_copy(update={"state": notice.state}) if notice.state else job
        note, by = notice.text, notice.by  # `by`: the one id in the note made a mention
        self._say(job, views.mrkdwn(slack_thread_update(then, note, approval, by)), nid)
        thread = self._thread(job)
        if thread is not None:
            self._headline(thread, nid)
        if job.destroy_by is not None:  # a destroy: its own card (the deploy's was decided)
            self._destroy_card(job, then.state, note, by, nid)
            return
        if job.state is JobState.AWAITING_APPROVAL:
            self._ask_approvers(job, nid)
            return
        card = self._card(job)
        if card is not None and card.outcome is None:
            pending = approval is None or approval.state is ApprovalState.PENDING
            if job.state is JobState.CANCELLED and pending:
                card.outcome = views.mrkdwn(approval_cancelled(note, by))
            else:
                card.outcome = approval_outcome(job, approval)
            card.job = job
            self._show_card(card, nid)

    def _finished(self, job: Job, notice: Notice, nid: int) -> None:
        thread = self._thread(job)
        if thread is None:
            return
        thread.step = None
        self._headline(thread, nid)
        text = slack_finished(job, notice.rollback)
        line = self.parts.part(nid, "line")
        if line is not None:
            thread.lines.append(Line(views.mrkdwn(text), line, urgent=True))
            self.outboxes.touch(thread)
        # The requester hears the outcome in their own conversation with the bot too.
        dm = self.parts.part(nid, "dm")
        if dm is not None:
            self._dm(job.requester).lines.append(Line(views.mrkdwn(slack_outcome_dm(job)), dm))
            self.outboxes.touch(self._dm(job.requester))

    async def _lease(self, job: Job, notice: Notice, nid: int) -> None:
        """A lease step (bot/leases/enforce.py), its times in the requester's zone: a reminder by
        direct message with Extend / Destroy now; the others in the thread, and the
        end by direct message too."""
        zone = await self.zones.of(job.requester)
        policy = self.deployer.settings.leases
        step, when = notice.step or "", notice.when
        if step == "remind" and when is not None:
            grace = show_length(policy.grace)
            text = views.mrkdwn(lease_reminder(job, when, notice.at, grace, zone))
            blocks = views.lease_reminder(job, text, show_length(policy.step))
            part = self.parts.part(nid, "dm")
            if part is not None:
                self.outboxes.touch(OneMessage(job.requester, text, blocks, part, self.parts.done))
            return
        text = views.mrkdwn(lease_thread(job, step, when, notice.text, zone))
        self._say(job, text, nid)
        thread = self._thread(job)
        if thread is not None:
            self._headline(thread, nid)
        part = self.parts.part(nid, "dm") if step == "expired" else None
        if part is not None:
            self._dm(job.requester).lines.append(Line(text, part))
            self.outboxes.touch(self._dm(job.requester))

    def _headline(self, thread: JobThread, nid: int) -> None:
        part = self.parts.part(nid, "headline")
        if part is not None:
            thread.show_headline(part)
            self.outboxes.touch(thread)

    def _say(self, job: Job, text: str, nid: int) -> None:
        """Add a mrkdwn line to the job's thread."""
        thread = self._thread(job)
        part = self.parts.part(nid, "line") if thread is not None else None
        if thread is not None and part is not None:
            thread.lines.append(Line(text, part))
            self.outboxes.touch(thread)

    def _show_card(self, card: ApprovalCard, nid: int) -> None:
        part = self.parts.part(nid, "card")
        if part is not None:
            card.will_show(part)
            self.outboxes.touch(card)

    def _thread(self, job: Job) -> JobThread | None:
        """This job's thread: known, found again from the job's refs, or new."""
        thread = self.threads.get(job.id)
        if thread is None:
            known = parse_ref(job.thread_ref)
            if known is not None:
                thread = JobThread(job, known[0], self.deployer, self.parts.done, ts=known[1])
                if job.state.final and carries_outcome(job.thread_ref):
                    # Its parent shows the outcome: an edit must keep showing it.
                    thread.carried = [views.mrkdwn(slack_finished(job, None))]
            elif job.origin:
                thread = JobThread(job, job.origin, self.deployer, self.parts.done)
            else:
                return None  # asked for elsewhere (the shell, the CLI): no Slack thread
            self.threads[job.id] = thread
        thread.job = job
        return thread

    def _ask_approvers(self, job: Job, nid: int) -> None:
        if job.id in self.cards or job.approval_ref:
            return
        channel = self.settings.approvals_channel or job.origin
        if channel is None:
            return
        card = self.cards[job.id] = ApprovalCard(job, channel, self.deployer, self.parts.done)
        self._show_card(card, nid)

    def _destroy_card(self, job: Job, state: JobState, note: str, by: str | None, nid: int) -> None:
        """Ask the approvers for a destroy, or show their decision on the card."""
        card = self.destroy_cards.get(job.id)
        if state is JobState.DESTROY_REQUESTED:
            if (card is None or card.outcome is not None) and not job.destroy_ref:
                channel = self.settings.approvals_channel or job.origin
                if channel is None:
                    return
                card = ApprovalCard(job, channel, self.deployer, self.parts.done, destroy=True)
                self.destroy_cards[job.id] = card
                self._show_card(card, nid)
            return
        if card is None:
            known = parse_ref(job.destroy_ref)
            if known is None:
                return  # no card: the destroy needed no approval
            card = ApprovalCard(
                job, known[0], self.deployer, self.parts.done, ts=known[1], destroy=True
            )
            self.destroy_cards[job.id] = card
        if card.outcome is not None:
            return
        card.outcome = views.mrkdwn(destroy_decision(note, by))
        card.job = job
        self._show_card(card, nid)

    def _card(self, job: Job) -> ApprovalCard | None:
        card = self.cards.get(job.id)
        if card is None:
            known = parse_ref(job.approval_ref)
            if known is None:
                return None
            card = ApprovalCard(job, known[0], self.deployer, self.parts.done, ts=known[1])
            self.cards[job.id] = card
        return card

    # --- waiting and closing ---------------------------------------------------------

    async def idle(self) -> None:
        """Wait until every notice this process can deliver is in Slack and marked."""
        while True:
            applied = await self.poll()
            await self.outboxes.idle()
            async with self._poll_lock:
                await self._mark()
            if not applied and self.parts.settled():
                return

    async def close(self, grace_s: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.outboxes.close(grace_s)
        if self._deployer is not None:
            with contextlib.suppress(Exception):
                async with self._poll_lock:
                    await self._mark()
