"""`deploybot check`'s Slack part: the bot token works (auth.test), it holds the scopes
the manifest asks for (Slack sends the token's scopes in `x-oauth-scopes`), and the
approvals channel exists with the bot in it (conversations.info).

Membership is only asked where the token may read the channel (`channels:read` or
`groups:read`, which the manifest does not ask for: the bot does not need them to run);
without it the line says so rather than failing a working set-up.
"""

from __future__ import annotations

from collections.abc import Mapping

from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot.config.sections import SlackSettings
from bot.operations.check import CheckResult
from handlers.messages.slack import (
    slack_channel_fix,
    slack_channel_unreadable,
    slack_not_checked,
    slack_scopes_fix,
    slack_token_fix,
)
from handlers.slack.manifest import BOT_SCOPES


async def slack_checks(settings: SlackSettings, environ: Mapping[str, str]) -> list[CheckResult]:
    token = environ.get(settings.bot_token_env)
    if not token:
        return [CheckResult("slack", True, slack_not_checked(settings.bot_token_env))]
    client = AsyncWebClient(token=token, base_url=settings.api_base_url, timeout=15)
    try:
        answer = await client.auth_test()
    except SlackApiError as exc:
        error = str(exc.response.get("error", "unknown"))
        fix = slack_token_fix(settings.bot_token_env)
        return [CheckResult("slack: auth.test", False, f"refused ({error})", fix)]
    except OSError as exc:  # aiohttp's connection errors are OSErrors
        detail = f"{settings.api_base_url} did not answer ({type(exc).__name__})"
        return [CheckResult("slack: auth.test", False, detail, "check slack.api_base_url")]
    bot = str(answer.get("user") or answer.get("user_id") or "the bot")
    results = [CheckResult("slack: auth.test", True, f"token of {bot} in {answer.get('team')}")]
    granted = {s.strip() for s in answer.headers.get("x-oauth-scopes", "").split(",") if s}
    lacking = [s for s in BOT_SCOPES if s not in granted]
    if lacking:
        detail = f"the token lacks {', '.join(lacking)}"
        results.append(CheckResult("slack: scopes", False, detail, slack_scopes_fix()))
    else:
        results.append(CheckResult("slack: scopes", True, f"{', '.join(BOT_SCOPES)} granted"))
    if settings.approvals_channel:
        results.append(await _approvals(client, settings.approvals_channel, bot))
    return results


async def _approvals(client: AsyncWebClient, channel: str, bot: str) -> CheckResult:
    name = f"slack: approvals channel {channel}"
    try:
        answer = await client.conversations_info(channel=channel)
    except SlackApiError as exc:
        error = str(exc.response.get("error", "unknown"))
        if error == "missing_scope":
            return CheckResult(name, True, slack_channel_unreadable(channel))
        return CheckResult(name, False, f"refused ({error})", slack_channel_fix(bot))
    info = answer.get("channel") or {}
    if info.get("is_member"):
        return CheckResult(name, True, "exists and the bot is a member")
    return CheckResult(name, False, "exists but the bot is not a member", slack_channel_fix(bot))
