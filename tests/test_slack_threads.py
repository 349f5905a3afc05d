"""Threads under load: 429s in the middle of a deploy, and many deploys in one channel."""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
from pathlib import Path

import pytest

from backends.base import CloneSpec, VMRef
from backends.sim import SimBackend
from bot.models import JobState, utcnow
from bot.models.notices import Notice, NoticeKind
from handlers.slack.delivery import Parts
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import ALICE, CHANNEL, is_reply, slack_bot
from tests.support.slack.fake_api import Call
from tests.support.store import held


def is_parent(c: Call) -> bool:
    """A deploy's parent message (not a reply, not a direct message)."""
    return c.method == "chat.postMessage" and "thread_ts" not in c.args and c.channel == CHANNEL


class SlowClone(SimBackend):
    """The simulator, except that the clone waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__("sim", time_scale=SIM_SCALE)
        self.gate = asyncio.Event()

    async def clone(self, spec: CloneSpec, ref: VMRef) -> str | None:
        await self.gate.wait()
        return await super().clone(spec, ref)


async def test_429s_mid_deploy_are_waited_out_and_nothing_is_lost(tmp_path: Path) -> None:
    sim = SlowClone()
    async with slack_bot(tmp_path, backend=sim) as h:
        await h.command("web01 10.0.0.50")
        parent = await h.fake.wait_for(lambda c: is_parent(c) and c.status == 200)
        await h.fake.wait_for(is_reply("check name and address"))
        # Three refusals: the SDK retries twice after Retry-After, then the channel's
        # outbox waits and tries once more.
        h.fake.rate_limit("chat.postMessage", times=3, retry_after=0)
        sim.gate.set()
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        limited = [c for c in h.fake.calls if c.status == 429]
        assert len(limited) == 3
        thread = "\n".join(h.fake.thread(CHANNEL, parent.answer["ts"]))
        for line in ("queued", "check name and address", "copy template", "check SSH", "ready in"):
            assert line in thread


async def test_fifty_deploys_stay_inside_the_channel_rate(tmp_path: Path) -> None:
    rate = 80.0  # the production pacing, sped up: 1/rate s between calls to a channel
    count = 60
    async with slack_bot(tmp_path, rate=rate) as h:
        await asyncio.gather(*(h.command(f"web{n:02d} 10.0.0.{100 + n}") for n in range(count)))
        await h.bot.settle()
        await h.deployer.drain()
        await h.threads.idle()
        jobs = await h.deployer.history(count)
        assert len(jobs) == count and all(j.state is JobState.SUCCEEDED for j in jobs)
        channel_calls = [
            c for c in h.fake.calls if c.channel == CHANNEL and c.method != "chat.postEphemeral"
        ]
        gaps = [b.at - a.at for a, b in itertools.pairwise(channel_calls)]
        assert min(gaps) >= 1 / rate
        # Each deploy reports about a dozen lines; coalesced, far fewer calls are made.
        assert len(channel_calls) <= 5 * count
        for job in jobs:
            assert job.thread_ref is not None
            ts = job.thread_ref.split("/")[1]
            parent = h.fake.messages[(CHANNEL, ts)]["text"]  # a late parent carries it
            thread = "\n".join([parent, *h.fake.thread(CHANNEL, ts)])
            assert f"ssh ubuntu@{job.address}" in thread


async def test_a_parent_posted_after_the_outcome_carries_it_and_no_steps(tmp_path: Path) -> None:
    """Slack holds the channel back (429) until the deploy is ready and its requester
    told; the parent posted then shows the outcome and the SSH line itself, and the
    progress that waited for it (queued, every step) is dropped, not sent late."""
    async with slack_bot(tmp_path) as h:
        h.fake.blocked.add(CHANNEL)
        h.fake.blocked_retry_after_s = 1  # the SDK retries twice, then the outbox again
        await h.command("web01 10.0.0.50")
        await h.fake.wait_for(lambda c: c.channel == ALICE and "ssh ubuntu@10.0.0.50" in c.text)
        assert not h.fake.called("chat.postMessage", channel=CHANNEL)
        # The outbox's next try is composed now: the parent, with the outcome in it.
        await h.fake.wait_for(lambda c: c.channel == CHANNEL and "ssh ubuntu@" in c.text)
        h.fake.blocked.clear()
        await h.settle()
        (parent,) = [c for c in h.fake.calls if is_parent(c) and c.status == 200]
        for shown in (parent.text, json.dumps(parent.args["blocks"])):
            assert "ssh ubuntu@10.0.0.50" in shown and "ready in" in shown
        ts = parent.answer["ts"]
        assert h.fake.thread(CHANNEL, ts) == []  # no step replies after the fact
        assert "ssh ubuntu@10.0.0.50" in h.fake.messages[(CHANNEL, ts)]["text"]  # kept
        (job,) = await h.deployer.history(1)
        assert await h.deployer.store.outbox.undelivered(job.id) == []
        # Later news of the running VM edits the parent again, from a thread found
        # again in the store (the finished job's was let go): the outcome stays on it.
        edits = len(h.fake.called("chat.update", channel=CHANNEL))
        await h.command("lease extend web01 7d")
        await h.settle()
        assert len(h.fake.called("chat.update", channel=CHANNEL)) > edits
        assert "ssh ubuntu@10.0.0.50" in h.fake.messages[(CHANNEL, ts)]["text"]


async def test_parts_said_while_the_database_is_away_are_recorded_after_not_said_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Slack takes a deploy's outcome (its thread line and its direct message) while
    another process holds the database's write lock longer than `write_retry_s`, so
    recording them fails. They are kept, recorded once the lock goes, and said once:
    before, the failed record forgot them, the notice stayed undelivered, and the next
    deliverer of the job (a replica, once this claim was given up) said them again."""
    async with slack_bot(tmp_path, store={"write_retry_s": 0.3}) as h:
        h.fake.blocked.update({CHANNEL, ALICE})  # Slack holds the messages back ...
        h.fake.blocked_retry_after_s = 1
        await h.command("web01 10.0.0.50")
        await h.bot.settle()
        await h.deployer.drain()
        (job,) = await h.deployer.history(1)
        assert job.state is JobState.SUCCEEDED
        await h.fake.wait_for(lambda c: told(c, ALICE) and c.status == 429)  # tried, held
        await h.fake.wait_for(lambda c: told(c, CHANNEL) and c.status == 429)

        def failed() -> int:
            return sum("reading the outbox failed" in r.getMessage() for r in caplog.records)

        with held(tmp_path / "jobs.db"):
            h.fake.blocked.clear()  # ... and takes them while the database is away
            await h.fake.wait_for(lambda c: told(c, ALICE) and c.status == 200)
            await h.fake.wait_for(lambda c: told(c, CHANNEL) and c.status == 200)
            seen = failed()
            async with asyncio.timeout(30):  # a look at the store failed after the posts
                while failed() == seen:
                    await h.fake.next_call(0.2)
        await h.threads.idle()
        assert await h.deployer.store.outbox.undelivered(job.id) == []
        (job,) = await h.deployer.history(1)
        assert job.thread_ref is not None  # where the thread is, kept for a restart
        assert len([c for c in h.fake.calls if told(c, ALICE) and c.status == 200]) == 1
        assert len([c for c in h.fake.calls if told(c, CHANNEL) and c.status == 200]) == 1


