"""The command registry: every `/deploy` command, declared once, for every front end.

A command is its words and arguments (the dataclass in bot/requests/parsed.py, parsed by
bot/requests/grammar.py, whose usage line is `USAGES[words]`), and here one `Spec`: who may run
it, its handler, and how Slack shows it. The shell (handlers/terminal.py), Slack
(handlers/slack/app.py) and the CLI where it offers the same command (handlers/entry.py:
`list`, `lease extend`) all dispatch through `COMMANDS`, and `help` is generated from
it; a command missing here is answered with the same message everywhere.

Who may run a command is declared for `help`; the core enforces it (bot/approvals/decisions.py,
bot/kinds/deploy/destroy.py, bot/leases/enforce.py, ...), because most rules need the job
(its requester).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, tzinfo
from typing import Any, Generic, TypeVar

from backends.migrating import Scope
from bot.app.queries import VMPage
from bot.app.service import Deployer
from bot.kinds import Rows
from bot.models import DESTROY_STATES, JobState, utcnow
from bot.models.errors import JobNotFound, UserError
from bot.models.keys import check_ssh_key
from bot.requests.grammar import USAGES, parse
from bot.requests.parsed import (
    Approve,
    BuildTemplate,
    Cancel,
    DeployArgs,
    Destroy,
    ExtendLease,
    Help,
    History,
    KnownHosts,
    ListVMs,
    MigrateApply,
    MigratePlan,
    Reject,
    SaveKey,
    ShowSettings,
    SshCa,
    Status,
    TemplateProfiles,
    Templates,
)
from handlers.messages import usage
from handlers.messages.builds import (
    build_accepted,
    build_cancelling,
    build_decided_answer,
    build_status,
    profiles_table,
)
from handlers.messages.core import (
    INTERNAL_ERROR,
    accepted,
    approve_answer,
    cancelling,
    reject_answer,
)
from handlers.messages.destroys import destroy_answer
from handlers.messages.hostkeys import (
    authority_answer,
    known_hosts_answer,
    no_key_recorded,
    not_ready,
)
from handlers.messages.lifecycle import lease_extended_answer
from handlers.messages.listing import list_lines
from handlers.messages.migration import CHAT_FINDINGS, applied_lines, kept_plan_lines
from handlers.messages.reports import history, status_said, templates
from handlers.messages.slack import bad_ssh_key, key_saved, slack_reject_answer, user_settings
from handlers.messages.text import Said

log = logging.getLogger(__name__)

Reply = Sequence[str | Said]


class Who(enum.Enum):
    """Who may run a command, as the core decides it."""

    ANYONE = "anyone"
    DEPLOYERS = "deployers"  # everyone unless approval.deployers names them
    APPROVERS = "approvers"  # never on their own request
    APPROVERS_ONLY = "approvers only"  # what an approver asks for (a migration)
    REQUESTER_OR_APPROVERS = "requester or approvers"
    OWNER_APPROVERS_DESTROYERS = "owner, approvers or destroyers"


class SlackWay(enum.Enum):
    """How Slack answers a command (it must acknowledge within 3 s)."""

    KEPT = "kept"  # kept in the inbox before the ack, carried out after it, answered
    IN_ACK = "in_ack"  # answered inside the ack: it needs no look-up
    VIEW = "view"  # Slack's own view of it, not kept (SlackBot.views: a form, a page)


async def _utc() -> tzinfo:
    return UTC


@dataclass(frozen=True)
class Invocation:
    """One person running one command, and what their front end adds to it."""

    deployer: Deployer
    user: str
    key: str | None = None  # Slack: the command's inbox key; a redelivery dedupes on it
    origin: str | None = None  # Slack: the channel a new job's thread goes to
    slack: bool = False  # Slack: check the name and address first; people as mentions
    zone: Callable[[], Awaitable[tzinfo]] = _utc  # the reader's time zone, asked if needed


C = TypeVar("C")


@dataclass(frozen=True)
class Spec(Generic[C]):
    """One command: the type `parse` returns for it, its words (`USAGES`' key), who may
    run it, and its handler, which returns the reply lines."""

    type: type[C]
    words: str
    who: Who
    run: Callable[[Invocation, C], Awaitable[Reply]]
    slack: SlackWay = SlackWay.KEPT
    table: bool = False  # its reply is a table: Slack sets it in monospace
    # A problem found without any look-up (Slack says it inside the ack), or None.
    check: Callable[[C], str | None] | None = None

    @property
    def usage(self) -> str:
        return USAGES[self.words]

    @property
    def keyword(self) -> str | None:
        """The first word a person types for it; None for the deploy (NAME first)."""
        return None if self.type is DeployArgs else self.words.split()[0]


class Registry:
    """The commands, in the order `help` lists them (the deploy first)."""

    def __init__(self, specs: Sequence[Spec[Any]]) -> None:
        self._specs = tuple(specs)
        self._by_type = {spec.type: spec for spec in specs}
        if len(self._by_type) != len(self._specs):
            raise ValueError("a command type is registered twice")

    def __iter__(self) -> Iterator[Spec[Any]]:
        return iter(self._specs)

    def find(self, command: object) -> Spec[Any] | None:
        return self._by_type.get(type(command))

    def of(self, command: object) -> Spec[Any]:
        """The spec of a parsed command; a command nobody registered is refused with
        the same message in every front end."""
        spec = self.find(command)
        if spec is None:
            log.error("no command registered for %s", type(command).__name__)
            raise UserError(usage.unknown_command())
        return spec

    async def reply(self, invocation: Invocation, command: object) -> Reply:
        return await self.of(command).run(invocation, command)

    def keywords(self) -> list[str]:
        """The first words of the commands, once each, in `help`'s order."""
        words = [spec.keyword for spec in self._specs if spec.keyword]
        return list(dict.fromkeys(words))

    def help(self) -> list[str]:
        return usage.help_lines([(s.words, s.usage, s.who.value) for s in self._specs])


# --- the handlers ---------------------------------------------------------------------


async def _deploy(inv: Invocation, command: DeployArgs) -> Reply:
    job = await inv.deployer.request_deploy(
        command, inv.user, origin=inv.origin, dedupe_key=inv.key, check_free_first=inv.slack
    )
    return [accepted(job)]


async def _help(inv: Invocation, command: Help) -> Reply:
    return COMMANDS.help()


async def _status(inv: Invocation, command: Status) -> Reply:
    return await (await _answers(inv, command.job_id)).status(inv, command)


async def _history(inv: Invocation, command: History) -> Reply:
    return history(await inv.deployer.history(command.limit))


async def _cancel(inv: Invocation, command: Cancel) -> Reply:
    return await (await _answers(inv, command.job_id)).cancel(inv, command)


async def _templates(inv: Invocation, command: Templates) -> Reply:
    """Every backend's templates, with what deploybot built of them."""
    found = await inv.deployer.templates()
    return templates(found, await inv.deployer.template_builds())


async def _approve(inv: Invocation, command: Approve) -> Reply:
    return await (await _answers(inv, command.job_id)).approve(inv, command)


async def _reject(inv: Invocation, command: Reject) -> Reply:
    return await (await _answers(inv, command.job_id)).reject(inv, command)


# --- what a job's record answers, looked up by its kind's rows (bot/kinds/) ------------


@dataclass(frozen=True)
class RowsAnswers:
    """How the commands that name a job answer for the record its kind keeps: a `Job`
    (deploys, and any kind keeping `jobs` rows) or a `Build` (its own table)."""

    status: Callable[[Invocation, Status], Awaitable[Reply]]
    cancel: Callable[[Invocation, Cancel], Awaitable[Reply]]
    approve: Callable[[Invocation, Approve], Awaitable[Reply]]
    reject: Callable[[Invocation, Reject], Awaitable[Reply]]


async def _job_status(inv: Invocation, command: Status) -> Reply:
    return status_said(await inv.deployer.status(command.job_id))


async def _job_cancel(inv: Invocation, command: Cancel) -> Reply:
    return [cancelling(await inv.deployer.cancel(command.job_id, inv.user))]


async def _job_approve(inv: Invocation, command: Approve) -> Reply:
    job = await inv.deployer.approve(command.job_id, inv.user, dedupe_key=inv.key)
    return [Said(approve_answer(job, inv.user), (inv.user,))]


async def _job_reject(inv: Invocation, command: Reject) -> Reply:
    d, reason = inv.deployer, command.reason
    job = await d.reject(command.job_id, inv.user, reason, dedupe_key=inv.key)
    return [slack_reject_answer(job) if inv.slack else reject_answer(job)]


async def _build_status(inv: Invocation, command: Status) -> Reply:
    return build_status(await inv.deployer.builds.get(command.job_id))


async def _build_cancel(inv: Invocation, command: Cancel) -> Reply:
    return [build_cancelling(await inv.deployer.cancel_build(command.job_id, inv.user))]


async def _build_approve(inv: Invocation, command: Approve) -> Reply:
    d = inv.deployer
    build = await d.decide_build(command.job_id, inv.user, True, dedupe_key=inv.key)
    return [build_decided_answer(build)]


async def _build_reject(inv: Invocation, command: Reject) -> Reply:
    d, reason = inv.deployer, command.reason
    build = await d.decide_build(command.job_id, inv.user, False, reason, dedupe_key=inv.key)
    return [build_decided_answer(build)]


ANSWERS: dict[Rows, RowsAnswers] = {
    "jobs": RowsAnswers(_job_status, _job_cancel, _job_approve, _job_reject),
    "builds": RowsAnswers(_build_status, _build_cancel, _build_approve, _build_reject),
}


async def _answers(inv: Invocation, ref: str) -> RowsAnswers:
    return ANSWERS[await inv.deployer.rows_of(ref)]


async def _key(inv: Invocation, command: SaveKey) -> Reply:
    return [key_saved(await inv.deployer.save_ssh_key(inv.user, command.text))]


def _key_problem(command: SaveKey) -> str | None:
    try:
        check_ssh_key(command.text)
    except ValueError as exc:
        return bad_ssh_key(str(exc))
    return None


async def _settings(inv: Invocation, command: ShowSettings) -> Reply:
    return user_settings(await inv.deployer.prefs(inv.user))


async def _destroy(inv: Invocation, command: Destroy) -> Reply:
    job = await inv.deployer.request_destroy(command.target, inv.user, dedupe_key=inv.key)
    return [destroy_answer(job)]


READY_STATES = DESTROY_STATES | {JobState.SUCCEEDED}  # a VM that was ready and is still there


async def _known_hosts(inv: Invocation, command: KnownHosts) -> Reply:
    job = await inv.deployer.vm_job(command.target)
    if job.state not in READY_STATES:
        raise JobNotFound(not_ready(job))
    if not job.host_key:
        raise JobNotFound(no_key_recorded(job))
    return known_hosts_answer(job)


async def _ssh_ca(inv: Invocation, command: SshCa) -> Reply:
    ca = inv.deployer.host_ca
    revoked = await inv.deployer.revoked_host_keys() if ca is not None else []
    return authority_answer(ca, revoked, cap=REVOKED_SHOWN)


REVOKED_SHOWN = 20  # @revoked lines in chat; `deploybot ssh-ca` prints them all
LIST_PER_PAGE = 10  # rows a page; Slack's Block Kit page stays far under 50 blocks


async def list_page(deployer: Deployer, user: str, command: ListVMs) -> VMPage:
    """The page `/deploy list` asks for: mine (default), all, or one person's."""
    whose = None if command.everyone else (command.user or user)
    return await deployer.list_vms(whose, command.page, LIST_PER_PAGE)


async def _list(inv: Invocation, command: ListVMs) -> Reply:
    page = await list_page(inv.deployer, inv.user, command)
    return list_lines(page, inv.user, utcnow())


async def _extend(inv: Invocation, command: ExtendLease) -> Reply:
    # A replayed command extends once (its key).
    job = await inv.deployer.extend_lease(
        command.target, inv.user, command.length_s, dedupe_key=inv.key
    )
    return [lease_extended_answer(job, await inv.zone())]


async def _build(inv: Invocation, command: BuildTemplate) -> Reply:
    build = await inv.deployer.request_build(
        command.profile,
        command.on,
        inv.user,
        placement=command.node,
        storage=command.storage,
        name=command.name,
        origin=inv.origin,  # Slack: its thread follows in this channel (threads.py)
    )
    return [build_accepted(build)]


async def _profiles(inv: Invocation, command: TemplateProfiles) -> Reply:
    return profiles_table(inv.deployer.settings.images.all_profiles())


async def _migrate_plan(inv: Invocation, command: MigratePlan) -> Reply:
    d = inv.deployer
    scope = Scope(folder=command.folder, name=command.name)
    kept, plan = await d.migrate_plan(command.source, command.target, scope, inv.user)
    return kept_plan_lines(kept, plan, d.settings.migration.plan_valid_s)


async def _migrate_apply(inv: Invocation, command: MigrateApply) -> Reply:
    outcome = await inv.deployer.migrate_apply(
        command.plan_id, inv.user, origin=inv.origin, dedupe_key=inv.key
    )
    ended = all(r.ended for r in outcome.rebuilds)
    return applied_lines(outcome, ends=ended, cap=CHAT_FINDINGS)


ANYONE, IN_ACK, VIEW = Who.ANYONE, SlackWay.IN_ACK, SlackWay.VIEW
COMMANDS = Registry(
    [
        Spec(DeployArgs, "deploy", Who.DEPLOYERS, _deploy),
        Spec(Help, "help", ANYONE, _help, slack=IN_ACK),
        Spec(Status, "status", ANYONE, _status, table=True),
        Spec(History, "history", ANYONE, _history, table=True),
        Spec(Cancel, "cancel", Who.REQUESTER_OR_APPROVERS, _cancel),
        Spec(Templates, "templates", ANYONE, _templates, table=True),
        Spec(Approve, "approve", Who.APPROVERS, _approve),
        Spec(Reject, "reject", Who.APPROVERS, _reject),
        Spec(SaveKey, "key", ANYONE, _key, check=_key_problem),
        Spec(ShowSettings, "settings", ANYONE, _settings, slack=VIEW),
        Spec(Destroy, "destroy", Who.OWNER_APPROVERS_DESTROYERS, _destroy),
        Spec(ListVMs, "list", ANYONE, _list, slack=VIEW),
        Spec(KnownHosts, "known-hosts", ANYONE, _known_hosts),
        Spec(SshCa, "ssh-ca", ANYONE, _ssh_ca),
        Spec(ExtendLease, "lease extend", Who.REQUESTER_OR_APPROVERS, _extend),
        Spec(BuildTemplate, "template build", Who.DEPLOYERS, _build),
        Spec(TemplateProfiles, "template profiles", ANYONE, _profiles, table=True),
        Spec(MigratePlan, "migrate plan", Who.APPROVERS_ONLY, _migrate_plan, table=True),
        Spec(MigrateApply, "migrate apply", Who.APPROVERS_ONLY, _migrate_apply, table=True),
    ]
)


async def answer(deployer: Deployer, user: str, text: str) -> list[str]:
    """Run the text after `/deploy` for `user` (the shell); always returns reply lines,
    never raises."""
    try:
        command = parse(text)
    except UserError as exc:
        return exc.message.splitlines()
    return await answer_command(deployer, user, command)


async def answer_command(deployer: Deployer, user: str, command: object) -> list[str]:
    """Carry out a parsed command (the shell); reply lines, never an exception."""
    try:
        return plain(await COMMANDS.reply(Invocation(deployer, user), command))
    except UserError as exc:
        return exc.message.splitlines()
    except Exception:
        log.exception("command %r by %s failed", command, user)
        return [INTERNAL_ERROR.format(log=deployer.settings.log_file)]


async def reply_text(deployer: Deployer, user: str, command: object) -> list[str]:
    """A command's reply as text lines (the CLI); errors propagate to its exit codes."""
    return plain(await COMMANDS.reply(Invocation(deployer, user), command))


def plain(lines: Reply) -> list[str]:
    """Reply lines as text, for a front end that shows no mentions."""
    return [line.text if isinstance(line, Said) else line for line in lines]
