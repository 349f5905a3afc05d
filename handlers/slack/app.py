"""The Slack front end: a Bolt `AsyncApp` whose listeners drive the same core as the shell.

Every listener acknowledges first (Slack allows 3 s, and a hypervisor may take longer to
answer a single question), using only what needs no hypervisor: the grammar, the
configuration, the store. The rest runs afterwards in a task the bot keeps a reference
to, and answers the person with an ephemeral message. Deploys themselves go on the
core's job queue; their threads are handlers/slack/threads.py. Redelivered commands and
clicks are recognised by Slack's own ids (trigger_id, action_ts, view id), which the core
stores in the same transaction as the job or the decision they would create.

Approvals and the other buttons are in handlers/slack/interact.py, the form and the
settings modal in handlers/slack/modals.py; interact registers their listeners on this
bot through the small `Host` protocol (handlers/slack/host.py, so neither imports this
module); starting the bot (tokens, Socket Mode, HTTP mode) is in
handlers/slack/serve.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from slack_bolt.async_app import AsyncApp
from slack_bolt.context.ack.async_ack import AsyncAck
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import AsyncRateLimitErrorRetryHandler
from slack_sdk.web.async_client import AsyncWebClient

from bot.app.service import Deployer
from bot.chat import inbox
from bot.jobs import logfields
from bot.models.errors import UsageError, UserError
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs, ListVMs, ShowSettings
from handlers.commands import COMMANDS, Invocation, SlackWay, plain
from handlers.messages.core import INTERNAL_ERROR
from handlers.messages.slack import COMMAND_RESUMED, STORE_NOT_ANSWERING
from handlers.messages.text import Said, escape
from handlers.slack import interact, modals, views
from handlers.slack.catalog import Catalog
from handlers.slack.home import HomeTabs
from handlers.slack.pacing import TIER_4_PER_MINUTE, Pacer
from handlers.slack.respond import ResponseUrls
from handlers.slack.threads import SlackThreads

log = logging.getLogger(__name__)

# Slack's own view of a command: (command, user, channel, trigger_id, response_url).
OwnView = Callable[[Any, str, str, str, str | None], Coroutine[Any, Any, None]]


def make_client(token: str, base_url: str) -> AsyncWebClient:
    """A Web API client that waits out 429s (Retry-After) before giving up."""
    client = AsyncWebClient(token=token, base_url=base_url)
    client.retry_handlers.append(AsyncRateLimitErrorRetryHandler(max_retry_count=2))
    return client


class GroupDirectory:
    """Members of Slack user groups (approver groups), cached for `ttl_s`."""

    def __init__(self, client: AsyncWebClient, ttl_s: float) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}

    async def members(self, group: str) -> frozenset[str]:
        cached = self._cache.get(group)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        answer = await self.client.usergroups_users_list(usergroup=group)
        users = frozenset(str(u) for u in answer.get("users") or [])
        self._cache[group] = (time.monotonic() + self.ttl_s, users)
        return users


class SlackBot:
    """The app, its listeners, and the tasks they start after acknowledging."""

    def __init__(
        self,
        deployer: Deployer,
        threads: SlackThreads,
        client: AsyncWebClient,
        *,
        signing_secret: str | None,
    ) -> None:
        self.deployer = deployer
        self.settings = deployer.settings
        self.threads = threads
        self.zones = threads.zones  # people's time zones, shared with the threads
        self.client = client
        self.directory = GroupDirectory(client, self.settings.slack.group_cache_s)
        deployer.groups.members = self.directory.members
        threads.bind(deployer)
        self.ephemeral = Pacer(TIER_4_PER_MINUTE, burst=20)
        self.response_urls = ResponseUrls()  # a command's own way to answer (respond.py)
        self.tasks: set[asyncio.Task[None]] = set()
        # The last look-up of templates, so external_select can answer inside its ack.
        self.catalog = Catalog()
        self.app = AsyncApp(
            client=client,
            signing_secret=signing_secret or "",
            # Socket Mode requests come over an authenticated socket and carry no signature.
            request_verification_enabled=signing_secret is not None,
            process_before_response=False,
        )
        self.app.command(self.settings.slack.command)(self.on_command)
        self.home = HomeTabs(deployer, client, self.spawn, self.zones)  # the App Home
        self.home.register(self.app)
        deployer.progress.listeners.append(self.home)
        interact.register(self)
        # The commands the registry says Slack shows in a view of its own (SlackWay.VIEW).
        self.own_views: dict[type[Any], OwnView] = {
            ShowSettings: self._settings_form,
            ListVMs: self._list_page,
        }

    # --- tasks and answers --------------------------------------------------------

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run work after the ack; the set keeps the task alive until it is done."""
        task = asyncio.create_task(self._guarded(work))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception:
            log.exception("a Slack listener task failed")

    async def settle(self, within_s: float | None = None) -> int:
        """Wait until every task started by a listener has finished (tests, shutdown).

        With `within_s` (a stopping server), tasks still going then are cancelled: their
        commands stay in the inbox (bot/chat/inbox.py), handed to another process when this
        runner stops. Answers wait for Slack's pace (100 a minute), so two hundred
        commands take two minutes to answer. Returns how many were cancelled."""
        try:
            async with asyncio.timeout(within_s):
                while self.tasks:
                    await asyncio.gather(*list(self.tasks), return_exceptions=True)
            return 0
        except TimeoutError:
            left = list(self.tasks)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            log.warning("stopping: %d command(s) left in the inbox for another process", len(left))
            return len(left)

    async def tell(
        self,
        channel: str,
        user: str,
        lines: Sequence[str | Said],
        *,
        monospace: bool = False,
        reply_url: str | None = None,
    ) -> None:
        """An ephemeral answer: only `user` sees it, in the channel they typed in. `lines`
        are plain text (errors quote what people typed), escaped here; only the people a
        `Said` names become mentions. `reply_url`: the command's response_url, tried first."""
        shown = [views.mrkdwn(line) for line in lines] or [" "]
        text = views.fit("\n".join(shown), 3000)
        blocks = views.answer(shown, monospace=monospace)
        try:
            if channel == user:  # a click in the App Home: their conversation with the app
                await self.client.chat_postMessage(channel=user, text=text, blocks=blocks)
                return
            if reply_url and await self.response_urls.send(reply_url, text, blocks):
                return
            await self.ephemeral.wait()  # a workspace-wide limit (Tier 4)
            await self.client.chat_postEphemeral(
                channel=channel, user=user, text=text, blocks=blocks
            )
        except SlackApiError as exc:
            log.error("could not answer %s in %s: %s", user, channel, exc.response.get("error"))

    async def show(
        self,
        channel: str,
        user: str,
        text: str,
        blocks: list[dict[str, Any]],
        *,
        reply_url: str | None = None,
    ) -> None:
        """An ephemeral message of Block Kit (a page of `/deploy list`)."""
        if reply_url and await self.response_urls.send(reply_url, views.fit(text, 3000), blocks):
            return
        await self.ephemeral.wait()  # a workspace-wide limit (Tier 4)
        try:
            await self.client.chat_postEphemeral(
                channel=channel, user=user, text=views.fit(text, 3000), blocks=blocks
            )
        except SlackApiError as exc:
            log.error("could not answer %s in %s: %s", user, channel, exc.response.get("error"))

    async def answering(
        self,
        channel: str,
        user: str,
        work: Coroutine[Any, Any, Sequence[str | Said]],
        *,
        mono: bool = False,
        reply_url: str | None = None,
    ) -> None:
        """Run `work` and tell the user its lines, or what went wrong."""
        lines: Sequence[str | Said]
        try:
            lines = await work
        except UserError as exc:
            lines = views.refusal(exc)
        except Exception:
            log.exception("a command by %s failed", user)
            lines = [INTERNAL_ERROR.format(log=self.settings.log_file)]
            mono = False
        await self.tell(channel, user, lines, monospace=mono, reply_url=reply_url)

    # --- /deploy ------------------------------------------------------------------

    async def _settings_form(
        self, command: ShowSettings, user: str, channel: str, trigger: str, reply_url: str | None
    ) -> None:
        await modals.open_settings(self, trigger, user, channel)

    async def _list_page(
        self, command: ListVMs, user: str, channel: str, trigger: str, reply_url: str | None
    ) -> None:
        await interact.show_list(self, channel, user, command, reply_url=reply_url)

    async def on_command(self, ack: AsyncAck, body: dict[str, Any]) -> None:
        user, channel = str(body["user_id"]), str(body["channel_id"])
        text = views.typed(str(body.get("text") or ""))  # kept and parsed as typed
        trigger = str(body.get("trigger_id") or "")
        reply_url = str(body.get("response_url") or "") or None
        if reply_url:
            self.response_urls.note(reply_url)
        if not text.strip():
            await ack()
            self.spawn(modals.open_form(self, trigger, user, channel))
            return
        try:
            command = parse(text)
            spec = COMMANDS.of(command)
        except UserError as exc:  # the grammar's, or a command nobody registered
            problem: str | None = exc.message
        else:
            problem = spec.check(command) if spec.check else None
        if problem:  # answered at once: it needs no look-up
            await _answer_in_ack(ack, problem, [problem])
            self.spawn(self.deployer.audit(user, "command", problem))
            return
        if spec.slack is SlackWay.IN_ACK:
            lines = plain(await spec.run(Invocation(self.deployer, user), command))
            await _answer_in_ack(ack, lines[0], lines)
            return
        if spec.slack is SlackWay.VIEW:  # a form or a page: nothing to keep for another process
            await ack()
            self.spawn(self.own_views[spec.type](command, user, channel, trigger, reply_url))
            return
        key = f"command:{trigger}"
        try:  # kept before the ack: should this process die, another carries it out
            await self.deployer.inbox.receive(key, user, channel, text)
        except inbox.NotKept as exc:  # refused within Slack's 3 s, and never run later
            log.warning("refused a command by %s: the database is not answering (%s)", user, exc)
            await _answer_in_ack(ack, STORE_NOT_ANSWERING, [STORE_NOT_ANSWERING])
            return
        except Exception:
            log.exception("could not keep a command by %s", user)
            problem = INTERNAL_ERROR.format(log=self.settings.log_file)
            await _answer_in_ack(ack, problem, [problem])
            return
        await ack()
        # A redelivery too: its dedupe key makes it answer with the job already made.
        self.spawn(self.carry_out(key, command, user, channel, reply_url=reply_url))

    async def carry_out(
        self,
        key: str,
        command: object,  # a Command; one nobody registered is refused (handlers/commands.py)
        user: str,
        channel: str,
        *,
        resumed: bool = False,
        reply_url: str | None = None,
    ) -> None:
        """Run a kept command, answer the person (through `reply_url`, the command's
        response_url, when it still takes one), and strike it from the inbox. A command
        `resumed` from a stopped process that made a job also says so in its thread."""
        logfields.bind(request=key)
        invocation = Invocation(
            self.deployer,
            user,
            key=key,
            origin=channel,
            slack=True,
            zone=lambda: self.zones.of(user),  # lease ends in the reader's zone
        )
        spec = COMMANDS.find(command)
        work = COMMANDS.reply(invocation, command)  # a command nobody registered: refused
        mono = spec is not None and spec.table
        await self.answering(channel, user, work, mono=mono, reply_url=reply_url)
        if resumed and isinstance(command, DeployArgs):
            await self.deployer.inbox.tell_resumed(key, COMMAND_RESUMED)
        await self.deployer.inbox.done(key)

    async def sweep_inbox(self) -> int:
        """Carry out the commands that a dead process took and never answered; how many
        were found (each runs in a task of its own)."""
        found = await self.deployer.inbox.orphans()
        for item in found:
            if modals.resume_form(self, item):
                continue
            log.info(
                "carrying out %s's command %s, left by a process that stopped", item.user, item.key
            )
            try:
                command = parse(item.text)
            except (UsageError, ValueError):  # it parsed when it came: nothing to redo
                await self.deployer.inbox.done(item.key)
                continue
            self.spawn(self.carry_out(item.key, command, item.user, item.channel, resumed=True))
        return len(found)

    async def sweeping(self) -> None:
        """`sweep_inbox` every ownership tick, for as long as the bot serves."""
        while True:
            await asyncio.sleep(self.settings.ownership.tick_s)
            try:
                await self.sweep_inbox()
            except Exception:
                log.exception("looking for commands left by stopped processes failed")


async def _answer_in_ack(ack: AsyncAck, text: str, lines: Sequence[str]) -> None:
    """An ephemeral answer inside the ack (`text` is the notification), for what needs
    no look-up. Both quote what was typed, so they are escaped; no mentions are added,
    since a user id in them is one the person typed, not one the bot names."""
    shown = [escape(line) for line in lines]
    await ack(response_type="ephemeral", text=escape(text), blocks=views.answer(shown))
