"""Destroy and list in Slack, against the fake Web API: the button on the thread, the
approval card, refusals, the destroy told in the deploy's own thread, and list pages."""

from __future__ import annotations

import json
from pathlib import Path

from backends.sim import SimBackend
from bot.models import JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import (
    ALICE,
    APPROVALS,
    BOB,
    CAROL,
    CHANNEL,
    MALLORY,
    Harness,
    is_reply,
    slack_bot,
)
from tests.support.slack.fake_api import Call

POLICY = {"approvers": [BOB, CAROL], "destroy": "always", "expire_after_s": 600}


def told(h: Harness, user: str) -> list[str]:
    return [c.text for c in h.fake.called("chat.postEphemeral", user=user)]


def parent_with_button(h: Harness) -> Call:
    """The last version of the thread's parent that carries the Destroy button."""
    found = [
        c
        for c in h.fake.calls
        if c.method in ("chat.postMessage", "chat.update")
        and c.channel == CHANNEL
        and "thread_ts" not in c.args
        and '"destroy"' in json.dumps(c.args.get("blocks"))
    ]
    assert found, "the ready parent message has a Destroy button"
    return found[-1]


async def deploy(h: Harness, user: str = ALICE, text: str = "web01 10.0.0.50") -> str:
    await h.command(text, user)
    await h.fake.wait_for(is_reply("ssh ubuntu@"))
    await h.settle()
    job = (await h.deployer.history(1))[0]
    assert job.state is JobState.SUCCEEDED
    return job.id


def thread_of(h: Harness, job_ts: str) -> list[str]:
    return [
        c.text
        for c in h.fake.called("chat.postMessage", channel=CHANNEL)
        if c.args.get("thread_ts") == job_ts
    ]


async def test_destroy_with_approval_posted_in_the_original_thread(tmp_path: Path) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, approval=POLICY, backend=sim) as h:
        job_id = await deploy(h, BOB)
        vm_id = (await h.deployer.status(job_id)).job.vm_id
        parent = parent_with_button(h)
        button = json.dumps(parent.args["blocks"])
        assert "confirm" in button and "will be stopped and removed for good" in button
        await h.click(parent, "destroy", BOB)
        card = await h.fake.wait_for(
            lambda c: c.method == "chat.postMessage" and c.channel == APPROVALS
        )
        await h.settle()
        assert "asks to destroy web01 10.0.0.50" in json.dumps(card.args["blocks"])
        assert any("destroying web01 needs approval" in t for t in told(h, BOB))
        await h.click(card, "approve", BOB)  # no self-approval
        await h.click(card, "approve", MALLORY)
        await h.settle()
        assert any("the destroy you asked for" in t for t in told(h, BOB))
        assert any("may not approve destroys" in t for t in told(h, MALLORY))
        assert vm_id in sim.vms and sim.vms[vm_id].running
        await h.click(card, "approve", CAROL)
        await h.fake.wait_for(is_reply("destroyed (asked by"))
        await h.settle()
        assert vm_id not in sim.vms
        done = (await h.deployer.status(job_id)).job
        assert done.state is JobState.DESTROYED and done.destroy_approver == CAROL
        ts = parent.answer["ts"]
        thread = "\n".join(thread_of(h, ts))
        assert "stop the VM" in thread and "destroy the VM" in thread
        assert thread.count("destroyed (asked by") == 1
        assert f"destroy approved by <@{CAROL}>" in thread
        decided = h.fake.called("chat.update", channel=APPROVALS, ts=card.answer["ts"])
        assert f"Destroy approved by <@{CAROL}>" in decided[-1].text
        assert "actions" not in json.dumps(decided[-1].args["blocks"])
        headline = h.fake.called("chat.update", channel=CHANNEL, ts=ts)[-1]
        assert "destroyed" in headline.text and '"destroy"' not in json.dumps(headline.args)
        assert any(
            "was destroyed" in c.text for c in h.fake.called("chat.postMessage", channel=BOB)
        )


async def test_strangers_are_refused_and_nothing_changes(tmp_path: Path) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, backend=sim) as h:
        job_id = await deploy(h)
        await h.click(parent_with_button(h), "destroy", MALLORY)
        await h.command("destroy web01", MALLORY)
        usage = await h.command("destroy web99 <!channel>", ALICE)  # answered in the ack
        await h.command("destroy nosuch<!channel>", ALICE)
        await h.settle()
        refusals = told(h, MALLORY)
        assert len(refusals) == 2
        assert all(f"Only <@{ALICE}> (who deployed it)" in t for t in refusals)
        assert "Name one VM to destroy" in usage.body and "<!channel>" not in usage.body
        assert any("holds no VM called nosuch&lt;!channel&gt;" in t for t in told(h, ALICE))
        job = (await h.deployer.status(job_id)).job
        assert job.state is JobState.SUCCEEDED and sim.vms[job.vm_id or ""].running
        # The requester destroys it with the command; no approval is needed by default.
        await h.command("destroy web01", ALICE)
        await h.fake.wait_for(is_reply("destroyed (asked by"))
        await h.settle()
        assert (await h.deployer.status(job_id)).job.state is JobState.DESTROYED


