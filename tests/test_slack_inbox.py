"""Commands kept from their acknowledgement until answered (bot/chat/inbox.py): a process
that dies in between leaves them to another, which carries them out once."""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from pathlib import Path

from bot.models import utcnow
from bot.models.notices import Received
from bot.requests.parsed import DeployArgs
from handlers.slack.modals import form_body
from tests.support.deployer import TEST_KEY
from tests.support.slack.bot import ALICE, CHANNEL, Harness, is_reply, slack_bot


def inbox_rows(h: Harness) -> list[tuple[object, ...]]:
    with sqlite3.connect(h.deployer.settings.database) as db:
        return db.execute("SELECT key, holder, done_at FROM inbox ORDER BY received_at").fetchall()


async def leave_behind(h: Harness, key: str, text: str) -> None:
    """What a process killed between its ack and its answer leaves: an undone command
    held by a runner whose lease has lapsed."""
    past = utcnow() - timedelta(minutes=5)
    item = Received(key=key, user=ALICE, channel=CHANNEL, text=text, received_at=past)
    assert await h.deployer.store.inbox.add(item, "runner-that-died", past)


def answers(h: Harness) -> list[str]:
    return [c.text for c in h.fake.called("chat.postEphemeral", user=ALICE)]


async def test_a_command_is_kept_before_its_ack_and_struck_once_answered(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        trigger = h.fake.new_trigger()
        acked = await h.command("web01 10.0.0.50", trigger=trigger)
        assert acked.status == 200
        kept = inbox_rows(h)  # already there when Slack got its answer
        assert [row[0] for row in kept] == [f"command:{trigger}"]
        await h.settle()
        [(_key, holder, done_at)] = inbox_rows(h)
        assert holder is None and done_at is not None
        assert await h.bot.sweep_inbox() == 0  # nothing left for anyone


async def test_a_command_left_by_a_dead_process_is_carried_out(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        await leave_behind(h, "command:T-lost", "web02 10.0.0.51")
        assert await h.bot.sweep_inbox() == 1
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.51"))
        await h.settle()
        jobs = await h.deployer.history()
        assert [j.name for j in jobs] == ["web02"]
        assert any(jobs[0].id in text for text in answers(h))  # the person hears of it
        [(_key, _holder, done_at)] = inbox_rows(h)
        assert done_at is not None
        assert await h.bot.sweep_inbox() == 0  # carried out once


async def test_a_left_command_whose_job_exists_is_not_run_twice(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        trigger = h.fake.new_trigger()
        await h.command("web03 10.0.0.52", trigger=trigger)
        await h.settle()
        # As if the process had made the job and died before answering.
        with sqlite3.connect(h.deployer.settings.database) as db:
            db.execute("UPDATE inbox SET done_at = NULL, holder = 'gone', until = ''")
        assert await h.bot.sweep_inbox() == 1
        await h.settle()
        jobs = await h.deployer.history()
        assert len(jobs) == 1
        assert any(f"I already have this request as job {jobs[0].id}" in t for t in answers(h))


async def test_a_form_left_by_a_dead_process_is_deployed(tmp_path: Path) -> None:
    args = DeployArgs(name="web04", address="10.0.0.53", cores=2, given=("cores",))
    async with slack_bot(tmp_path) as h:
        await leave_behind(h, "view:V-lost", form_body(args, (TEST_KEY,)))
        assert await h.bot.sweep_inbox() == 1
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.53"))
        await h.settle()
        [job] = await h.deployer.history()
        assert (job.name, job.request.cores, job.request.ssh_keys) == ("web04", 2, (TEST_KEY,))
        [(_key, _holder, done_at)] = inbox_rows(h)
        assert done_at is not None


async def test_a_resumed_deploy_says_in_its_thread_that_it_goes_on_once(tmp_path: Path) -> None:
    """The person's ack never reached Slack (it showed them an error) while the job was
    made: the process that carries the command out says so in the job's thread, once,
    even when it too stops before striking the command and a third one resumes it."""
    async with slack_bot(tmp_path) as h:
        await h.command("web05 10.0.0.54", trigger=h.fake.new_trigger())
        await h.settle()
        for _resumer in range(2):
            with sqlite3.connect(h.deployer.settings.database) as db:
                db.execute("UPDATE inbox SET done_at = NULL, holder = 'gone', until = ''")
            assert await h.bot.sweep_inbox() == 1
            await h.settle()
        told = [c for c in h.fake.calls if is_reply("carried out after all")(c)]
        assert len(told) == 1, [c.text for c in told]
        [job] = await h.deployer.history()
        parent = h.fake.messages[(CHANNEL, str(told[0].args["thread_ts"]))]
        assert job.name in str(parent.get("text"))  # in the deploy's own thread
