"""Text people typed is shown as typed: `<!channel>` in a reason pings nobody.

In Slack's mrkdwn `<!channel>` pings the whole channel, `<@U123>` pings someone and
`<https://x|y>` is a link that reads as something else. Whatever the bot echoes (a
reject reason, a usage error quoting the command, a backend's words) reaches Slack
with `&`, `<` and `>` escaped, while the mentions the bot adds itself still work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from backends.base import PermanentError, Placement
from backends.sim import SimBackend
from bot.models import DeployRequest, Job, JobState
from handlers.messages.slack import slack_headline
from handlers.messages.text import Said
from handlers.slack import views
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import ALICE, APPROVALS, BOB, CAROL, Harness, is_reply, slack_bot
from tests.support.slack.fake_api import Call

POLICY = {"approvers": [BOB, CAROL], "always": True}
TYPED = "<!channel> & <@U999|x>"
SHOWN = "&lt;!channel&gt; &amp; &lt;@U999|x&gt;"
RAW = ("<!channel>", "<@U999", "<!here>", "<https://evil")


def sent(h: Harness) -> str:
    """Everything the bot sent to Slack's Web API, as one string."""
    return "\n".join(json.dumps(c.args) for c in h.fake.calls)


def is_card(c: Call) -> bool:
    return c.method == "chat.postMessage" and c.channel == APPROVALS


async def requested(h: Harness) -> tuple[str, Call]:
    await h.command("web01 10.0.0.50")
    card = await h.fake.wait_for(is_card)
    await h.settle()
    return (await h.deployer.history(1))[0].id, card


def card_update(h: Harness, card: Call) -> Call:
    (update,) = h.fake.called("chat.update", channel=APPROVALS, ts=card.answer["ts"])
    return update


