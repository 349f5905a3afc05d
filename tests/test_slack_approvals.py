"""Approve / Reject buttons: the server decides, once, and the card and thread say so."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from bot.models import ApprovalState, JobState, utcnow
from tests.support.slack.bot import (
    ALICE,
    APPROVALS,
    BOB,
    CAROL,
    DAVE,
    MALLORY,
    OPS_GROUP,
    Harness,
    is_reply,
    new_fake,
    slack_bot,
)
from tests.support.slack.fake_api import Call

POLICY = {"approvers": [BOB, CAROL], "always": True, "expire_after_s": 600}


def is_card(c: Call) -> bool:
    return c.method == "chat.postMessage" and c.channel == APPROVALS


def told(h: Harness, user: str) -> list[str]:
    return [c.text for c in h.fake.called("chat.postEphemeral", user=user)]


async def request(h: Harness, text: str = "web01 10.0.0.50") -> tuple[str, Call]:
    await h.command(text)
    card = await h.fake.wait_for(is_card)
    await h.settle()
    job = (await h.deployer.history(1))[0]
    assert job.state is JobState.AWAITING_APPROVAL
    return job.id, card


def card_updates(h: Harness, card: Call) -> list[dict[str, Any]]:
    return [c.args for c in h.fake.called("chat.update", channel=APPROVALS, ts=card.answer["ts"])]


async def test_self_approval_and_strangers_are_refused_then_an_approver_approves(
    tmp_path: Path,
) -> None:
    policy = {**POLICY, "approvers": [ALICE, BOB, CAROL]}
    async with slack_bot(tmp_path, approval=policy) as h:
        job_id, card = await request(h)
        blob = json.dumps(card.args["blocks"])
        assert "Approve" in blob and "Reject" in blob and "every deploy needs approval" in blob
        await h.click(card, "approve", ALICE)
        await h.click(card, "approve", MALLORY)
        await h.settle()
        assert any("cannot approve or reject your own request" in t for t in told(h, ALICE))
        assert any("may not approve deploys" in t for t in told(h, MALLORY))
        assert (await h.deployer.status(job_id)).job.state is JobState.AWAITING_APPROVAL
        assert card_updates(h, card) == []

        await h.click(card, "approve", BOB)
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        (update,) = card_updates(h, card)
        assert f"Approved by <@{BOB}> at <!date^" in update["text"]
        assert "actions" not in json.dumps(update["blocks"])  # the buttons are gone
        assert any(f"approved by <@{BOB}>; queued." in c.text for c in h.fake.calls)
        refusals = await h.deployer.store.audit.events()
        assert {(a.actor, a.outcome) for a in refusals} == {
            (ALICE, "refused"),
            (MALLORY, "refused"),
        }


async def test_a_double_click_and_two_approvers_at_once_decide_once(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await request(h)
        await asyncio.gather(
            h.click(card, "approve", BOB),
            h.click(card, "approve", BOB),
            h.click(card, "approve", CAROL),
        )
        await h.settle()
        await h.deployer.drain()
        info = await h.deployer.status(job_id)
        assert info.approval is not None and info.approval.state is ApprovalState.APPROVED
        losers = told(h, BOB) + told(h, CAROL)
        assert len(losers) == 2 and all("not awaiting approval any more" in t for t in losers)
        assert len(card_updates(h, card)) == 1
        assert len(await h.deployer.history()) == 1


async def test_a_redelivered_click_is_handled_once_and_quietly(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await request(h)
        stamp = h.action_ts()
        await h.click(card, "approve", BOB, action_ts=stamp)
        await h.settle()
        await h.click(card, "approve", BOB, action_ts=stamp)
        await h.settle()
        assert told(h, BOB) == []  # the retry changes nothing and says nothing
        audit = await h.deployer.store.audit.events()
        assert [(a.actor, a.outcome) for a in audit] == [(BOB, "duplicate")]
        assert (await h.deployer.status(job_id)).approval.decided_by == BOB  # type: ignore[union-attr]


async def test_reject_asks_for_a_reason_and_tells_the_requester(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await request(h)
        await h.click(card, "reject", ALICE)  # the requester gets no modal
        await h.settle()
        assert h.fake.called("views.open") == []
        await h.click(card, "reject", CAROL)
        opened = await h.fake.wait_for(lambda c: c.method == "views.open" and c.status == 200)
        view_id = opened.answer["view"]["id"]
        empty = await h.submit(view_id, {"reason": {"reason": {"type": "plain_text_input"}}}, CAROL)
        assert json.loads(empty.body)["response_action"] == "errors"
        assert "reason" in json.loads(empty.body)["errors"]
        reason = {"reason": {"reason": {"type": "plain_text_input", "value": "use staging"}}}
        assert (await h.submit(view_id, reason, CAROL)).status == 200
        await h.fake.wait_for(is_reply("rejected: use staging"))
        await h.settle()
        (update,) = card_updates(h, card)
        assert update["text"] == f":x: Rejected by <@{CAROL}>: use staging"
        parent = h.fake.called("chat.update", channel=card.channel)
        assert (await h.deployer.status(job_id)).job.state is JobState.REJECTED
        assert parent


async def test_expired_requests_say_so_and_refuse_clicks(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await request(h)
        expired = await h.deployer.expire_approvals(utcnow() + timedelta(hours=1))
        assert [j.id for j in expired] == [job_id]
        await h.fake.wait_for(is_reply("nobody approved it in time"))
        await h.settle()
        (update,) = card_updates(h, card)
        assert "Expired at" in update["text"]
        await h.click(card, "approve", BOB)
        await h.settle()
        assert any("expired" in t and "nobody approved it in time" in t for t in told(h, BOB))


async def test_a_pending_request_past_its_time_expires_on_the_click(tmp_path: Path) -> None:
    policy = {**POLICY, "expire_after_s": 0.001}
    async with slack_bot(tmp_path, approval=policy) as h:
        job_id, card = await request(h)
        await h.click(card, "approve", BOB)
        await h.settle()
        assert any("nobody approved it in time" in t for t in told(h, BOB))
        assert (await h.deployer.status(job_id)).job.state is JobState.EXPIRED


async def test_a_member_of_the_approver_group_approves(tmp_path: Path) -> None:
    policy = {"approver_groups": [OPS_GROUP], "always": True}
    async with slack_bot(tmp_path, approval=policy) as h:
        job_id, card = await request(h)
        await h.click(card, "approve", MALLORY)
        await h.click(card, "approve", DAVE)
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        assert any("the members of SOPS00001" in t for t in told(h, MALLORY))
        assert h.fake.called("usergroups.users.list", usergroup=OPS_GROUP)
        info = await h.deployer.status(job_id)
        assert info.approval is not None and info.approval.decided_by == DAVE


async def test_cancel_while_waiting_replaces_the_buttons(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await request(h)
        await h.command(f"cancel {job_id}")
        await h.fake.wait_for(lambda c: c.method == "chat.update" and c.channel == APPROVALS)
        await h.settle()
        (update,) = card_updates(h, card)
        assert update["text"] == f":no_entry_sign: Cancelled by <@{ALICE}> before a decision."


async def test_after_a_restart_the_same_messages_are_updated(tmp_path: Path) -> None:
    fake = await new_fake()  # one Slack, two lives of the bot on one database
    try:
        async with slack_bot(tmp_path, approval=POLICY, fake=fake) as first:
            job_id, card = await request(first)
        parent = next(c for c in fake.called("chat.postMessage") if c.channel != APPROVALS)
        async with slack_bot(tmp_path, approval=POLICY, fake=fake) as second:
            await second.click(card, "approve", BOB)
            await fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
            await second.settle()
            assert len(card_updates(second, card)) == 1
            replies = "\n".join(fake.thread(parent.channel, parent.answer["ts"]))
            assert f"approved by <@{BOB}>" in replies and "ssh ubuntu@10.0.0.50" in replies
            assert (await second.deployer.status(job_id)).job.state is JobState.SUCCEEDED
    finally:
        await fake.close()