def test_parts_the_store_did_not_take_are_recorded_at_the_next_try() -> None:
    """What Slack took is kept until the store confirms it: a failed record gives it back
    (forgotten, the notice would stay undelivered and whoever delivers the job next would
    say it again), and the job is not quiet (its claim kept) until it is recorded."""
    wakes: list[None] = []
    parts = Parts(lambda: wakes.append(None))
    notice = Notice(id=7, job_id="j1", kind=NoticeKind.FINISHED)
    nid = parts.hold(notice)
    line, dm = parts.part(nid, "line"), parts.part(nid, "dm")
    assert line is not None and dm is not None
    parts.release(nid)
    parts.done([line, dm])  # Slack took both
    assert parts.to_record() == ([7], [(7, "line"), (7, "dm")])
    assert not parts.quiet("j1")  # on its way to the store
    parts.not_recorded()  # the store was away
    assert not parts.quiet("j1") and parts.quiet("j2")
    assert parts.to_record() == ([7], [(7, "line"), (7, "dm")])  # given again
    parts.recorded()
    assert parts.quiet("j1") and parts.nothing_to_record()


async def test_a_claim_stays_while_a_direct_message_waits_for_slack(tmp_path: Path) -> None:
    """The thread has the outcome, the direct message waits (Slack holds it back): the
    job's delivery claim is kept, so no other deliverer takes the job and says it too."""
    async with slack_bot(tmp_path) as h:
        h.fake.blocked.add(ALICE)
        h.fake.blocked_retry_after_s = 5
        await h.command("web01 10.0.0.50")
        await h.bot.settle()
        await h.deployer.drain()
        (job,) = await h.deployer.history(1)
        await h.fake.wait_for(lambda c: told(c, CHANNEL) and c.status == 200)
        await h.fake.wait_for(lambda c: told(c, ALICE) and c.status == 429)
        for _ in range(3):  # the thread's parts recorded, the claim looked at each time
            await h.threads.poll()
        assert job.id not in await h.deployer.store.outbox.orphaned(utcnow(), 10)
        h.fake.blocked.clear()
        await h.threads.idle()
        assert await h.deployer.store.outbox.undelivered(job.id) == []
        assert len([c for c in h.fake.calls if told(c, ALICE) and c.status == 200]) == 1


async def test_a_claim_another_deliverer_took_is_let_go_and_nothing_more_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the database was away the job's claim lapsed and another process took it
    (written here as that process would): this one says nothing more of the job."""
    async with slack_bot(tmp_path) as h:
        h.fake.blocked.update({CHANNEL, ALICE})
        h.fake.blocked_retry_after_s = 2
        await h.command("web01 10.0.0.50")
        await h.bot.settle()
        await h.deployer.drain()
        (job,) = await h.deployer.history(1)
        await h.fake.wait_for(lambda c: told(c, ALICE) and c.status == 429)
        await h.fake.wait_for(lambda c: told(c, CHANNEL) and c.status == 429)
        with sqlite3.connect(tmp_path / "jobs.db") as conn:
            conn.execute(
                "UPDATE outbox_claims SET holder = 'other', until = '2999-01-01' WHERE job_id = ?",
                [job.id],
            )
        await h.threads.poll()
        assert any("delivered by another process" in r.getMessage() for r in caplog.records)
        # Its thread and its direct-message lines are dropped, not said: only a call
        # already on its way (the SDK's retry of a 429) can still reach Slack.
        assert job.id not in h.threads.threads
        assert not any(dm.pending() for dm in h.threads.dms.values())
        assert h.threads.parts.quiet(job.id)


def told(c: Call, channel: str) -> bool:
    """A post of the outcome's SSH line to `channel` (the thread or the direct message)."""
    return c.method == "chat.postMessage" and c.channel == channel and "ssh ubuntu@" in c.text