def args(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


def rows(call: Call) -> list[str]:
    return [
        b["text"]["text"]
        for b in call.args["blocks"]
        if b["type"] == "section" and "lease end" in b["text"]["text"]
    ]


async def test_list_pages_with_buttons(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        for number in range(12):
            await h.deployer.request_deploy(args(f"web{number:02d} 10.0.0.{60 + number}"), ALICE)
        await h.deployer.request_deploy(args("db01 10.0.0.90"), BOB)
        await h.deployer.drain()
        await h.command("list", ALICE)
        await h.settle()
        (first,) = h.fake.called("chat.postEphemeral", user=ALICE)
        assert first.text == "Your VMs: 12 (page 1 of 2)"
        assert len(first.args["blocks"]) <= 50
        shown = rows(first)
        assert len(shown) == 10 and shown[0].startswith("*web11* `10.0.0.71` on sim")
        assert "lease end " in shown[0] and " UTC · ready" in shown[0]  # 14 days by default
        assert f"<@{ALICE}>" in shown[0]
        assert (
            sum(b.get("accessory", {}).get("action_id") == "destroy" for b in first.args["blocks"])
            == 10
        )
        await h.click(first, "list_page_next", ALICE)
        await h.settle()
        second = h.fake.called("chat.postEphemeral", user=ALICE)[-1]
        assert second.text == "Your VMs: 12 (page 2 of 2)"
        assert [r.split("*")[1] for r in rows(second)] == ["web01", "web00"]
        assert "list_page_previous" in json.dumps(second.args["blocks"])
        assert "list_page_next" not in json.dumps(second.args["blocks"])
        await h.command(f"list <@{BOB}|bob>", ALICE)
        await h.command("list all page=2", ALICE)
        bad = await h.command("list everything", ALICE)  # a usage error: in the ack
        await h.settle()
        bobs, everyone = h.fake.called("chat.postEphemeral", user=ALICE)[-2:]
        assert bobs.text == f"VMs of <@{BOB}>: 1 (page 1 of 1)" and "db01" in rows(bobs)[0]
        assert everyone.text == "Everyone's VMs: 13 (page 2 of 2)" and len(rows(everyone)) == 3
        assert "list mine, all or @someone" in bad.body
        # A row's Destroy button destroys that VM.
        await h.click(second, "destroy", ALICE)
        await h.settle()
        await h.deployer.drain()
        assert any("Job " in t and "destroying web01" in t for t in told(h, ALICE))


async def test_a_rejected_destroy_says_why_and_keeps_the_vm(tmp_path: Path) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, approval=POLICY, backend=sim) as h:
        job_id = await deploy(h)
        await h.command("destroy web01", ALICE)
        card = await h.fake.wait_for(
            lambda c: c.method == "chat.postMessage" and c.channel == APPROVALS
        )
        await h.settle()
        await h.click(card, "reject", CAROL)
        opened = await h.fake.wait_for(lambda c: c.method == "views.open" and c.status == 200)
        view_id = opened.answer["view"]["id"]
        reason = {"reason": {"reason": {"type": "plain_text_input", "value": "in use <!here>"}}}
        assert (await h.submit(view_id, reason, CAROL)).status == 200
        await h.fake.wait_for(is_reply("destroy rejected by"))
        await h.settle()
        decided = h.fake.called("chat.update", channel=APPROVALS, ts=card.answer["ts"])
        assert (
            decided[-1].text
            == f":no_entry_sign: Destroy rejected by <@{CAROL}>: in use &lt;!here&gt;."
        )
        job = (await h.deployer.status(job_id)).job
        assert job.state is JobState.SUCCEEDED and sim.vms[job.vm_id or ""].running
        parent = parent_with_button(h)  # ready again, with its Destroy button
        assert "ready" in parent.text
        # Asked again, approved this time: a new card, the old one stays decided.
        await h.click(parent, "destroy", ALICE)
        await h.fake.wait_for(
            lambda c: c.method == "chat.postMessage" and c.channel == APPROVALS and c is not card
        )
        await h.settle()
        cards = h.fake.called("chat.postMessage", channel=APPROVALS)
        assert len(cards) == 2
        await h.click(cards[-1], "approve", BOB)
        await h.fake.wait_for(is_reply("destroyed (asked by"))
        await h.settle()
        assert (await h.deployer.status(job_id)).job.state is JobState.DESTROYED
