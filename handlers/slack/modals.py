"""The deploy form and the settings modal (split from handlers/slack/interact.py): open
them at once with a "loading" view (trigger ids expire in 3 s), fill them with what the
backends offer, and act on a submission. A submitted form is kept in the inbox before the
ack, as a typed command is, so another process deploys it should this one die.

Like interact.py, this works on a `Host` (handlers/slack/host.py) and never imports
app.py."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from slack_bolt.context.ack.async_ack import AsyncAck
from slack_sdk.errors import SlackApiError

from bot.models.errors import UserError
from bot.models.notices import Received
from bot.requests.parsed import DeployArgs
from handlers.messages.core import accepted
from handlers.messages.lifecycle import quota_left
from handlers.messages.slack import (
    FORM_TITLE,
    SETTINGS_TITLE,
    address_in_flight,
    form_opened_elsewhere,
    name_in_flight,
    settings_saved,
)
from handlers.slack import form, views
from handlers.slack.catalog import Choice, discover, initial_choice
from handlers.slack.form import FORM_VIEW, SETTINGS_VIEW
from handlers.slack.host import Host

log = logging.getLogger("handlers.slack.interact")


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
        await bot.tell(channel, user, [form_opened_elsewhere()])
        return None
    return opened


async def open_form(bot: Host, trigger: str, user: str, channel: str) -> None:
    """Open at once (trigger ids expire in 3 s), then fill in what the backends offer."""
    meta = form.metadata(channel)
    opened = await _open_loading(bot, trigger, user, channel, FORM_VIEW, FORM_TITLE)
    if opened is None:
        return
    prefs = await bot.deployer.prefs(user)
    choice = initial_choice(bot.settings, prefs)
    await _show_form(bot, opened["view"], choice, user, meta)


async def refresh_form(bot: Host, body: dict[str, Any], view: dict[str, Any]) -> None:
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
        return quota_left(await bot.deployer.quota_standing(user))
    except UserError as exc:
        log.warning("no quota line in %s's form: %s", user, exc.message)
        return None


async def submit_form(bot: Host, ack: AsyncAck, body: dict[str, Any], view: dict[str, Any]) -> None:
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
    await bot.deployer.inbox.receive(key, user, channel, form_body(result.args, result.keys))
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
    for job in await bot.deployer.queries.in_flight():
        if job.name == args.name.lower():
            errors[ids.get("name", "name")] = name_in_flight(job.name, job.id)
        if job.address == (args.address or "").split("/")[0]:
            errors[ids.get("address", "address")] = address_in_flight(job.address, job.id)
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
        return [accepted(job)]

    await bot.answering(channel, user, work())
    await bot.deployer.inbox.done(key)


# --- the settings modal ---------------------------------------------------------------


async def open_settings(bot: Host, trigger: str, user: str, channel: str) -> None:
    meta = form.metadata(channel)
    opened = await _open_loading(bot, trigger, user, channel, SETTINGS_VIEW, SETTINGS_TITLE)
    if opened is None:
        return
    catalog = await discover(bot.deployer, Choice())
    bot.catalog = catalog
    prefs = await bot.deployer.prefs(user)
    view = form.settings_view(catalog, prefs, meta)
    await bot.client.views_update(
        view_id=opened["view"]["id"], hash=opened["view"].get("hash"), view=view
    )


async def save_settings(
    bot: Host,
    body: dict[str, Any],
    view: dict[str, Any],
    keys: tuple[str, ...],
    template: str | None,
) -> None:
    user = str(body["user"]["id"])
    channel = str(json.loads(view.get("private_metadata") or "{}").get("channel", ""))

    async def work() -> list[str]:
        return [settings_saved(await bot.deployer.save_prefs(user, keys, template))]

    await bot.answering(channel, user, work())
