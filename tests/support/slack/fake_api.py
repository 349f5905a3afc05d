"""A local fake of Slack's Web API: aiohttp on 127.0.0.1, a random port, no network.

It answers the methods the bot calls the way Slack does: arguments come as a query
string, a form or JSON; the token comes in the Authorization header; arguments are
checked against `slack-methods.json` (an argument the method does not take, or a
missing required one, gets `invalid_arguments`); blocks and views are checked with
`slack_sdk.models`; trigger ids work once and for 3 s; `views.update` honours `hash`.
Each slash command can carry a `response_url` on the fake (`response_url`) that takes
an ephemeral answer as Slack's does: 5 messages within 30 minutes, then refused.
It can answer 429 with Retry-After, and it records every call with the time it arrived
(an answer through a response_url as the method "response_url"), so tests wait for "a
call matching X" instead of sleeping.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from slack_sdk.models.blocks import Block
from slack_sdk.models.views import View

TRIGGER_TTL_S = 3.0
RESPONSE_URL_TTL_S = 30 * 60.0  # a command's response_url: 30 minutes, 5 messages
RESPONSE_URL_USES = 5
# Slack takes these on every method: the token (old style) and, for org-wide apps, the
# workspace. Bolt's per-request client adds team_id to each call it makes (auth.test).
ANY_METHOD = frozenset({"token", "team_id"})


@dataclass
class Call:
    method: str
    args: dict[str, Any]
    at: float
    status: int
    answer: dict[str, Any]

    @property
    def text(self) -> str:
        return str(self.args.get("text") or "")

    @property
    def channel(self) -> str:
        return str(self.args.get("channel") or "")


class Refused(Exception):
    def __init__(self, error: str, *details: str) -> None:
        super().__init__(error)
        self.error = error
        self.details = list(details)


@dataclass
class FakeSlack:
    methods: dict[str, Any]  # slack-methods.json
    token: str
    channels: set[str]
    users: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    messages: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    views: dict[str, dict[str, Any]] = field(default_factory=dict)
    homes: dict[str, str] = field(default_factory=dict)  # user -> their App Home's view id
    # Slack's special limit on chat.postMessage: about one per second per channel. When
    # set, a post closer than this to the channel's last one is refused with a 429 and
    # counted as a violation (the bot's pacing must never cause one).
    post_interval_s: float | None = None
    violations: int = 0
    # The token's scopes, sent back in `x-oauth-scopes` on every answer as Slack does;
    # conversations.info is refused without the read scope of the channel's kind.
    scopes: list[str] = field(
        default_factory=lambda: [
            "commands",
            "chat:write",
            "chat:write.public",
            "usergroups:read",
            "users:read",
        ]
    )
    # Channels that exist but the bot is not in (conversations.info: is_member false).
    outside: set[str] = field(default_factory=set)
    # Channels Slack holds back for now (a backlogged channel): every post or edit there
    # is answered 429 with `blocked_retry_after_s` and changes nothing, until removed.
    blocked: set[str] = field(default_factory=set)
    blocked_retry_after_s: int = 30
    # The clock response URLs age by (tests move it instead of waiting 30 minutes).
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._triggers: dict[str, float] = {}
        self._limits: dict[str, list[int]] = {}  # method -> [times left, retry_after]
        self._last_post: dict[str, float] = {}  # channel -> when its last post arrived
        self._responses: dict[str, dict[str, Any]] = {}  # response_url id -> its state
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # --- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._handle)
        app.router.add_post("/response/{id}", self._respond)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/api/"
        self._base = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- test controls ------------------------------------------------------------

    def new_trigger(self) -> str:
        trigger = f"{next(self._ids)}.{int(time.time())}.trigger"
        self._triggers[trigger] = time.monotonic()
        return trigger

    def response_url(self, user: str, channel: str) -> str:
        """A new command's response_url: it answers `user` in `channel` from now on."""
        key = f"{next(self._ids)}{int(time.time())}"
        self._responses[key] = {"user": user, "channel": channel, "at": self.clock(), "uses": 0}
        return f"{self._base}/response/{key}"

    def rate_limit(self, method: str, times: int = 1, retry_after: int = 0) -> None:
        """Answer the next `times` calls of `method` with 429 and Retry-After."""
        self._limits[method] = [times, retry_after]

    def called(self, method: str, **match: Any) -> list[Call]:
        return [
            c
            for c in self.calls
            if c.method == method and c.status == 200 and c.answer.get("ok")
            if all(c.args.get(k) == v for k, v in match.items())
        ]

    async def wait_for(self, predicate: Callable[[Call], bool], within: float = 15.0) -> Call:
        """The first recorded call matching `predicate`, waiting for it if need be."""

        def found() -> Call | None:
            return next((c for c in self.calls if predicate(c)), None)

        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: found() is not None)
        call = found()
        assert call is not None
        return call

    async def next_call(self, within: float) -> bool:
        """Wait until another call is recorded; False if none came within `within` s."""
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait()
        except TimeoutError:
            return False
        return True

    def thread(self, channel: str, ts: str) -> list[str]:
        """The texts of the replies in one thread, in order."""
        return [
            c.text
            for c in self.called("chat.postMessage", channel=channel)
            if c.args.get("thread_ts") == ts
        ]

    # --- the API ------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        args = await _arguments(request)
        limit = self._limits.get(method)
        if limit and limit[0] > 0:  # refused before it does anything, as Slack does
            limit[0] -= 1
            status, answer = 429, {"ok": False, "error": "ratelimited"}
            headers = {"Retry-After": str(limit[1])}
        elif method in ("chat.postMessage", "chat.update") and args.get("channel") in self.blocked:
            status, answer = 429, {"ok": False, "error": "ratelimited"}
            headers = {"Retry-After": str(self.blocked_retry_after_s)}
        elif self._too_soon(method, args):
            self.violations += 1
            status, answer = 429, {"ok": False, "error": "ratelimited"}
            headers = {"Retry-After": "1"}
        else:
            status, answer = 200, self._answer(request, method, args)
            headers = {"x-oauth-scopes": ",".join(self.scopes)}
        await self._record(Call(method, args, time.monotonic(), status, answer))
        return web.json_response(answer, status=status, headers=headers)

    async def _respond(self, request: web.Request) -> web.Response:
        """A message to a response_url (JSON). Slack takes 5 within 30 minutes; after that,
        and for a URL it never issued, it answers 404 with the reason."""
        state = self._responses.get(request.match_info["id"])
        try:
            body = await request.json()
        except ValueError:
            body = {}
        args = dict(body) if isinstance(body, dict) else {}
        answer: dict[str, Any] = {"ok": True}
        status = 200
        if state is None:
            status, answer = 404, {"ok": False, "error": "invalid_url"}
        elif self.clock() - state["at"] > RESPONSE_URL_TTL_S:
            status, answer = 404, {"ok": False, "error": "expired_url"}
        elif state["uses"] >= RESPONSE_URL_USES:
            status, answer = 404, {"ok": False, "error": "used_url"}
        elif not args.get("text") and not args.get("blocks"):
            status, answer = 400, {"ok": False, "error": "no_text"}
        else:
            try:
                if "blocks" in args:
                    _check_blocks(args["blocks"])
                state["uses"] += 1
                args.update(channel=state["channel"], user=state["user"])
            except Refused as refused:
                status, answer = 400, {"ok": False, "error": refused.error}
        await self._record(Call("response_url", args, time.monotonic(), status, answer))
        return web.json_response(answer, status=status)

    def _too_soon(self, method: str, args: dict[str, Any]) -> bool:
        if self.post_interval_s is None or method != "chat.postMessage":
            return False
        channel, now = str(args.get("channel")), time.monotonic()
        last = self._last_post.get(channel)
        if last is not None and now - last < self.post_interval_s:
            return True
        self._last_post[channel] = now
        return False

    async def _record(self, call: Call) -> None:
        async with self._changed:
            self.calls.append(call)
            self._changed.notify_all()

    def _answer(self, request: web.Request, method: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            self._authorised(request)
            self._check_arguments(method, args)
            handler = getattr(self, "_" + method.replace(".", "_"), None)
            if handler is None:
                raise Refused("unknown_method")
            return {"ok": True, **handler(args)}
        except Refused as refused:
            answer: dict[str, Any] = {"ok": False, "error": refused.error}
            if refused.details:
                answer["response_metadata"] = {"messages": refused.details}
            return answer

    def _authorised(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        if not header:
            raise Refused("not_authed")
        if header != f"Bearer {self.token}":
            raise Refused("invalid_auth")

    def _check_arguments(self, method: str, args: dict[str, Any]) -> None:
        spec = self.methods.get(method)
        if spec is None:
            raise Refused("unknown_method")
        known = spec["args"]
        problems = [
            f"[ERROR] unknown argument: {name}"
            for name in args
            if name not in known and name not in ANY_METHOD
        ]
        problems += [
            f"[ERROR] missing required field: {name}"
            for name, arg in known.items()
            if arg.get("required") and name not in args
        ]
        if problems:
            raise Refused("invalid_arguments", *problems)
        if "blocks" in args:
            _check_blocks(args["blocks"])

    # --- methods --------------------------------------------------------------------

    def _auth_test(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"url": "https://fake.slack/", "team": "Fake", "team_id": "T0000001",
                "user": "deploybot", "user_id": "UBOT00001", "bot_id": "B0000001"}  # fmt: skip

    def _conversations_info(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = str(args["channel"])
        needed = "groups:read" if channel.startswith("G") else "channels:read"
        if needed not in self.scopes:
            raise Refused("missing_scope")
        if channel not in self.channels | self.outside:
            raise Refused("channel_not_found")
        member = channel in self.channels
        return {"channel": {"id": channel, "is_private": channel.startswith("G"),
                            "is_member": member, "name": channel.lower()}}  # fmt: skip

    def _channel(self, args: dict[str, Any]) -> str:
        """A channel the bot is in, or a member's id: Slack posts that in the app's
        direct conversation with them."""
        channel = str(args["channel"])
        if channel not in self.channels and channel not in self.users:
            raise Refused("channel_not_found")
        return channel

    def _chat_postMessage(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(args)
        if not args.get("text") and not args.get("blocks"):
            raise Refused("no_text")
        thread = args.get("thread_ts")
        if thread is not None and (channel, str(thread)) not in self.messages:
            raise Refused("thread_not_found")
        ts = f"{int(time.time())}.{next(self._ids):06d}"
        self.messages[(channel, ts)] = dict(args)
        return {"channel": channel, "ts": ts, "message": {"text": args.get("text", "")}}

    def _chat_update(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(args)
        key = (channel, str(args["ts"]))
        if key not in self.messages:
            raise Refused("message_not_found")
        self.messages[key].update(args)
        return {"channel": channel, "ts": args["ts"], "text": args.get("text", "")}

    def _chat_postEphemeral(self, args: dict[str, Any]) -> dict[str, Any]:
        self._channel(args)
        if str(args["user"]) not in self.users:
            raise Refused("user_not_found")
        return {"message_ts": f"{int(time.time())}.{next(self._ids):06d}"}

    def _views_open(self, args: dict[str, Any]) -> dict[str, Any]:
        trigger = str(args.get("trigger_id") or "")
        issued = self._triggers.pop(trigger, None)
        if issued is None:
            raise Refused("invalid_trigger_id")
        if time.monotonic() - issued > TRIGGER_TTL_S:
            raise Refused("expired_trigger_id")
        view_id = f"V{next(self._ids):08d}"
        return {"view": self._store_view(view_id, args["view"])}

    def _views_update(self, args: dict[str, Any]) -> dict[str, Any]:
        view_id = str(args.get("view_id") or "")
        current = self.views.get(view_id)
        if current is None:
            raise Refused("not_found")
        if args.get("hash") and args["hash"] != current["hash"]:
            raise Refused("hash_conflict")
        return {"view": self._store_view(view_id, args["view"])}

    def _views_publish(self, args: dict[str, Any]) -> dict[str, Any]:
        """A user's App Home: only a `home` view, to a member; `hash` as views.update."""
        user = str(args["user_id"])
        if user not in self.users:
            raise Refused("invalid_arguments", f"[ERROR] no such user: {user}")
        view = json.loads(args["view"]) if isinstance(args["view"], str) else args["view"]
        if view.get("type") != "home":
            raise Refused("invalid_arguments", "[ERROR] views.publish takes a view of type home")
        current = self.views.get(self.homes.get(user, ""))
        if args.get("hash") and (current is None or args["hash"] != current["hash"]):
            raise Refused("hash_conflict")
        view_id = self.homes.setdefault(user, f"V{next(self._ids):08d}")
        return {"view": self._store_view(view_id, view)}

    def home(self, user: str) -> dict[str, Any]:
        """The App Home last published for `user`."""
        return self.views[self.homes[user]]

    def _store_view(self, view_id: str, view: Any) -> dict[str, Any]:
        view = json.loads(view) if isinstance(view, str) else dict(view)
        try:
            View(**view).to_dict()
        except Exception as exc:
            raise Refused("invalid_arguments", f"[ERROR] invalid view: {exc}") from None
        stored = {**view, "id": view_id, "hash": f"h{next(self._ids)}", "state": {"values": {}}}
        self.views[view_id] = stored
        return stored

    def _users_info(self, args: dict[str, Any]) -> dict[str, Any]:
        if "users:read" not in self.scopes:
            raise Refused("missing_scope")
        user = self.users.get(str(args["user"]))
        if user is None:
            raise Refused("user_not_found")
        return {"user": user}

    def _usergroups_users_list(self, args: dict[str, Any]) -> dict[str, Any]:
        members = self.groups.get(str(args["usergroup"]))
        if members is None:
            raise Refused("no_such_subteam")
        return {"users": members}


async def _arguments(request: web.Request) -> dict[str, Any]:
    args: dict[str, Any] = dict(request.query)
    if request.method == "POST" and request.can_read_body:
        if request.content_type == "application/json":
            args.update(await request.json())
        else:
            args.update(dict(await request.post()))
    args.pop("token", None)  # a token in the body is the old way; the header is checked
    return args


def _check_blocks(blocks: Any) -> None:
    parsed = json.loads(blocks) if isinstance(blocks, str) else blocks
    if not isinstance(parsed, list):
        raise Refused("invalid_blocks_format")
    for item in parsed:
        try:
            block = Block.parse(item)
            if block is None:
                raise ValueError(f"unknown block {item!r}")
            block.to_dict()
        except Exception as exc:
            raise Refused("invalid_blocks", f"[ERROR] {exc}") from None
