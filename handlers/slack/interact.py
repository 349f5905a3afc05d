"""Buttons and modals: Approve / Reject, the deploy form, the settings modal.

Same rule as the command: acknowledge first, with only what needs no hypervisor (the
form's field errors come from the configuration), then do the work in a kept task. The
core decides approvals; the buttons only ask it.

Everything here works on a `Host`: the few things of the bot (handlers/slack/app.py)
these listeners use. `SlackBot` is one; naming only these keeps this module from
importing app.py, which imports this one to register the listeners.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from slack_bolt.async_app import AsyncApp
from slack_bolt.context.ack.async_ack import AsyncAck
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot import inbox
from bot.errors import DeployBotError, Duplicate
from bot.models import ACTIVE_STATES, Job, Received, utcnow
from bot.parser import DeployArgs, ListVMs
from bot.service import Deployer
from bot.settings import Settings
from handlers import messages
from handlers.commands import list_page
from handlers.slack import form, views
from handlers.slack.catalog import Catalog, Choice, discover, initial_choice, template_options
from handlers.slack.form import FORM_VIEW, SETTINGS_VIEW
from handlers.slack.home import HomeTabs

log = logging.getLogger(__name__)
FORM_ACTIONS = re.compile(r"^(template|placement|storage)$")


class Host(Protocol):
    """What the listeners need of the bot that registers them."""

    app: AsyncApp
    deployer: Deployer
    settings: Settings
    client: AsyncWebClient
    catalog: Catalog  # the last look-up of templates, kept for external_select
    home: HomeTabs  # the App Home, published again after a click on its buttons

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` after the ack, in a task the host keeps until it is done."""
        ...

    async def tell(
        self, channel: str, user: str, lines: Sequence[str], *, monospace: bool = False
    ) -> None:
        """An ephemeral answer to `user`."""
        ...

    async def answering(
        self, channel: str, user: str, work: Coroutine[Any, Any, list[str]], *, mono: bool = False
    ) -> None:
        """Run `work` and tell the user its lines, or what went wrong."""
        ...

    async def show(self, channel: str, user: str, text: str, blocks: list[dict[str, Any]]) -> None:
        """An ephemeral message of Block Kit to `user` (`text`: its notification)."""
        ...


