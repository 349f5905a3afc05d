"""The fake Web API is as strict as Slack: unknown or missing arguments, 429, triggers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.webhook.async_client import AsyncWebhookClient

from handlers.slack.app import make_client
from tests.support.reference import reference_json
from tests.support.slack.bot import ALICE, BOT_TOKEN, CHANNEL, directory
from tests.support.slack.fake_api import RESPONSE_URL_TTL_S, FakeSlack


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    fake = FakeSlack(reference_json("slack-methods.json"), BOT_TOKEN, {CHANNEL}, directory())
    await fake.start()
    yield fake
    await fake.close()


async def refused(call: Awaitable[object]) -> dict[str, Any]:
    with pytest.raises(SlackApiError) as caught:
        await call
    data = caught.value.response.data
    assert isinstance(data, dict)
    return data


async def test_arguments_are_checked_against_the_reference(fake: FakeSlack) -> None:
    client = AsyncWebClient(token=BOT_TOKEN, base_url=fake.url)
    unknown = await refused(client.chat_postMessage(channel=CHANNEL, text="x", colour="red"))
    assert unknown["error"] == "invalid_arguments"
    assert unknown["response_metadata"] == {"messages": ["[ERROR] unknown argument: colour"]}
    missing = await refused(client.api_call("chat.update", json={"channel": CHANNEL}))
    assert missing["response_metadata"] == {"messages": ["[ERROR] missing required field: ts"]}
    assert (await refused(client.api_call("chat.frobnicate")))["error"] == "unknown_method"
    stranger = AsyncWebClient(token="xoxb-someone-else", base_url=fake.url)
    assert (await refused(stranger.auth_test()))["error"] == "invalid_auth"
    blocks = [{"type": "section", "text": {"type": "mrkdwn", "text": "x" * 3001}}]
    bad = await refused(client.chat_postMessage(channel=CHANNEL, text="x", blocks=blocks))
    assert bad["error"] == "invalid_blocks"
    assert (await refused(client.chat_postMessage(channel="CNOPE", text="x")))["error"] == (
        "channel_not_found"
    )


async def test_trigger_ids_work_once(fake: FakeSlack) -> None:
    client = AsyncWebClient(token=BOT_TOKEN, base_url=fake.url)
    text = {"type": "section", "text": {"type": "plain_text", "text": "hi"}}
    view = {"type": "modal", "title": {"type": "plain_text", "text": "t"}, "blocks": [text]}
    trigger = fake.new_trigger()
    opened = await client.views_open(trigger_id=trigger, view=view)
    assert opened["view"]["id"].startswith("V")
    again = await refused(client.views_open(trigger_id=trigger, view=view))
    assert again["error"] == "invalid_trigger_id"
    stale = await refused(client.views_update(view_id=opened["view"]["id"], hash="old", view=view))
    assert stale["error"] == "hash_conflict"


async def test_429_carries_retry_after_and_the_bots_client_waits_it_out(fake: FakeSlack) -> None:
    plain = AsyncWebClient(token=BOT_TOKEN, base_url=fake.url)
    fake.rate_limit("chat.postMessage", times=1, retry_after=0)
    with pytest.raises(SlackApiError) as caught:
        await plain.chat_postMessage(channel=CHANNEL, text="x")
    assert caught.value.response.status_code == 429
    assert caught.value.response.headers["Retry-After"] == "0"
    fake.rate_limit("chat.postMessage", times=2, retry_after=0)
    answer = await make_client(BOT_TOKEN, fake.url).chat_postMessage(channel=CHANNEL, text="y")
    assert answer["ok"] is True
    assert [c.status for c in fake.calls if c.method == "chat.postMessage"] == [429, 429, 429, 200]


async def test_a_response_url_takes_five_messages_within_thirty_minutes(fake: FakeSlack) -> None:
    hook = AsyncWebhookClient(fake.response_url(ALICE, CHANNEL))
    statuses = [(await hook.send(text=f"answer {n}")).status_code for n in range(6)]
    assert statuses == [200] * 5 + [404]
    assert [c.answer.get("error") for c in fake.calls][-1] == "used_url"
    assert [c.args["user"] for c in fake.called("response_url")] == [ALICE] * 5
    assert (await AsyncWebhookClient(fake.response_url(ALICE, CHANNEL)).send()).status_code == 400
    late = AsyncWebhookClient(fake.response_url(ALICE, CHANNEL))
    now = fake.clock()
    fake.clock = lambda: now + RESPONSE_URL_TTL_S + 1
    assert (await late.send(text="too late")).status_code == 404
    assert fake.calls[-1].answer["error"] == "expired_url"
