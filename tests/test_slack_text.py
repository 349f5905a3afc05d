"""What reaches Slack, word for word: only the people the bot names are mentions, what
people typed arrives once-escaped, and the small things a reader notices (issue 25).

Mentions are structural: the bot turns into `<@id>` only the ids it put in from its
records (requester, approver, who acted). An id someone typed, in a reason, a name or
a template, stays text on every path: the thread, the cards, ephemeral answers, DMs.
Slack escapes `&`, `<`, `>` in a slash command's text; the bot undoes that once where
the text comes in, keeps what was typed, and escapes once on the way out.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from backends.sim import SimBackend
from bot.models import DeployRequest, Job, JobState, utcnow
from handlers.messages.lifecycle import lease_reminder
from handlers.messages.text import when
from handlers.slack.manifest import BOT_SCOPES, manifest
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import (
    ALICE,
    APPROVALS,
    BOB,
    CAROL,
    CHANNEL,
    Harness,
    is_reply,
    new_fake,
    slack_bot,
)
from tests.support.slack.fake_api import Call

POLICY = {"approvers": [BOB, CAROL], "always": True}
DESTROY_POLICY = {"approvers": [BOB, CAROL], "destroy": "always", "expire_after_s": 600}
STRANGERS = "U0123ABCD or WAREHOUSE42 or UNACCEPTABLE"  # look like ids, typed by a person
MENTION = re.compile(r"<@(\w+)>")
ROOT = Path(__file__).resolve().parent.parent


def sent(h: Harness) -> str:
    """Everything the bot sent to Slack's Web API, as one string."""
    return "\n".join(json.dumps(c.args) for c in h.fake.calls)


def mentioned(h: Harness) -> set[str]:
    return set(MENTION.findall(sent(h)))


def thread(h: Harness) -> list[str]:
    parent = h.fake.called("chat.postMessage", channel=CHANNEL)[0]
    return h.fake.thread(CHANNEL, parent.answer["ts"])


def told(h: Harness, user: str) -> list[str]:
    return [c.text for c in h.fake.called("chat.postEphemeral", user=user)]


def is_card(c: Call) -> bool:
    return c.method == "chat.postMessage" and c.channel == APPROVALS


async def requested(h: Harness) -> tuple[str, Call]:
    await h.command("web01 10.0.0.50")
    card = await h.fake.wait_for(is_card)
    await h.settle()
    return (await h.deployer.history(1))[0].id, card


async def deployed(h: Harness) -> Job:
    await h.command("web01 10.0.0.50")
    await h.fake.wait_for(is_reply("ssh ubuntu@"))
    await h.settle()
    job = (await h.deployer.history(1))[0]
    assert job.state is JobState.SUCCEEDED
    return job


def last_update(h: Harness, card: Call) -> Call:
    return h.fake.called("chat.update", channel=APPROVALS, ts=card.answer["ts"])[-1]


# --- 1. typed ids never become mentions ---------------------------------------------------


