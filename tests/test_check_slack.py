"""`deploybot check`'s Slack lines against the fake Slack Web API (which sends the
token's scopes in `x-oauth-scopes` and refuses conversations.info without the read
scope, as Slack does): the token, the manifest's scopes, the approvals channel."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bot.config.sections import SlackSettings
from bot.operations.check import CheckResult
from handlers.slack.check import slack_checks
from tests.support.slack.bot import APPROVALS, BOT_TOKEN, new_fake
from tests.support.slack.fake_api import FakeSlack


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    fake = await new_fake()
    yield fake
    await fake.close()


async def check(fake: FakeSlack, token: str | None = BOT_TOKEN) -> dict[str, CheckResult]:
    settings = SlackSettings(api_base_url=fake.url, approvals_channel=APPROVALS)
    environ = {} if token is None else {"SLACK_BOT_TOKEN": token}
    results = await slack_checks(settings, environ)
    assert all(BOT_TOKEN not in r.detail + r.fix for r in results)
    return {r.name: r for r in results}


async def test_a_working_set_up(slack: FakeSlack) -> None:
    slack.scopes.append("groups:read" if APPROVALS.startswith("G") else "channels:read")
    results = await check(slack)
    assert all(r.ok for r in results.values()), results
    assert set(results) == {
        "slack: auth.test",
        "slack: scopes",
        f"slack: approvals channel {APPROVALS}",
    }
    assert results[f"slack: approvals channel {APPROVALS}"].detail == (
        "exists and the bot is a member"
    )


async def test_a_scope_the_manifest_asks_for_is_missing(slack: FakeSlack) -> None:
    slack.scopes.remove("usergroups:read")
    results = await check(slack)
    assert not results["slack: scopes"].ok
    assert results["slack: scopes"].detail == "the token lacks usergroups:read"
    assert "reinstall" in results["slack: scopes"].fix
    # Without channels:read the membership is not asked, and that is no failure.
    channel = results[f"slack: approvals channel {APPROVALS}"]
    assert channel.ok and "not checked" in channel.detail


async def test_the_bot_outside_the_approvals_channel(slack: FakeSlack) -> None:
    slack.scopes += ["channels:read", "groups:read"]
    slack.channels.discard(APPROVALS)
    slack.outside.add(APPROVALS)
    results = await check(slack)
    channel = results[f"slack: approvals channel {APPROVALS}"]
    assert not channel.ok
    assert channel.detail == "exists but the bot is not a member"
    assert "/invite @deploybot" in channel.fix
    slack.outside.clear()
    results = await check(slack)
    assert results[f"slack: approvals channel {APPROVALS}"].detail == "refused (channel_not_found)"


async def test_a_refused_or_absent_token(slack: FakeSlack) -> None:
    results = await check(slack, "xoxb-not-the-token")
    assert list(results) == ["slack: auth.test"]
    assert results["slack: auth.test"].detail == "refused (invalid_auth)"
    assert "$SLACK_BOT_TOKEN" in results["slack: auth.test"].fix
    results = await check(slack, None)
    assert results["slack"].ok and "$SLACK_BOT_TOKEN is not set" in results["slack"].detail