async def test_a_reject_reason_from_the_modal_pings_nobody(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await requested(h)
        await h.click(card, "reject", CAROL)
        opened = await h.fake.wait_for(lambda c: c.method == "views.open" and c.status == 200)
        reason = {"reason": {"reason": {"type": "plain_text_input", "value": TYPED}}}
        assert (await h.submit(opened.answer["view"]["id"], reason, CAROL)).status == 200
        reply = await h.fake.wait_for(is_reply("rejected: "))
        await h.settle()

        assert f"rejected: {SHOWN}. Change the request" in reply.text
        update = card_update(h, card)
        # The bot's own mention of the approver still works; the reason is only text.
        assert update.text == f":x: Rejected by <@{CAROL}>: {SHOWN}"
        assert SHOWN in json.dumps(update.args["blocks"])
        everything = sent(h)
        assert not [raw for raw in RAW if raw in everything]
        assert (await h.deployer.status(job_id)).job.state is JobState.REJECTED
        # The store keeps what was typed; only what Slack shows is escaped.
        assert (await h.deployer.status(job_id)).approval.note == TYPED  # type: ignore[union-attr]


async def test_a_reject_reason_from_the_command_pings_nobody(tmp_path: Path) -> None:
    async with slack_bot(tmp_path, approval=POLICY) as h:
        job_id, card = await requested(h)
        await h.command(f"reject {job_id} <!here> see <https://evil.example|the docs> & go", BOB)
        reply = await h.fake.wait_for(is_reply("rejected: "))
        await h.settle()

        shown = "&lt;!here&gt; see &lt;https://evil.example|the docs&gt; &amp; go"
        assert f"rejected: {shown}." in reply.text
        assert card_update(h, card).text == f":x: Rejected by <@{BOB}>: {shown}"
        (answer,) = h.fake.called("chat.postEphemeral", user=BOB)
        assert answer.text == f"Job {job_id}: rejected; <@{ALICE}> is told why."
        everything = sent(h)
        assert not [raw for raw in RAW if raw in everything]


async def test_usage_errors_quote_the_command_escaped(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        cases = {
            "web01 10.0.0.50 <!channel>": "`&lt;!channel&gt;` is not an option",
            "status <@U999|x>": "`&lt;@U999|x&gt;` is not a job id",
            "history a&b": "`a&amp;b` is not a number",
        }
        for text, expected in cases.items():
            body = json.loads((await h.command(text)).body)
            blocks = json.dumps(body["blocks"])
            assert expected in body["text"] and expected in blocks
            assert "<!channel>" not in body["text"] + blocks
            assert "<@U999" not in body["text"] + blocks
            assert "&amp;amp;" not in body["text"]  # escaped once, not twice


async def test_a_refusal_that_quotes_the_request_is_escaped(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        await h.command(f"web03 10.0.0.61 template={TYPED.replace(' ', '')}")
        await h.settle()
        (answer,) = h.fake.called("chat.postEphemeral", user=ALICE)
        assert "'&lt;!channel&gt;&amp;&lt;@U999|x&gt;' is not a template on sim" in answer.text
        assert "&lt;!channel&gt;&amp;" in json.dumps(answer.args["blocks"])
        everything = sent(h)
        assert not [raw for raw in RAW if raw in everything]
        assert await h.deployer.history() == []


class SulkingNodes(SimBackend):
    """The simulator, except that listing nodes fails with words that look like markup."""

    async def placements(self) -> list[Placement]:
        raise PermanentError("node list refused for <!channel> & <@U999|x>")


async def test_a_backends_words_in_the_form_are_escaped(tmp_path: Path) -> None:
    sim = SulkingNodes("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, backend=sim) as h:
        await h.command("")
        filled = await h.fake.wait_for(lambda c: c.method == "views.update")
        await h.settle()
        texts = json.dumps(filled.args["view"])
        assert f"node list refused for {SHOWN}" in texts
        assert "<!channel>" not in texts and "<@U999" not in texts


def test_an_approval_card_shows_a_template_name_as_named() -> None:
    # vSphere allows `&`, `<` and `>` in a template's name; the card quotes it.
    template = "web & db <v2>"
    request = DeployRequest(
        name="web01",
        address="10.0.0.50/24",
        gateway="10.0.0.1",
        template=template,
        backend="vcenter",
        placement="Cluster<1>",
        cores=2,
        memory_mib=2048,
        user="ubuntu",
        requester=ALICE,
    )
    job = Job.for_request(request, JobState.AWAITING_APPROVAL).model_copy(
        update={"approval_reason": f"template {template} needs approval"}
    )
    card = json.dumps(views.approval_request(job))
    assert card.count("web &amp; db &lt;v2&gt;") == 2 and template not in card
    assert f"*<@{ALICE}> asks to deploy web01 10.0.0.50* on vcenter/Cluster&lt;1&gt;" in card
    headline = slack_headline(job, None)
    assert headline == "web01 10.0.0.50 on vcenter/Cluster&lt;1&gt;: awaiting approval"


def test_only_the_people_the_bot_names_become_mentions() -> None:
    text = f"UALICE001 may not approve deploys; ask UBOB00001 or WAREHOUSE42; {TYPED}"
    assert views.mrkdwn(text) == text.replace(TYPED, SHOWN)  # nobody named: no mention
    named = views.mrkdwn(text, ["UALICE001"])
    assert named == f"<@UALICE001> may not approve deploys; ask UBOB00001 or WAREHOUSE42; {SHOWN}"
    # The bot names a person before anything typed: the typed repeat stays text.
    said = Said("destroy rejected by UBOB00001: ask UBOB00001", ("UBOB00001",))
    assert views.mrkdwn(said) == "destroy rejected by <@UBOB00001>: ask UBOB00001"


MENTION = re.compile(r"<@([UW][A-Z0-9]{8,})>")
IDS = ("UW0129ABX", "W01290000")


@given(
    st.text(alphabet=st.sampled_from("<>&@!|:/ UW0129ABXhtps;amlg\n"), max_size=80),
    st.lists(st.sampled_from(IDS), max_size=2),
)
def test_any_text_reads_back_as_typed_with_only_the_named_people(
    text: str, people: list[str]
) -> None:
    shown = views.mrkdwn(text, people)
    found = MENTION.findall(shown)
    assert set(found) <= set(people) and len(found) == len(set(found))  # once each
    plain = MENTION.sub(r"\1", shown)  # the only markup: mentions of the named people
    assert "<" not in plain and ">" not in plain
    back = plain.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    assert back == text
