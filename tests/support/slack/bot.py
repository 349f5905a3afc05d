"""A running Slack bot against the fake Web API, and requests built the way Slack sends them.

Slash commands are form-encoded; block_actions, view_submission and block_suggestion are
`payload=<url-encoded JSON>`; every request is signed with the signing secret and handed
to Bolt through `app.async_dispatch`, exactly the path an HTTP request takes.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from slack_bolt.request.async_request import AsyncBoltRequest
from slack_bolt.response import BoltResponse
from slack_sdk.signature import SignatureVerifier

from backends.base import Backend
from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.models import utcnow
from bot.ownership.claims import Clock
from handlers.slack.app import SlackBot, make_client
from handlers.slack.threads import SlackThreads
from tests.support.deployer import SIM_SCALE, make_settings
from tests.support.reference import reference_json
from tests.support.slack.fake_api import Call, FakeSlack

SIGNING_SECRET = "0123456789abcdef0123456789abcdef"  # a test value, 32 hex like a real one
BOT_TOKEN = "xoxb-1234567890-0987654321-fakefakefake"
CHANNEL = "CDEPLOYS01"
APPROVALS = "CAPPROVE01"
ALICE, BOB, CAROL, DAVE, MALLORY = (
    "UALICE001",
    "UBOB00001",
    "UCAROL001",
    "UDAVE0001",
    "UMALLORY1",
)
OPS_GROUP = "SOPS00001"
PEOPLE = {ALICE: "alice", BOB: "bob", CAROL: "carol", DAVE: "dave", MALLORY: "mallory"}


def sign(body: str, secret: str = SIGNING_SECRET, at: int | None = None) -> dict[str, str]:
    timestamp = str(at if at is not None else int(time.time()))
    signature = SignatureVerifier(secret).generate_signature(timestamp=timestamp, body=body)
    assert signature is not None
    return {
        "content-type": "application/x-www-form-urlencoded",
        "x-slack-signature": signature,
        "x-slack-request-timestamp": timestamp,
    }


# Where a command's answers go unless a test hands it a response_url on the fake
# (FakeSlack.response_url): nothing listens there, so the bot answers by the Web API.
UNUSED_RESPONSE_URL = "http://127.0.0.1:9/response-url-unused"


def command_body(
    text: str, user: str, channel: str, trigger: str, response_url: str = UNUSED_RESPONSE_URL
) -> str:
    return urlencode(
        {
            "token": "legacy-verification-token",
            "team_id": "T0000001",
            "team_domain": "fake",
            "channel_id": channel,
            "channel_name": "deploys",
            "user_id": user,
            "user_name": PEOPLE.get(user, user),
            "command": "/deploy",
            "text": text,
            "api_app_id": "A0000001",
            "is_enterprise_install": "false",
            "response_url": response_url,
            "trigger_id": trigger,
        }
    )


def payload_body(payload: dict[str, Any]) -> str:
    return "payload=" + quote(json.dumps(payload))


@dataclass
class Harness:
    fake: FakeSlack
    bot: SlackBot
    deployer: Deployer
    threads: SlackThreads
    _ts: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def dispatch(self, body: str, extra: dict[str, str] | None = None) -> BoltResponse:
        headers: dict[str, str | Sequence[str]] = {**sign(body), **(extra or {})}
        return await self.bot.app.async_dispatch(AsyncBoltRequest(body=body, headers=headers))

    async def command(
        self,
        text: str,
        user: str = ALICE,
        channel: str = CHANNEL,
        *,
        trigger: str | None = None,
        retry: int = 0,
        response_url: str = UNUSED_RESPONSE_URL,
    ) -> BoltResponse:
        trigger = trigger or self.fake.new_trigger()
        extra = {"x-slack-retry-num": str(retry), "x-slack-retry-reason": "timeout"}
        return await self.dispatch(
            command_body(text, user, channel, trigger, response_url), extra if retry else {}
        )

    def action_ts(self) -> str:
        return f"{int(time.time())}.{next(self._ts):06d}"

    async def click(
        self, card: Call, action_id: str, user: str, *, action_ts: str | None = None
    ) -> BoltResponse:
        """Press a button of a message the bot posted (`card` is its chat.postMessage,
        chat.update or chat.postEphemeral)."""
        button, block_id = _button(card.args["blocks"], action_id)
        channel = card.channel
        ts = card.answer.get("ts") or card.answer["message_ts"]
        payload = {
            "type": "block_actions",
            "team": {"id": "T0000001", "domain": "fake"},
            "user": {"id": user, "username": PEOPLE.get(user, user), "team_id": "T0000001"},
            "api_app_id": "A0000001",
            "token": "legacy-verification-token",
            "container": {"type": "message", "message_ts": ts, "channel_id": channel},
            "trigger_id": self.fake.new_trigger(),
            "channel": {"id": channel, "name": "approvals"},
            "message": {"ts": ts, "blocks": card.args["blocks"]},
            "actions": [
                {
                    "type": "button",
                    "action_id": button["action_id"],
                    "block_id": block_id,
                    "value": button["value"],
                    "action_ts": action_ts or self.action_ts(),
                }
            ],
        }
        return await self.dispatch(payload_body(payload))

    async def open_home(self, user: str) -> BoltResponse:
        """The person opens the app's Home tab: an `app_home_opened` event, as Slack
        sends it (JSON, signed)."""
        event = {
            "type": "app_home_opened",
            "user": user,
            "channel": "D0000HOME",
            "tab": "home",
            "event_ts": self.action_ts(),
        }
        body = json.dumps(
            {
                "token": "legacy-verification-token",
                "team_id": "T0000001",
                "api_app_id": "A0000001",
                "event": event,
                "type": "event_callback",
                "event_id": f"Ev{next(self._ts):08d}",
                "event_time": int(time.time()),
            }
        )
        return await self.dispatch(body, {"content-type": "application/json"})

    async def click_home(
        self, user: str, action_id: str, value: str, *, action_ts: str | None = None
    ) -> BoltResponse:
        """Press the button `action_id` whose value is `value` on `user`'s App Home."""
        view = self.fake.home(user)
        block_id, _element = next(
            (b.get("block_id", ""), e)
            for b in view["blocks"]
            for e in [*b.get("elements", []), b.get("accessory") or {}]
            if e.get("action_id") == action_id and e.get("value") == value
        )
        payload = {
            "type": "block_actions",
            "team": {"id": "T0000001", "domain": "fake"},
            "user": {"id": user, "username": PEOPLE.get(user, user), "team_id": "T0000001"},
            "api_app_id": "A0000001",
            "token": "legacy-verification-token",
            "container": {"type": "view", "view_id": view["id"]},
            "trigger_id": self.fake.new_trigger(),
            "view": {**view, "type": "home", "team_id": "T0000001"},
            "actions": [
                {
                    "type": "button",
                    "action_id": action_id,
                    "block_id": block_id,
                    "value": value,
                    "action_ts": action_ts or self.action_ts(),
                }
            ],
        }
        return await self.dispatch(payload_body(payload))

    async def submit(
        self, view_id: str, values: dict[str, dict[str, Any]], user: str = ALICE
    ) -> BoltResponse:
        """Submit a modal as the fake holds it, with `values` as its state."""
        payload = {
            "type": "view_submission",
            "team": {"id": "T0000001", "domain": "fake"},
            "user": {"id": user, "username": PEOPLE.get(user, user), "team_id": "T0000001"},
            "api_app_id": "A0000001",
            "token": "legacy-verification-token",
            "trigger_id": self.fake.new_trigger(),
            "view": self.view_payload(view_id, values),
        }
        return await self.dispatch(payload_body(payload))

    async def choose(
        self, view_id: str, values: dict[str, dict[str, Any]], action_id: str, user: str = ALICE
    ) -> BoltResponse:
        """Change a select inside a modal (block_actions from a view)."""
        view = self.view_payload(view_id, values)
        block_id = next(b for b in values if b.split("@")[0] == action_id)
        selected = values[block_id][action_id]
        payload = {
            "type": "block_actions",
            "team": {"id": "T0000001", "domain": "fake"},
            "user": {"id": user, "username": PEOPLE.get(user, user), "team_id": "T0000001"},
            "api_app_id": "A0000001",
            "token": "legacy-verification-token",
            "container": {"type": "view", "view_id": view_id},
            "trigger_id": self.fake.new_trigger(),
            "view": view,
            "actions": [
                {
                    "type": "static_select",
                    "action_id": action_id,
                    "block_id": block_id,
                    "selected_option": selected["selected_option"],
                    "action_ts": self.action_ts(),
                }
            ],
        }
        return await self.dispatch(payload_body(payload))

    async def suggest(self, view_id: str, action_id: str, query: str) -> BoltResponse:
        payload = {
            "type": "block_suggestion",
            "team": {"id": "T0000001", "domain": "fake"},
            "user": {"id": ALICE, "username": "alice", "team_id": "T0000001"},
            "api_app_id": "A0000001",
            "token": "legacy-verification-token",
            "container": {"type": "view", "view_id": view_id},
            "view": self.view_payload(view_id, {}),
            "action_id": action_id,
            "block_id": action_id,
            "value": query,
        }
        return await self.dispatch(payload_body(payload))

    def view_payload(self, view_id: str, values: dict[str, dict[str, Any]]) -> dict[str, Any]:
        view = self.fake.views[view_id]
        return {**view, "type": "modal", "state": {"values": values}, "team_id": "T0000001"}

    async def settle(self) -> None:
        """Every listener task done and every channel message sent."""
        await self.bot.settle()
        await self.threads.idle()