def register(bot: Host) -> None:
    app = bot.app

    async def on_approve(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        bot.spawn(_approve(bot, body))

    async def on_reject(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        bot.spawn(_ask_reason(bot, body))

    async def on_reason(ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
        reason = form.value(form.state_values(view).get("reason"))
        if not reason:
            await ack(response_action="errors", errors={"reason": messages.reason_required()})
            return
        await ack()
        bot.spawn(_reject(bot, body, view, reason))

    async def on_form_change(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        view = body.get("view") or {}
        if view.get("callback_id") == FORM_VIEW:
            bot.spawn(_refresh_form(bot, body, view))

    async def on_template_options(ack: AsyncAck, body: dict[str, Any]) -> None:
        # Answered from what the form already looked up: no hypervisor call before ack.
        query = str(body.get("value") or "")
        await ack(options=template_options(bot.catalog, query))

    async def on_form(ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
        await _submit_form(bot, ack, body, view)

    async def on_settings(ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
        keys, template, errors = form.read_settings(view)
        if errors:
            await ack(response_action="errors", errors=errors)
            return
        await ack()
        bot.spawn(_save_settings(bot, body, view, keys, template))

    async def on_destroy(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        bot.spawn(_destroy(bot, body))

    async def on_extend(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        bot.spawn(_extend(bot, body))

    async def on_list_page(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        action = body["actions"][0]
        wanted = json.loads(str(action["value"]))
        user, channel = _clicker(body)
        command = ListVMs(everyone=wanted["user"] is None, user=wanted["user"], page=wanted["page"])
        bot.spawn(show_list(bot, channel, user, command))

    app.action(views.DESTROY)(on_destroy)
    app.action(views.LEASE_EXTEND)(on_extend)
    app.action(re.compile(rf"^{views.LIST_PAGE}_"))(on_list_page)
    app.action(views.APPROVE)(on_approve)
    app.action(views.REJECT)(on_reject)
    app.view(views.REJECT_VIEW)(on_reason)
    app.action(FORM_ACTIONS)(on_form_change)
    app.options("template")(on_template_options)
    app.view(FORM_VIEW)(on_form)
    app.view(SETTINGS_VIEW)(on_settings)


# --- approvals ----------------------------------------------------------------------


def _clicker(body: dict[str, Any]) -> tuple[str, str]:
    """(who clicked, the channel of the message). A click in the App Home has no
    channel: the answer goes to the person's own conversation with the app."""
    container = body.get("container") or {}
    channel = (body.get("channel") or {}).get("id") or container.get("channel_id", "")
    user = str(body["user"]["id"])
    return user, str(channel or user)


def _after_home_click(bot: Host, body: dict[str, Any]) -> None:
    """A button of the App Home was pressed: show the person what it changed."""
    if (body.get("view") or {}).get("type") == "home":
        bot.home.refresh(str(body["user"]["id"]), opened=True)


def _click(body: dict[str, Any]) -> tuple[str, str, str, str]:
    """(job id, clicker, channel, dedupe key) of a button click."""
    action = body["actions"][0]
    user, channel = _clicker(body)
    return str(action["value"]), user, channel, f"click:{action['action_ts']}:{user}"


# --- destroy and list -----------------------------------------------------------------


async def _destroy(bot: Host, body: dict[str, Any]) -> None:
    """The Destroy button (a thread's parent, a row of the list): the core decides."""
    try:
        await _job_click(
            bot, body, "destroy", bot.deployer.request_destroy, messages.destroy_answer
        )
    finally:
        _after_home_click(bot, body)


async def _extend(bot: Host, body: dict[str, Any]) -> None:
    """A lease reminder's Extend button: one `[leases] step`, up to the maximum."""
    await _job_click(bot, body, "extend", bot.deployer.extend_lease, messages.lease_extended_answer)


async def _job_click(
    bot: Host,
    body: dict[str, Any],
    what: str,
    act: Callable[..., Awaitable[Job]],
    answer: Callable[[Job], str],
) -> None:
    """A button that acts on its job once (its click is the dedupe key): a redelivery
    is ignored, a refusal is told to the person who clicked, and so is the outcome."""
    job_id, user, channel, key = _click(body)
    try:
        job = await act(job_id, user, dedupe_key=key)
    except Duplicate:
        log.info("ignored a redelivered %s click on %s", what, job_id)
        return
    except DeployBotError as exc:
        await bot.tell(channel, user, [exc.message])
        return
    await bot.tell(channel, user, [answer(job)])


async def show_list(bot: Host, channel: str, user: str, command: ListVMs) -> None:
    """`/deploy list` (and its Previous / Next buttons) as Block Kit, only for `user`."""
    try:
        page = await list_page(bot.deployer, user, command)
    except DeployBotError as exc:
        await bot.tell(channel, user, [exc.message])
        return
    text = messages.list_title(page, user) if page.jobs else messages.list_empty(page, user)
    await bot.show(channel, user, views.mrkdwn(text), views.vm_list(page, user, utcnow()))


def _is_build(item_id: str) -> bool:
    """A card's button names a template build (`b...`) or a job (`j...`)."""
    return item_id.startswith("b")


async def _approve(bot: Host, body: dict[str, Any]) -> None:
    job_id, user, channel, key = _click(body)
    try:
        if _is_build(job_id):  # one compare-and-set on the build decides (bot/builds/)
            await bot.deployer.decide_build(job_id, user, True, dedupe_key=key)
        else:
            await bot.deployer.approve(job_id, user, dedupe_key=key)
    except Duplicate:
        log.info("ignored a redelivered approval click on %s", job_id)
    except DeployBotError as exc:
        await bot.tell(channel, user, [exc.message])
    _after_home_click(bot, body)


async def _ask_reason(bot: Host, body: dict[str, Any]) -> None:
    """Refuse at once whoever may not decide; otherwise ask for the reason in a modal."""
    job_id, user, channel, _key = _click(body)
    try:
        if _is_build(job_id):
            await bot.deployer.may_decide_build(job_id, user)
        else:
            await bot.deployer.may_decide(job_id, user)
    except DeployBotError as exc:
        await bot.tell(channel, user, [exc.message])
        return
    modal = views.reject_modal(job_id, {"channel": channel})
    await bot.client.views_open(trigger_id=str(body["trigger_id"]), view=modal)


async def _reject(bot: Host, body: dict[str, Any], view: dict[str, Any], reason: str) -> None:
    meta = json.loads(view.get("private_metadata") or "{}")
    user = str(body["user"]["id"])
    try:
        if _is_build(str(meta["job_id"])):
            await bot.deployer.decide_build(
                str(meta["job_id"]), user, False, reason, dedupe_key=f"view:{view['id']}"
            )
        else:
            await bot.deployer.reject(
                str(meta["job_id"]), user, reason, dedupe_key=f"view:{view['id']}"
            )
    except Duplicate:
        log.info("ignored a redelivered rejection of %s", meta.get("job_id"))
    except DeployBotError as exc:
        await bot.tell(str(meta.get("channel", "")), user, [exc.message])
    bot.home.refresh(user)  # the card leaves their App Home, if they use it here


# --- the deploy form ------------------------------------------------------------------


async def _open_loading(
    bot: Host, trigger: str, user: str, channel: str, callback_id: str, title: str
) -> Any | None:
    """Open a "loading" modal at once (trigger ids expire in 3 s and work once); the
    caller fills it with views.update. None, with the user told, when Slack refused."""
    meta = form.metadata(channel)
    loading = views.loading_modal(callback_id, title, meta)
    try:
        opened = await bot.client.views_open(trigger_id=trigger, view=loading)
    except SlackApiError as exc:
        log.error("views.open failed: %s", exc.response.get("error"))
        await bot.tell(channel, user, [messages.form_opened_elsewhere()])
        return None
    return opened


async def open_form(bot: Host, trigger: str, user: str, channel: str) -> None:
    """Open at once (trigger ids expire in 3 s), then fill in what the backends offer."""
    meta = form.metadata(channel)
    opened = await _open_loading(bot, trigger, user, channel, FORM_VIEW, messages.FORM_TITLE)
    if opened is None:
        return
    prefs = await bot.deployer.prefs(user)
    choice = initial_choice(bot.settings, prefs)
    await _show_form(bot, opened["view"], choice, user, meta)


async def _refresh_form(bot: Host, body: dict[str, Any], view: dict[str, Any]) -> None:
    """A template, place or storage was chosen: update storage, networks, clone mode."""
    user = str(body["user"]["id"])
    await _show_form(bot, view, form.choice_of(view), user, view["private_metadata"])


async def _show_form(bot: Host, view: dict[str, Any], choice: Choice, user: str, meta: str) -> None:
    catalog = await discover(bot.deployer, choice)
    bot.catalog = catalog
    prefs = await bot.deployer.prefs(user)
    modal = form.form_view(bot.settings, catalog, choice, prefs, meta, await _quota_left(bot, user))
    try:
        await bot.client.views_update(view_id=view["id"], hash=view.get("hash"), view=modal)
    except SlackApiError as exc:
        # hash_conflict: the person changed something meanwhile; that update wins.
        log.info("views.update skipped: %s", exc.response.get("error"))


async def _quota_left(bot: Host, user: str) -> str | None:
    """The form's quota line; without it when the quota cannot be read now (the
    request is checked anyway when it is submitted)."""
    try:
        return messages.quota_left(await bot.deployer.quota_standing(user))
    except DeployBotError as exc:
        log.warning("no quota line in %s's form: %s", user, exc.message)
        return None


async def _submit_form(
    bot: Host, ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]
) -> None:
    user = str(body["user"]["id"])
    result = form.read_form(view, bot.settings, user)
    if result.args is not None:
        result.errors.update(await _held(bot, result.args, view))
    if result.errors or result.args is None:
        await ack(response_action="errors", errors=result.errors)
        bot.spawn(bot.deployer.audit(user, "form", "; ".join(result.errors.values())))
        return
    channel = str(json.loads(view.get("private_metadata") or "{}").get("channel", ""))
    key = f"view:{view['id']}"
    # Kept before the ack, as a command is: should this process die, another deploys it.
    await inbox.receive(bot.deployer, key, user, channel, form_body(result.args, result.keys))
    await ack()
    bot.spawn(_deploy_from_form(bot, result.args, result.keys, user, channel, key))


FORM = "form:"  # an inbox entry's text that is a submitted form, not a typed command


def form_body(args: DeployArgs, keys: tuple[str, ...]) -> str:
    return FORM + json.dumps({"args": dataclasses.asdict(args), "keys": list(keys)})


def resume_form(bot: Host, item: Received) -> bool:
    """Deploy a kept form submission left by a stopped process; False if `item` is not
    one (it is a typed command)."""
    if not item.text.startswith(FORM):
        return False
    data = json.loads(item.text.removeprefix(FORM))
    fields = data["args"]
    args = DeployArgs(**{**fields, "given": tuple(fields.get("given", ()))})
    keys = tuple(data["keys"])
    bot.spawn(_deploy_from_form(bot, args, keys, item.user, item.channel, item.key))
    return True


async def _held(bot: Host, args: DeployArgs, view: dict[str, Any]) -> dict[str, str]:
    """Name or address held by a job in flight: a store read, answered inside the ack."""
    ids = form.block_ids(view)
    errors: dict[str, str] = {}
    for job in await bot.deployer.store.jobs_in(ACTIVE_STATES):
        if job.name == args.name.lower():
            errors[ids.get("name", "name")] = messages.name_in_flight(job.name, job.id)
        if job.address == (args.address or "").split("/")[0]:
            errors[ids.get("address", "address")] = messages.address_in_flight(job.address, job.id)
    return errors


async def _deploy_from_form(
    bot: Host, args: DeployArgs, keys: tuple[str, ...], user: str, channel: str, key: str
) -> None:
    async def work() -> list[str]:
        job = await bot.deployer.request_deploy(
            args,
            user,
            ssh_keys=keys,
            origin=channel,
            dedupe_key=key,
            check_free_first=True,
        )
        return [messages.accepted(job)]

    await bot.answering(channel, user, work())
    await inbox.done(bot.deployer, key)


# --- the settings modal ---------------------------------------------------------------


async def open_settings(bot: Host, trigger: str, user: str, channel: str) -> None:
    meta = form.metadata(channel)
    opened = await _open_loading(
        bot, trigger, user, channel, SETTINGS_VIEW, messages.SETTINGS_TITLE
    )
    if opened is None:
        return
    catalog = await discover(bot.deployer, Choice())
    bot.catalog = catalog
    prefs = await bot.deployer.prefs(user)
    view = form.settings_view(catalog, prefs, meta)
    await bot.client.views_update(
        view_id=opened["view"]["id"], hash=opened["view"].get("hash"), view=view
    )


async def _save_settings(
    bot: Host,
    body: dict[str, Any],
    view: dict[str, Any],
    keys: tuple[str, ...],
    template: str | None,
) -> None:
    user = str(body["user"]["id"])
    channel = str(json.loads(view.get("private_metadata") or "{}").get("channel", ""))

    async def work() -> list[str]:
        return [messages.settings_saved(await bot.deployer.save_prefs(user, keys, template))]

    await bot.answering(channel, user, work())
