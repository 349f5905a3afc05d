"""The command registry (handlers/commands.py): every command declared once, `help`
generated from it, and the shell and Slack answering the same commands the same way."""

from __future__ import annotations

import html
import io
import typing
from dataclasses import dataclass
from pathlib import Path

from bot.models import JobState
from bot.requests.grammar import SUBCOMMAND_USAGE, USAGES
from bot.requests.parsed import Command
from handlers.commands import COMMANDS, SlackWay, Who, answer_command
from handlers.messages import usage
from handlers.slack.app import SlackBot
from handlers.terminal import Shell
from tests.support.deployer import TEST_KEY, deploy
from tests.support.slack.bot import ALICE, CHANNEL, slack_bot
from tests.support.slack.fake_api import Call

# What a person types for each registered command: answers that need no job, so the
# shell and Slack can be held to the same words. A command added to the registry needs
# a line here (the first test), and then both front ends must answer it.
EXAMPLES = {
    "deploy": "web01 10.0.0.500",
    "help": "help",
    "status": "status j4k7tqa2",
    "history": "history 5",
    "cancel": "cancel j4k7tqa2",
    "templates": "templates",
    "approve": "approve j4k7tqa2",
    "reject": "reject j4k7tqa2 use the staging subnet",
    "key": f"key {TEST_KEY}",
    "settings": "settings",
    "destroy": "destroy web99",
    "list": "list all",
    "known-hosts": "known-hosts web99",
    "ssh-ca": "ssh-ca",
    "lease extend": "lease extend web99 7d",
    "template build": "template build no-such-profile",
    "template profiles": "template profiles",
    "migrate plan": "migrate plan --from vcenter --to sim",
    "migrate apply": "migrate apply mnotaplan2",
}


def test_every_command_of_the_grammar_is_registered_once() -> None:
    specs = list(COMMANDS)
    assert {spec.type for spec in specs} == set(typing.get_args(Command))
    assert [spec.words for spec in specs] == list(USAGES)  # help's order is the grammar's
    assert set(COMMANDS.keywords()) == set(SUBCOMMAND_USAGE)
    assert set(EXAMPLES) == {spec.words for spec in specs}
    assert set(usage.SUMMARIES) == {spec.words for spec in specs}


def test_help_lists_every_registered_command_with_who_may_run_it() -> None:
    lines = COMMANDS.help()
    for spec in COMMANDS:
        (line,) = [line for line in lines if line.strip().startswith(f"{spec.usage}")]
        said = lines[lines.index(line) - 1] + line  # the deploy's header is the line before
        assert usage.SUMMARIES[spec.words] in said
        if spec.who is not Who.ANYONE:
            assert f"(only {usage.WHO[spec.who.value]})" in said
    assert "(only approvers, not on their own request)" in "\n".join(lines)


def ephemerals(calls: list[Call], since: int) -> list[str]:
    return [c.text for c in calls[since:] if c.method == "chat.postEphemeral"]


async def test_slack_and_the_shell_answer_every_command_alike(tmp_path: Path) -> None:
    """One registry behind both: each command typed in the shell and in Slack gets the
    same words back (Slack escapes them; a view of its own is Slack's only difference)."""
    async with slack_bot(tmp_path) as h:
        out = io.StringIO()
        shell = Shell(h.deployer, ALICE, out)
        for spec in COMMANDS:
            example = EXAMPLES[spec.words]
            said = out.tell()
            await shell.handle(f"/deploy {example}")
            shell_lines = [line.removeprefix("bot: ") for line in out.getvalue()[said:].split("\n")]
            shell_text = "\n".join(line for line in shell_lines if line)
            seen = len(h.fake.calls)
            response = await h.command(example)
            await h.settle()
            if spec.slack is SlackWay.IN_ACK:
                slack_text = html.unescape(str(response.body))
                assert all(line in slack_text for line in shell_lines), spec.words
            elif spec.slack is SlackWay.VIEW:  # a form or a page of Block Kit
                methods = {c.method for c in h.fake.calls[seen:]}
                assert methods & {"views.open", "chat.postEphemeral"}, spec.words
            else:
                (slack_text,) = ephemerals(h.fake.calls, seen)
                assert html.unescape(slack_text) == shell_text, spec.words
            assert usage.unknown_command() not in shell_text, spec.words
            print("PAIR", spec.words, repr(shell_text[:90]))


async def test_slack_shows_in_its_own_views_exactly_what_the_registry_says(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        bot: SlackBot = h.bot
        views = {spec.type for spec in COMMANDS if spec.slack is SlackWay.VIEW}
        assert set(bot.own_views) == views


@dataclass(frozen=True)
class Frobnicate:
    """A command the grammar might grow and nobody registered."""


async def test_a_command_nobody_registered_gets_the_same_clear_answer_in_both(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        in_shell = await answer_command(h.deployer, ALICE, Frobnicate())
        await h.bot.carry_out("command:frob", Frobnicate(), ALICE, CHANNEL)
        (in_slack,) = ephemerals(h.fake.calls, 0)
        assert in_shell == [usage.unknown_command()]
        assert html.unescape(in_slack) == usage.unknown_command()
        assert "nothing was changed" in in_slack and "/deploy help" in in_slack
        assert "try again" not in in_slack


async def test_the_shell_takes_every_command_without_deploy_and_names_them(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        out = io.StringIO()
        shell = Shell(h.deployer, ALICE, out)
        await shell.handle("frobnicate web01")
        await shell.handle("template profiles")
        await shell.handle("help")
    text = out.getvalue()
    shortcuts = [word for word in COMMANDS.keywords() if word != "help"]
    assert f"bot: {usage.unknown_shell_input(shortcuts)}" in text
    for word in shortcuts:
        assert word in usage.unknown_shell_input(shortcuts)
    assert "debian-12" in text  # `template profiles` ran without /deploy
    assert "as NAME" in text and "lease | template" in text


async def test_known_hosts_of_a_ready_vm_is_the_same_line_in_the_shell_and_slack(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        job = await deploy(h.deployer)
        assert job.state is JobState.SUCCEEDED and job.known_hosts_line
        out = io.StringIO()
        await Shell(h.deployer, ALICE, out).handle("/deploy known-hosts web01")
        shell_text = "\n".join(
            line.removeprefix("bot: ") for line in out.getvalue().split("\n") if line
        )
        seen = len(h.fake.calls)
        await h.command("known-hosts web01")
        await h.settle()
        (slack_text,) = ephemerals(h.fake.calls, seen)
    assert job.known_hosts_line in shell_text and "guest agent" in shell_text
    assert html.unescape(slack_text) == shell_text
