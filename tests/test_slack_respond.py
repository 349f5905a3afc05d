"""Answers to commands through their response_url (handlers/slack/respond.py): a
person's answer never waits behind another person's burst on the workspace-wide
chat.postEphemeral budget, and a response_url Slack no longer takes (used 5 times, or
older than 30 minutes) falls back to the Web API."""

from __future__ import annotations

import asyncio
from pathlib import Path

from handlers.slack.pacing import Pacer
from tests.support.slack.bot import ALICE, BOB, CHANNEL, Harness, slack_bot
from tests.support.slack.fake_api import RESPONSE_URL_TTL_S, FakeSlack


def answers(fake: FakeSlack, user: str) -> tuple[list[str], list[str]]:
    """What `user` was told: through response URLs, and through chat.postEphemeral."""
    return (
        [c.text for c in fake.called("response_url", user=user)],
        [c.text for c in fake.called("chat.postEphemeral", user=user)],
    )


def held_pacer(h: Harness) -> asyncio.Event:
    """The Tier 4 pace with one call of room, then held until the event is set: a
    workspace-wide backlog of ephemeral answers, for as long as the test wants."""
    gate = asyncio.Event()

    async def wait(_seconds: float) -> None:
        await gate.wait()

    h.bot.ephemeral = Pacer(per_minute=100, burst=1, clock=lambda: 0.0, sleep=wait)
    return gate


async def test_an_answer_does_not_wait_behind_someone_elses_burst(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        gate = held_pacer(h)
        try:
            await alice_is_answered_at_once(h)
        finally:
            gate.set()  # Bob's answers go out now
        await h.settle()
        assert len(answers(h.fake, BOB)[1]) == 3


async def alice_is_answered_at_once(h: Harness) -> None:
    """While Bob's answers wait for the workspace's pace, Alice's come at once."""
    for n in range(3):  # Bob's burst, answered by the Web API (no response_url)
        await h.command(f"bob{n} 10.0.0.{60 + n}", BOB)
    await h.fake.wait_for(lambda c: c.method == "chat.postEphemeral" and c.args["user"] == BOB)
    url = h.fake.response_url(ALICE, CHANNEL)
    await h.command("list", ALICE, response_url=url)
    await h.command("web01 10.0.0.50", ALICE, response_url=h.fake.response_url(ALICE, CHANNEL))
    await h.fake.wait_for(lambda c: len(answers(h.fake, ALICE)[0]) == 2)
    told, ephemeral = answers(h.fake, ALICE)
    assert ephemeral == [] and "web01" in "\n".join(told)
    listing = h.fake.called("response_url", user=ALICE, response_type="ephemeral")
    assert len(listing) == 2 and not any(c.args["replace_original"] for c in listing)
    assert len(answers(h.fake, BOB)[1]) == 1  # Bob's others still wait for the pace


async def test_a_spent_or_expired_response_url_falls_back_to_the_web_api(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        url = h.fake.response_url(ALICE, CHANNEL)
        for n in range(6):  # one URL, six answers: Slack takes five
            await h.command(f"status j{n:07d}", ALICE, response_url=url)
            await h.bot.settle()
        told, ephemeral = answers(h.fake, ALICE)
        assert (len(told), len(ephemeral)) == (5, 1)
        assert not [c for c in h.fake.calls if c.method == "response_url" and c.status != 200]

        late = h.fake.response_url(ALICE, CHANNEL)
        now = h.fake.clock()
        h.fake.clock = lambda: now + RESPONSE_URL_TTL_S + 1  # half an hour later, for Slack
        await h.command("status j0000009", ALICE, response_url=late)
        await h.bot.settle()
        refused = [c for c in h.fake.calls if c.method == "response_url" and c.status != 200]
        assert [c.answer["error"] for c in refused] == ["expired_url"]
        told_now, ephemeral_now = answers(h.fake, ALICE)
        assert (len(told_now), len(ephemeral_now)) == (5, 2)
