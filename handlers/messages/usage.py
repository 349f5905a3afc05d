"""What `help` says, and the answer to a command nobody registered: the words of the
command registry (handlers/commands.py), which generates `help` from these and the
grammar's usage lines (bot/requests/grammar.py)."""

from __future__ import annotations

from collections.abc import Sequence

# One line a command, by the command's words: what it does.
SUMMARIES = {
    "deploy": "a VM from a template",
    "help": "this list",
    "status": "where a job or a template build stands",
    "history": "the last N deploys (10 unless you say)",
    "cancel": "stop a job or a template build; whatever was built is removed",
    "templates": "every backend's templates, and what deploybot built of them",
    "approve": "let someone else's request go ahead",
    "reject": "turn someone else's request down, saying why",
    "key": "save your public SSH key: it is put on the VMs you deploy",
    "settings": "your saved defaults and SSH key",
    "destroy": "stop and destroy a VM deploybot built",
    "list": "the VMs deploybot holds: yours, everyone's or one person's",
    "known-hosts": "a ready VM's known_hosts line, and how its host key was confirmed",
    "ssh-ca": "the known_hosts line that trusts every VM's host certificate",
    "lease extend": "keep a VM longer (by the usual step unless you say)",
    "template build": "build a golden template from a build profile",
    "template profiles": "the build profiles there are",
    "migrate plan": "a read-only plan of moving a vSphere backend's templates, kept by id",
    "migrate apply": "rebuild a plan's templates on its target (template builds)",
}

# Who may run a command, by the registry's `Who` (the core enforces it and says why not).
WHO = {
    "anyone": "",
    "deployers": "people allowed to deploy",
    "approvers": "approvers, not on their own request",
    "approvers only": "approvers",
    "requester or approvers": "its requester or an approver",
    "owner, approvers or destroyers": "who deployed it, an approver or a destroyer",
}


def help_lines(commands: Sequence[tuple[str, str, str]]) -> list[str]:
    """`/deploy help`, from the registry: (words, usage, who) for each command, the
    deploy first."""
    (_, deploy_usage, deploy_who), *others = commands
    return [
        f"Deploy {SUMMARIES['deploy']}{_only(deploy_who)}:",
        f"  {deploy_usage}",
        "  e.g. /deploy web01 10.0.0.50 mem=4G disk=+20G",
        "  More NICs: one +ADDRESS (or +SUBNET for its next free address) each, in another "
        "subnet, e.g. /deploy web01 10.0.0.50 +10.0.20.5 +lab30; a fixed MAC: "
        "mac=52:54:00:12:34:56 (first NIC), mac2=... (second).",
        "Other commands:",
        *(f"  {usage}: {SUMMARIES[words]}{_only(who)}" for words, usage, who in others),
        "Defaults: template, size and login user come from the configuration; "
        "upgrade=no unless you say upgrade=yes.",
        "Each VM gets a lease (lease=7d, up to the maximum here): I remind you before it "
        "ends, power the VM off at the end and destroy it after a grace period, unless "
        "you extend it.",
    ]


def _only(who: str) -> str:
    return f" (only {WHO[who]})" if WHO[who] else ""


def shell_help(shortcuts: Sequence[str]) -> list[str]:
    """The shell's own `help`: its words, and the commands it takes without /deploy."""
    return [
        "Type what you would type in Slack: /deploy help, /deploy web01 10.0.0.50, ...",
        "  as NAME              act as another person (to approve, for instance)",
        "  quit                 leave, once running deploys have finished",
        f"  {' | '.join(shortcuts)}",
        "                       short for /deploy ... (/deploy help says how to use each)",
    ]


def unknown_shell_input(shortcuts: Sequence[str]) -> str:
    return (
        f"I only understand /deploy ..., as NAME, quit, and without /deploy: "
        f"{', '.join(shortcuts)}. Type help for how to use them."
    )


def unknown_command() -> str:
    """A command the grammar knows and no front end carries out (a registry without
    it): said the same in every front end, and nothing was changed."""
    return (
        "That is not a command I carry out, so nothing was changed. "
        "`/deploy help` lists the ones I do."
    )