def _button(blocks: list[dict[str, Any]], action_id: str) -> tuple[dict[str, Any], str]:
    """The first button with this action id (in an actions block, or a section's
    accessory) and its block's id."""
    for block in blocks:
        for element in [*block.get("elements", []), block.get("accessory") or {}]:
            if element.get("action_id") == action_id:
                return dict(element), str(block.get("block_id", "decision"))
    raise AssertionError(f"no {action_id} button in {blocks}")


def directory() -> dict[str, dict[str, Any]]:
    return {uid: {"id": uid, "name": name, "deleted": False} for uid, name in PEOPLE.items()}


async def new_fake() -> FakeSlack:
    fake = FakeSlack(
        reference_json("slack-methods.json"),
        BOT_TOKEN,
        {CHANNEL, APPROVALS},
        directory(),
        {OPS_GROUP: [DAVE]},
    )
    await fake.start()
    return fake


@asynccontextmanager
async def slack_bot(
    tmp_path: Path,
    *,
    approval: dict[str, Any] | None = None,
    rate: float = 500.0,
    backend: Backend | None = None,
    fake: FakeSlack | None = None,
    clock: Clock = utcnow,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """A bot on the simulator; pass `fake` to keep one Slack across a restart of the bot."""
    own = fake is None
    if fake is None:
        fake = await new_fake()
    settings = make_settings(
        tmp_path,
        approval=approval or {"approvers": [BOB, CAROL]},
        slack={"api_base_url": fake.url, "approvals_channel": APPROVALS, "posts_per_second": rate},
        **overrides,
    )
    client = make_client(BOT_TOKEN, fake.url)
    threads = SlackThreads(client, settings.slack)
    sim = backend or SimBackend("sim", time_scale=SIM_SCALE)
    try:
        async with running_deployer(settings, backends={"sim": sim}, grace_s=5, clock=clock) as d:
            bot = SlackBot(d, threads, client, signing_secret=SIGNING_SECRET)
            harness = Harness(fake, bot, d, threads)
            try:
                yield harness
            finally:
                await bot.settle()
                await d.drain()
                await threads.close()
    finally:
        if own:
            await fake.close()


def is_reply(text: str) -> Any:
    """A predicate: a thread reply containing `text`."""
    return lambda c: c.method == "chat.postMessage" and "thread_ts" in c.args and text in c.text


def env_without_slack(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "DEPLOYBOT_"))}
    return {**env, **extra}


