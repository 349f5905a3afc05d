"""Buttons: Approve / Reject (of deploys, destroys and template builds), Destroy, Extend,
the list's pages; and the registration of every listener, the form's and the settings
modal's too (their work is in handlers/slack/modals.py).

Same rule as the command: acknowledge first, with only what needs no hypervisor (the
form's field errors come from the configuration), then do the work in a kept task. The
core decides approvals; the buttons only ask it.

Everything here works on a `Host` (handlers/slack/host.py): the few things of the bot
(handlers/slack/app.py) these listeners use. `SlackBot` is one; naming only these keeps
this module from importing app.py, which imports this one to register the listeners.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from slack_bolt.context.ack.async_ack import AsyncAck

from bot.models import Job, utcnow
from bot.models.errors import Duplicate, UserError
from bot.requests.parsed import ListVMs
from handlers.commands import list_page
from handlers.messages.destroys import destroy_answer
from handlers.messages.lifecycle import lease_extended_answer
from handlers.messages.listing import list_empty, list_title
from handlers.messages.slack import reason_required
from handlers.slack import form, views
from handlers.slack.catalog import template_options
from handlers.slack.form import FORM_VIEW, SETTINGS_VIEW
from handlers.slack.host import Host
from handlers.slack.modals import (
    refresh_form,
    save_settings,
    submit_form,
)

log = logging.getLogger(__name__)
FORM_ACTIONS = re.compile(r"^(template|placement|storage)$")


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
            await ack(response_action="errors", errors={"reason": reason_required()})
            return
        await ack()
        bot.spawn(_reject(bot, body, view, reason))

    async def on_form_change(ack: AsyncAck, body: dict[str, Any]) -> None:
        await ack()
        view = body.get("view") or {}
        if view.get("callback_id") == FORM_VIEW:
            bot.spawn(refresh_form(bot, body, view))

    async def on_template_options(ack: AsyncAck, body: dict[str, Any]) -> None:
        # Answered from what the form already looked up: no hypervisor call before ack.
        query = str(body.get("value") or "")
        await ack(options=template_options(bot.catalog, query))

    async def on_form(ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
        await submit_form(bot, ack, body, view)

    async def on_settings(ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
        keys, template, errors = form.read_settings(view)
        if errors:
            await ack(response_action="errors", errors=errors)
            return
        await ack()
        bot.spawn(save_settings(bot, body, view, keys, template))

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
        await _job_click(bot, body, "destroy", bot.deployer.request_destroy, destroy_answer)
    finally:
        _after_home_click(bot, body)


async def _extend(bot: Host, body: dict[str, Any]) -> None:
    """A lease reminder's Extend button: one `[leases] step`, up to the maximum."""
    zone = await bot.zones.of(_clicker(body)[0])  # the new end in the clicker's zone
    await _job_click(
        bot,
        body,
        "extend",
        bot.deployer.extend_lease,
        lambda job: lease_extended_answer(job, zone),
    )


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
    except UserError as exc:
        await bot.tell(channel, user, views.refusal(exc))
        return
    await bot.tell(channel, user, [answer(job)])


async def show_list(
    bot: Host, channel: str, user: str, command: ListVMs, *, reply_url: str | None = None
) -> None:
    """`/deploy list` (and its Previous / Next buttons) as Block Kit, only for `user`;
    `reply_url`: the command's response_url, tried first."""
    try:
        page = await list_page(bot.deployer, user, command)
    except UserError as exc:
        await bot.tell(channel, user, views.refusal(exc), reply_url=reply_url)
        return
    text = list_title(page, user) if page.jobs else list_empty(page, user)
    # Whose VMs: a requester of the jobs shown, so a person; no jobs, no proof of one.
    people = [page.requester] if page.jobs and page.requester else []
    zone = await bot.zones.of(user)  # lease ends in the reader's zone
    shown = views.mrkdwn(text, people)
    await bot.show(
        channel, user, shown, views.vm_list(page, user, utcnow(), zone), reply_url=reply_url
    )


async def _approve(bot: Host, body: dict[str, Any]) -> None:
    job_id, user, channel, key = _click(body)
    try:  # the job's kind decides (bot/kinds/): a deploy, its destroy, a build
        await bot.deployer.decide(job_id, user, True, dedupe_key=key)
    except Duplicate:
        log.info("ignored a redelivered approval click on %s", job_id)
    except UserError as exc:
        await bot.tell(channel, user, views.refusal(exc))
    _after_home_click(bot, body)


async def _ask_reason(bot: Host, body: dict[str, Any]) -> None:
    """Refuse at once whoever may not decide; otherwise ask for the reason in a modal."""
    job_id, user, channel, _key = _click(body)
    try:
        kind = await bot.deployer.kind_of(job_id)
        await bot.deployer.may_decide_any(job_id, user)
    except UserError as exc:
        await bot.tell(channel, user, views.refusal(exc))
        return
    modal = views.reject_modal(job_id, kind.noun, {"channel": channel})
    await bot.client.views_open(trigger_id=str(body["trigger_id"]), view=modal)


async def _reject(bot: Host, body: dict[str, Any], view: dict[str, Any], reason: str) -> None:
    meta = json.loads(view.get("private_metadata") or "{}")
    user = str(body["user"]["id"])
    try:
        await bot.deployer.decide(
            str(meta["job_id"]), user, False, reason, dedupe_key=f"view:{view['id']}"
        )
    except Duplicate:
        log.info("ignored a redelivered rejection of %s", meta.get("job_id"))
    except UserError as exc:
        await bot.tell(str(meta.get("channel", "")), user, views.refusal(exc))
    bot.home.refresh(user)  # the card leaves their App Home, if they use it here
