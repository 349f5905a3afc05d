"""Text commands to replies: the dispatch every text front end shares."""

from __future__ import annotations

import logging

from bot.errors import DeployBotError
from bot.models import utcnow
from bot.parser import (
    Approve,
    BuildTemplate,
    Cancel,
    Command,
    DeployArgs,
    Destroy,
    ExtendLease,
    Help,
    History,
    ListVMs,
    Reject,
    SaveKey,
    ShowSettings,
    Status,
    TemplateProfiles,
    Templates,
    parse,
)
from bot.service import Deployer, VMPage
from handlers import messages

log = logging.getLogger(__name__)


async def answer(deployer: Deployer, user: str, text: str) -> list[str]:
    """Run the text after `/deploy` for `user`; always returns reply lines, never raises."""
    try:
        return await run_command(deployer, user, parse(text))
    except DeployBotError as exc:
        return exc.message.splitlines()
    except Exception:
        log.exception("command %r by %s failed", text, user)
        return [messages.INTERNAL_ERROR.format(log=deployer.settings.log_file)]


async def run_command(deployer: Deployer, user: str, command: Command) -> list[str]:
    """Carry out a parsed command and word the reply; front ends that need more (Slack's
    delivery keys and mentions) handle those commands first and pass on the rest."""
    match command:
        case DeployArgs():
            job = await deployer.request_deploy(command, user)
            return [messages.accepted(job)]
        case Help():
            return messages.HELP.splitlines()
        case Status(job_id) if await deployer.rows_of(job_id) == "builds":  # a template build
            return [said.text for said in messages.build_status(await deployer.builds.get(job_id))]
        case Status(job_id):
            return messages.status(await deployer.status(job_id))
        case History(limit):
            return messages.history(await deployer.history(limit))
        case Cancel(job_id) if await deployer.rows_of(job_id) == "builds":  # a template build
            return [messages.build_cancelling(await deployer.cancel_build(job_id, user))]
        case Cancel(job_id):
            return [messages.cancelling(await deployer.cancel(job_id, user))]
        case Templates():
            return await templates_answer(deployer)
        case TemplateProfiles():
            return messages.profiles_table(deployer.settings.images.all_profiles())
        case BuildTemplate():
            build = await deployer.request_build(
                command.profile,
                command.on,
                user,
                placement=command.node,
                storage=command.storage,
                name=command.name,
            )
            return [messages.build_accepted(build)]
        case Approve(job_id) if await deployer.rows_of(job_id) == "builds":  # a template build
            return [messages.build_decided_answer(await deployer.decide_build(job_id, user, True))]
        case Reject(job_id, reason) if await deployer.rows_of(job_id) == "builds":
            build = await deployer.decide_build(job_id, user, False, reason)
            return [messages.build_decided_answer(build)]
        case Approve(job_id):
            job = await deployer.approve(job_id, user)
            return [messages.approve_answer(job, user)]
        case Reject(job_id, reason):
            job = await deployer.reject(job_id, user, reason)
            return [messages.reject_answer(job)]
        case SaveKey(text):
            return [messages.key_saved(await deployer.save_ssh_key(user, text))]
        case ShowSettings():
            return messages.user_settings(await deployer.prefs(user))
        case Destroy(target):
            return [messages.destroy_answer(await deployer.request_destroy(target, user))]
        case ExtendLease(target, length_s):
            job = await deployer.extend_lease(target, user, length_s)
            return [messages.lease_extended_answer(job)]
        case ListVMs():
            page = await list_page(deployer, user, command)
            return messages.list_lines(page, user, utcnow())
    return messages.HELP.splitlines()


async def templates_answer(deployer: Deployer) -> list[str]:
    """`/deploy templates`: every backend's templates, with what deploybot built of them."""
    found = await deployer.templates()
    return messages.templates(found, await deployer.template_builds())


LIST_PER_PAGE = 10  # rows a page; Slack's Block Kit page stays far under 50 blocks


async def list_page(deployer: Deployer, user: str, command: ListVMs) -> VMPage:
    """The page `/deploy list` asks for: mine (default), all, or one person's."""
    whose = None if command.everyone else (command.user or user)
    return await deployer.list_vms(whose, command.page, LIST_PER_PAGE)