def state(view: dict[str, Any], **chosen: str | list[str] | None) -> dict[str, Any]:
    """The view's state as Slack sends it: initial values, then what the person chose."""
    values: dict[str, Any] = {}
    for block in view["blocks"]:
        if block["type"] != "input":
            continue
        element = block["element"]
        action = element["action_id"]
        kind = element["type"]
        entry: dict[str, Any] = {"type": kind}
        pick = chosen.get(action, element.get("initial_option", {}).get("value"))
        if kind in ("static_select", "external_select"):
            if pick is not None:
                entry["selected_option"] = {
                    "text": {"type": "plain_text", "text": pick},
                    "value": pick,
                }
        elif kind == "checkboxes":
            entry["selected_options"] = [{"value": v} for v in (chosen.get(action) or [])]
        else:
            typed = chosen.get(action, element.get("initial_value"))
            if typed is not None:
                entry["value"] = typed
        values[block["block_id"]] = {action: entry}
    return values


async def open_form(h: Harness) -> str:
    response = await h.command("")
    assert response.status == 200 and response.body == ""
    opened = await h.fake.wait_for(lambda c: c.method == "views.open")
    assert opened.answer["ok"], opened.answer
    assert opened.args["view"]["callback_id"] == "deploy_form"
    view_id = str(opened.answer["view"]["id"])
    await h.fake.wait_for(lambda c: c.method == "views.update" and c.args["view_id"] == view_id)
    await h.settle()
    return view_id


def block(view: dict[str, Any], prefix: str) -> dict[str, Any]:
    return next(b for b in view["blocks"] if b.get("block_id", "").startswith(prefix))