async def test_ids_typed_in_a_reject_reason_ping_nobody(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await requested(h)
        # The approver quotes strangers and the requester's own id in the reason.
        reason = f"ask {STRANGERS} or {ALICE} first"
        await h.command(f"reject {job_id} {reason}", BOB)
        await h.fake.wait_for(is_reply("rejected: "))
        await h.settle()

        assert f"rejected: {reason}. Change the request and ask again." in thread(h)
        assert last_update(h, card).text == f":x: Rejected by <@{BOB}>: {reason}"
        assert told(h, BOB) == [f"Job {job_id}: rejected; <@{ALICE}> is told why."]
        # The only mentions anywhere: the requester on the card and in the answer, the
        # approver who decided; none from the reason.
        assert mentioned(h) == {ALICE, BOB}
        assert all("<@" not in line for line in thread(h))


async def test_ids_typed_in_a_command_are_quoted_as_text(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        await h.command("web03 10.0.0.61 template=UNACCEPTABLE")
        await h.command("destroy WAREHOUSE42")
        await h.command("status U0123ABCD")
        await h.settle()
        answers = "\n".join(told(h, ALICE))
        assert "'UNACCEPTABLE' is not a template" in answers
        assert "holds no VM called WAREHOUSE42" in answers
        assert mentioned(h) == set(), sent(h)


async def test_a_destroy_rejection_mentions_only_the_approver(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=DESTROY_POLICY) as h:
        job = await deployed(h)
        await h.command("destroy web01", ALICE)
        card = await h.fake.wait_for(is_card)
        await h.settle()
        # The approver names herself, the requester and strangers in the reason.
        reason = f"ask {CAROL}, {ALICE} or {STRANGERS}"
        await h.command(f"reject {job.id} {reason}", CAROL)
        await h.fake.wait_for(is_reply("destroy rejected by"))
        await h.settle()

        said = f"destroy rejected by <@{CAROL}>: {reason}."
        assert said in thread(h)
        expected = f":no_entry_sign: Destroy rejected by <@{CAROL}>: {reason}."
        assert last_update(h, card).text == expected
        # The bot's mentions: who asked for the destroy, who rejected it; one each.
        named = [m for line in thread(h) for m in MENTION.findall(line)]
        assert named == [ALICE, CAROL]


# --- 2. Slack's escaping undone once at the boundary, done once on output ----------------


async def test_slack_escaped_command_text_is_shown_escaped_once(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await requested(h)
        # Typed `R&D <2 &lt;`; Slack sends it as it sends every slash command's text.
        await h.command(f"reject {job_id} R&amp;D &lt;2 &amp;lt;", BOB)
        await h.fake.wait_for(is_reply("rejected: "))
        await h.settle()

        shown = "R&amp;D &lt;2 &amp;lt;"  # Slack's client shows this as `R&D <2 &lt;`
        assert f"rejected: {shown}. Change the request and ask again." in thread(h)
        assert last_update(h, card).text == f":x: Rejected by <@{BOB}>: {shown}"
        assert "&amp;amp;" not in sent(h) and "&amp;lt;2" not in sent(h)
        status = await h.deployer.status(job_id)
        assert status.approval is not None and status.approval.note == "R&D <2 &lt;"


# --- 22. small things a reader notices ----------------------------------------------------


async def test_a_long_destroy_rejection_fits_on_the_card(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=DESTROY_POLICY) as h:
        job = await deployed(h)
        await h.command("destroy web01", ALICE)
        card = await h.fake.wait_for(is_card)
        await h.settle()
        await h.command(f"reject {job.id} {'&amp;' * 6000}", CAROL)  # typed: 6,000 `&`
        await h.fake.wait_for(is_reply("destroy rejected by"))
        await h.settle()

        update = last_update(h, card)
        assert update.status == 200
        assert update.text.startswith(f":no_entry_sign: Destroy rejected by <@{CAROL}>: &amp;")
        assert len(update.text) <= 3000 and update.text.endswith("…")
        context = update.args["blocks"][-1]["elements"][0]["text"]
        assert len(context) <= 3000


async def test_lease_times_are_in_the_readers_zone_everywhere(tmp_path: Path) -> None:
    berlin = ZoneInfo("Europe/Berlin")
    fake = await new_fake()
    fake.users[ALICE]["tz"] = "Europe/Berlin"
    try:
        async with slack_bot(
            tmp_path, fake=fake, backend=SimBackend("sim", time_scale=SIM_SCALE)
        ) as h:
            await deployed(h)
            await h.command("lease extend web01 7d", ALICE)
            await h.settle()
            job = (await h.deployer.history(1))[0]
            assert job.lease_end is not None
            shown = when(job.lease_end, berlin)
            assert shown.endswith((" CET", " CEST"))
            assert any(f"now ends {shown}." in t for t in told(h, ALICE))
            await h.command("list", ALICE)
            await h.settle()
            (listing,) = h.fake.called("chat.postEphemeral", user=ALICE)[-1:]
            assert f"lease end {shown}" in json.dumps(listing.args["blocks"])
            await h.open_home(ALICE)
            await fake.wait_for(lambda c: c.method == "views.publish" and c.status == 200)
            await h.settle()
            assert f"lease end {shown}" in json.dumps(fake.home(ALICE))
            assert when(job.lease_end) not in sent(h)  # UTC nowhere
    finally:
        await fake.close()


def lease_job() -> Job:
    request = DeployRequest(
        name="web01",
        address="10.0.0.50/24",
        gateway="10.0.0.1",
        template="ubuntu",
        backend="sim",
        cores=2,
        memory_mib=2048,
        user="ubuntu",
        requester=ALICE,
    )
    return Job.for_request(request, JobState.SUCCEEDED)


def test_a_reminder_says_how_long_is_really_left() -> None:
    end = utcnow()

    def reminder(left: timedelta) -> str:
        return lease_reminder(lease_job(), end, end - left, "3d", UTC)

    assert "in less than a minute" in reminder(timedelta(seconds=20))
    assert "in about a minute" in reminder(timedelta(seconds=70))
    assert "in about 40 minutes" in reminder(timedelta(minutes=40))
    assert "in about an hour" in reminder(timedelta(minutes=70))
    assert "in about 23 hours" in reminder(timedelta(hours=23))
    assert "in about 3 days" in reminder(timedelta(days=3))
    assert "hour" not in reminder(timedelta(seconds=15))


def test_the_usage_hint_names_every_kind_of_command() -> None:
    (command,) = manifest()["features"]["slash_commands"]
    hint = command["usage_hint"]
    for words in ("status", "list", "destroy", "lease extend", "template build", "help"):
        assert words in hint


def test_the_readme_set_up_lists_the_scopes_once() -> None:
    readme = (ROOT / "docs" / "slack.md").read_text()
    step = readme[readme.index("1. **Create the app from") : readme.index("2. **Install it**")]
    assert step.count("the bot uses:") == 1
    for scope in BOT_SCOPES:
        assert step.count(f"`{scope}`") == 1, scope
