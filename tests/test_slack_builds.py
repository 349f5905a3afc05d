"""Template builds from Slack: `/deploy template build`, behind the approval policy
(`[approval] builds`), with its progress in a thread delivered from the store's outbox,
and `/deploy templates` showing what deploybot built. Real parts throughout: the bot on
the simulator (which builds templates), the fake Slack Web API, signed requests."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path

from backends.sim import SimBackend
from bot.models import JobState, utcnow
from bot.models.builds import Build, BuildState
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
    new_fake,
    slack_bot,
)
from tests.support.slack.fake_api import Call

POLICY = {"approvers": [BOB, CAROL], "expire_after_s": 600}


def is_card(c: Call) -> bool:
    return c.method == "chat.postMessage" and c.channel == APPROVALS


def is_parent(c: Call) -> bool:
    return c.method == "chat.postMessage" and c.channel == CHANNEL and "thread_ts" not in c.args


def told(h: Harness, user: str) -> list[str]:
    return [c.text for c in h.fake.called("chat.postEphemeral", user=user)]


def card_updates(h: Harness, card: Call) -> list[Call]:
    return h.fake.called("chat.update", channel=APPROVALS, ts=card.answer["ts"])


def replies(h: Harness, parent: Call) -> str:
    return "\n".join(h.fake.thread(CHANNEL, parent.answer["ts"]))


async def the_build(h: Harness) -> Build:
    (build,) = await h.deployer.store.builds.recent()
    return build


async def ask(h: Harness, text: str = "template build debian-12 name=golden") -> tuple[Build, Call]:
    """ALICE (no approver) asks; the build waits, its card goes to the approvers."""
    await h.command(text)
    card = await h.fake.wait_for(is_card)
    await h.settle()
    build = await the_build(h)
    assert build.state is BuildState.AWAITING_APPROVAL
    return build, card


async def test_a_non_approvers_build_waits_then_an_approver_approves_and_it_is_published(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        build, card = await ask(h)
        assert any("waits for an approver" in t for t in told(h, ALICE))
        assert build.requester == ALICE and build.origin == CHANNEL and build.owner is None
        blob = json.dumps(card.args["blocks"])
        assert "Approve" in blob and "Reject" in blob and "golden-v1" in blob
        assert "template builds change templates everyone deploys from" in blob
        parent = await h.fake.wait_for(is_parent)
        await h.fake.wait_for(is_reply("waiting for approval"))

        await h.click(card, "approve", ALICE)  # the requester, no approver either
        await h.click(card, "approve", MALLORY)  # no approver
        await h.settle()
        assert any("may not approve template builds" in t for t in told(h, ALICE))
        assert any("may not approve template builds" in t for t in told(h, MALLORY))
        assert (await the_build(h)).state is BuildState.AWAITING_APPROVAL
        assert card_updates(h, card) == []

        await h.click(card, "approve", BOB)
        await h.fake.wait_for(is_reply("Published:"), within=60)
        await h.settle()
        await h.deployer.drain()
        await h.threads.idle()
        done = await the_build(h)
        assert done.state is BuildState.PUBLISHED and done.decided_by == BOB, done.error
        thread = replies(h, parent)
        assert f"approved by <@{BOB}>: queued" in thread
        assert "pre-flight passed" in thread and "smoke test passed" in thread
        published = "Published: golden is version 1 (golden-v1). Deploy from it with template=gold"
        assert published in thread
        assert thread.index("smoke test passed") < thread.index("Published:")
        (update,) = card_updates(h, card)
        assert f"Approved by <@{BOB}>" in update.text
        assert "actions" not in json.dumps(update.args["blocks"])  # the buttons are gone
        headline = h.fake.called("chat.update", channel=CHANNEL, ts=parent.answer["ts"])
        assert headline and "published" in headline[-1].text
        dm = h.fake.called("chat.postMessage", channel=ALICE)
        assert dm and "Your template build" in dm[-1].text and "Published:" in dm[-1].text
        # Every notice was delivered.
        assert await h.deployer.store.outbox.undelivered(done.id) == []


async def test_with_builds_always_an_approver_cannot_approve_their_own(tmp_path: Path) -> None:
    policy = {"approvers": [ALICE, BOB, CAROL], "builds": "always"}
    async with slack_bot(tmp_path, approval=policy) as h:
        build, card = await ask(h)
        assert build.approval_reason == "every template build needs approval"
        await h.click(card, "approve", ALICE)
        await h.settle()
        assert any("cannot approve or reject your own build" in t for t in told(h, ALICE))
        assert (await the_build(h)).state is BuildState.AWAITING_APPROVAL
        assert card_updates(h, card) == []


async def test_an_approvers_own_build_runs_at_once(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        await h.command("template build debian-12 name=golden", user=BOB)
        parent = await h.fake.wait_for(is_parent)
        await h.fake.wait_for(is_reply("Published:"), within=60)
        await h.settle()
        assert any("is queued" in t for t in told(h, BOB))
        assert not [c for c in h.fake.calls if is_card(c)]
        assert "queued: build" in replies(h, parent)
        assert (await the_build(h)).state is BuildState.PUBLISHED


async def test_reject_asks_for_a_reason_and_the_thread_ends_with_it(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        build, card = await ask(h)
        parent = await h.fake.wait_for(is_parent)
        await h.click(card, "reject", ALICE)  # the requester gets no modal
        await h.settle()
        assert h.fake.called("views.open") == []
        await h.click(card, "reject", CAROL)
        opened = await h.fake.wait_for(lambda c: c.method == "views.open" and c.status == 200)
        assert f"Reject build {build.id}?" in json.dumps(opened.args["view"])
        view_id = opened.answer["view"]["id"]
        reason = {"reason": {"reason": {"type": "plain_text_input", "value": "<!channel> not now"}}}
        assert (await h.submit(view_id, reason, CAROL)).status == 200
        await h.fake.wait_for(is_reply("rejected by"))
        await h.settle()
        await h.threads.idle()
        done = await the_build(h)
        assert done.state is BuildState.REJECTED and done.decided_by == CAROL
        assert f"rejected by <@{CAROL}>: &lt;!channel&gt; not now" in replies(h, parent)
        (update,) = card_updates(h, card)
        assert update.text == f":x: Rejected by <@{CAROL}>: &lt;!channel&gt; not now"


async def test_two_approvers_at_once_and_a_double_click_decide_once(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        _build, card = await ask(h)
        stamp = h.action_ts()
        await asyncio.gather(
            h.click(card, "approve", BOB, action_ts=stamp),
            h.click(card, "approve", BOB, action_ts=stamp),  # Slack delivering it twice
            h.click(card, "approve", CAROL),
        )
        await h.fake.wait_for(is_reply("Published:"), within=60)
        await h.settle()
        await h.deployer.drain()
        await h.threads.idle()
        done = await the_build(h)
        assert done.state is BuildState.PUBLISHED and done.decided_by in (BOB, CAROL)
        loser = CAROL if done.decided_by == BOB else BOB
        assert any("not awaiting approval any more" in t for t in told(h, loser))
        assert len(card_updates(h, card)) == 1
        assert len(await h.deployer.store.builds.recent()) == 1
        smoke = await h.deployer.store.jobs.get(str(done.smoke_job))
        assert smoke is not None and smoke.state is JobState.DESTROYED  # one smoke deploy
        assert [t.name for t in await h.deployer.backends["sim"].templates()].count("golden") == 1


async def test_an_unanswered_build_expires_and_refuses_clicks(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        _build, card = await ask(h)
        parent = await h.fake.wait_for(is_parent)
        await h.deployer.expire_approvals(utcnow() + timedelta(hours=1))
        await h.fake.wait_for(is_reply("nobody approved it in time"))
        await h.settle()
        await h.threads.idle()
        assert (await the_build(h)).state is BuildState.EXPIRED
        (update,) = card_updates(h, card)
        assert "Expired" in update.text
        assert "expired: nobody approved it in time" in replies(h, parent)
        await h.click(card, "approve", BOB)
        await h.settle()
        assert any("expired" in t and "nobody approved it in time" in t for t in told(h, BOB))
        assert (await the_build(h)).state is BuildState.EXPIRED


async def test_a_build_past_its_time_expires_on_the_click(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval={**POLICY, "expire_after_s": 0.001}) as h:
        _build, card = await ask(h)
        await h.click(card, "approve", BOB)
        await h.settle()
        assert any("nobody approved it in time" in t for t in told(h, BOB))
        assert (await the_build(h)).state is BuildState.EXPIRED


async def test_a_bad_profile_or_key_is_refused_and_nothing_is_recorded(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        await h.command("template build nope")
        await h.settle()
        assert any("no build profile 'nope'" in t for t in told(h, ALICE))
        bad_key = await h.command("template build debian-12 nod=pve1")
        assert "`nod` is not an option of `template build`. Did you mean `node`?" in bad_key.body
        await h.command("template build debian-12 on=nowhere")
        await h.settle()
        assert any("There is no backend 'nowhere'" in t for t in told(h, ALICE))
        assert await h.deployer.store.builds.recent() == []
        assert not [c for c in h.fake.calls if is_card(c) or is_parent(c)]


async def test_templates_show_what_deploybot_built(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        await h.command("template profiles")
        await h.settle()
        assert any("debian-12" in t and "x86-64-v2-AES" in t for t in told(h, ALICE))
        await h.command("template build debian-12 name=golden", user=BOB)
        await h.fake.wait_for(is_reply("Published:"), within=60)
        await h.settle()
        await h.deployer.drain()
        await h.command("templates")
        await h.settle()
        (answer,) = [t for t in told(h, ALICE) if "Use one with template=" in t]
        rows = {line.split()[0]: line.split() for line in answer.splitlines() if line.strip()}
        today = utcnow().strftime("%Y-%m-%d")
        assert rows["golden"][:5] == ["golden", "debian-12", "v1", today, "x86-64-v2-AES"]
        assert rows["ubuntu-24.04"][:5] == ["ubuntu-24.04", "-", "-", "-", "-"]


async def test_a_failed_build_ends_its_thread_with_the_cause_and_what_was_removed(
    tmp_path: Path,
) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    sim.inject("power_on", "error")  # the smoke deploy fails
    async with slack_bot(tmp_path, approval=POLICY, backend=sim) as h:
        await h.command("template build debian-12 name=golden", user=BOB)
        parent = await h.fake.wait_for(is_parent)
        await h.fake.wait_for(is_reply("The build failed at smoke"), within=60)
        await h.settle()
        await h.threads.idle()
        thread = replies(h, parent)
        assert "rollback: remove template" in thread
        assert "Everything it made was removed; fix the cause and build again." in thread
        assert thread.index("rollback: remove template") < thread.index("The build failed")
        done = await the_build(h)
        assert done.state is BuildState.FAILED and await sim.template_versions() == []
        headline = h.fake.called("chat.update", channel=CHANNEL, ts=parent.answer["ts"])
        assert headline and "failed" in headline[-1].text


async def test_after_a_restart_the_same_card_and_thread_are_updated(tmp_path: Path) -> None:
    fake = await new_fake()  # one Slack, two lives of the bot on one database
    try:
        async with slack_bot(tmp_path, approval=POLICY, fake=fake) as first:
            _build, card = await ask(first)
            parent = await fake.wait_for(is_parent)
            await fake.wait_for(is_reply("waiting for approval"))
            await first.threads.idle()
        async with slack_bot(tmp_path, approval=POLICY, fake=fake) as second:
            await second.click(card, "approve", BOB)
            await fake.wait_for(is_reply("Published:"), within=60)
            await second.settle()
            await second.deployer.drain()
            await second.threads.idle()
            assert len(card_updates(second, card)) == 1
            assert len([c for c in fake.calls if is_parent(c)]) == 1  # no second parent
            thread = "\n".join(fake.thread(CHANNEL, parent.answer["ts"]))
            assert f"approved by <@{BOB}>" in thread and "Published:" in thread
            done = await the_build(second)
            assert done.state is BuildState.PUBLISHED
            assert done.owner == second.deployer.runner.id  # the approver's process ran it
    finally:
        await fake.close()


async def test_what_people_typed_is_escaped_on_the_card_and_in_the_thread(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        # A name that is no VM name is refused, its text escaped in the answer.
        await h.command("template build debian-12 name=gold<!here>")
        await h.settle()
        refusal = [t for t in told(h, ALICE) if "cannot be a template name" in t]
        assert refusal and "<!here>" not in refusal[0] and "gold&lt;!here&gt;" in refusal[0]
        await h.command("template build debian-12 name=gold storage=<@U999|x>")
        card = await h.fake.wait_for(is_card)
        parent = await h.fake.wait_for(is_parent)
        await h.settle()
        await h.threads.idle()
        shown = json.dumps(card.args["blocks"]) + card.text + parent.text
        shown += json.dumps(parent.args["blocks"])
        assert "<@U999|x>" not in shown and "&lt;@U999|x&gt;" in shown


async def test_approvers_can_decide_by_command_with_the_builds_short_id(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        build, card = await ask(h)
        await h.command(f"approve {build.short_id}", user=ALICE)
        await h.settle()
        assert any("may not approve template builds" in t for t in told(h, ALICE))
        await h.command(f"reject {build.short_id} not this week", user=CAROL)
        await h.settle()
        assert any(f"Rejected build {build.id}" in t for t in told(h, CAROL))
        await h.fake.wait_for(is_reply("rejected by"))
        done = await the_build(h)
        assert done.state is BuildState.REJECTED and done.error == "not this week"
        await h.threads.idle()
        (update,) = card_updates(h, card)
        assert update.text == f":x: Rejected by <@{CAROL}>: not this week"
        await h.command(f"approve {build.short_id}", user=BOB)
        await h.settle()
        assert any(f"<@{CAROL}> rejected it" in t for t in told(h, BOB))


async def test_a_builds_status_names_its_requester_and_shows_typed_text_once_escaped(
    tmp_path: Path,
) -> None:
    """`/deploy status BUILD` in Slack: the requester (from the record) is a mention; a
    reason typed with `&`, `<` and an id-like word is shown as typed, escaped once."""
    async with slack_bot(tmp_path, approval=POLICY) as h:
        build, _card = await ask(h)
        await h.command(f"reject {build.id} R&amp;D &lt;2 ask WAREHOUSE42", BOB)
        await h.settle()
        await h.command(f"status {build.id}", ALICE)
        await h.settle()
        (answer,) = [t for t in told(h, ALICE) if build.id in t and "asked by" in t]
        assert f"asked by <@{ALICE}>" in answer
        assert "R&amp;D &lt;2 ask WAREHOUSE42" in answer
        assert "&amp;amp;" not in answer and "<@WAREHOUSE42>" not in answer
