"""The `deploybot` command line: arguments, configuration, logging, exit codes.

The commands themselves are front ends (they print threads and tables), so they live in
handlers/ and are handed in by handlers/entry.py; this module keeps what every command
shares and the rule that no traceback reaches the terminal: user errors print their
message (exit 2), anything unexpected goes to the log with a one-line pointer (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from bot.config.settings import Settings, load_settings
from bot.jobs.logfields import JsonFormatter, WithoutBodies
from bot.leases.terms import parse_length
from bot.models.errors import UserError

Command = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]
log = logging.getLogger("deploybot")


def default_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "operator"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deploybot",
        description="Deploy VMs from templates on Proxmox VE, vCenter, ESXi or the simulator.",
    )
    parser.add_argument(
        "--config",
        help="configuration file (default: $DEPLOYBOT_CONFIG, "
        "./deploybot.toml, or the bundled example)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="a scripted session on the simulator")
    demo.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply simulated durations (default 1.0: realistic)",
    )
    shell = sub.add_parser("shell", help="an interactive local chat with the bot")
    shell.add_argument("--user", default=default_user(), help="who you are at the start")
    deploy = sub.add_parser("deploy", help="deploy one VM and wait for it (exit 0 when ready)")
    deploy.add_argument("words", nargs="+", metavar="NAME [ADDRESS] [+ADDRESS ...] [key=value ...]")
    deploy.add_argument("--user", default=default_user(), help="the requester")
    deploy.add_argument("--backend", help="same as on=BACKEND")
    history = sub.add_parser("history", help="recent deploys")
    history.add_argument("limit", nargs="?", type=int, default=20)
    history.add_argument("--user", help="only this requester's deploys")
    history.add_argument("--state", help="only jobs in this state (succeeded, failed, ...)")
    history.add_argument("--name", help="only deploys of this VM name")
    listing = sub.add_parser("list", help="the VMs deploybot holds (yours unless --all/--user)")
    whose = listing.add_mutually_exclusive_group()
    whose.add_argument("--all", action="store_true", help="everyone's VMs")
    whose.add_argument("--user", help="this person's VMs (default: you)")
    listing.add_argument("--page", type=int, default=1, help="which page (10 VMs a page)")
    destroy = sub.add_parser(
        "destroy", help="stop and destroy a VM deploybot built, and wait (exit 0 when gone)"
    )
    destroy.add_argument("target", metavar="NAME", help="the VM's name, or its job id")
    destroy.add_argument("--user", default=default_user(), help="who asks")
    lease = sub.add_parser("lease", help="a VM's lease: `lease extend NAME 7d`")
    lease_sub = lease.add_subparsers(dest="lease_command", required=True, metavar="ACTION")
    extend = lease_sub.add_parser("extend", help="move a VM's lease end later")
    extend.add_argument("target", metavar="NAME", help="the VM's name, or its job id")
    extend.add_argument(
        "length", nargs="?", type=_length, help="how much later, like 7d (default: [leases] step)"
    )
    extend.add_argument("--user", default=default_user(), help="who asks")
    known = sub.add_parser(
        "known-hosts", help="a ready VM's known_hosts line and how its host key was confirmed"
    )
    known.add_argument("target", metavar="NAME", help="the VM's name, or its job id")
    sub.add_parser(
        "ssh-ca",
        help="the known_hosts @cert-authority line that trusts every VM's host certificate "
        "(on stdout, to append to ~/.ssh/known_hosts)",
    )
    sub.add_parser("check-config", help="validate the configuration and summarise it")
    check = sub.add_parser(
        "check",
        help="connect to every backend and check TLS, credentials, privileges, the default "
        "template, storage and network (exit 1 on any problem)",
    )
    check.add_argument("--json", action="store_true", help="one JSON object, for machines")
    serve = sub.add_parser(
        "serve", help="run the Slack bot (Socket Mode; --http HOST:PORT for HTTP mode)"
    )
    serve.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve Slack's requests on http://HOST:PORT/slack/events (and /healthz)",
    )
    gc = sub.add_parser(
        "gc", help="list VMs with a deploybot tag but no successful job (--apply removes them)"
    )
    gc.add_argument(
        "--backend", action="append", metavar="NAME", help="only this backend (repeatable)"
    )
    gc.add_argument(
        "--apply", action="store_true", help="remove what a recent dry run of this scope listed"
    )
    gc.add_argument(
        "--window-minutes",
        type=float,
        default=30.0,
        help="how recent that dry run must be (default 30)",
    )
    _template_parser(sub)
    _migrate_parser(sub)
    manifest = sub.add_parser("manifest", help="print the Slack app manifest")
    manifest.add_argument(
        "--command", dest="slash_command", help="the slash command (default: slack.command)"
    )
    return parser


def _template_parser(sub: Any) -> None:
    """`deploybot template build|list`: golden templates from upstream images (issue 17)."""
    template = sub.add_parser("template", help="build golden templates: `template build debian-12`")
    actions = template.add_subparsers(dest="template_command", required=True, metavar="ACTION")
    build = actions.add_parser(
        "build",
        help="build a template from a profile's upstream image, smoke-test it with a deploy, "
        "publish it (exit 0 when published)",
    )
    build.add_argument("profile", metavar="PROFILE", help="a build profile (debian-12, ...)")
    build.add_argument("--backend", required=True, help="where to build it")
    build.add_argument("--node", help="the node (Proxmox) or host to build on")
    build.add_argument("--storage", help="where its disk goes (default: the backend's)")
    build.add_argument("--name", help="the published name (default: the profile's)")
    build.add_argument("--user", default=default_user(), help="who asks")
    listing = actions.add_parser("list", help="built templates and recent builds")
    listing.add_argument("--backend", help="only this backend")
    actions.add_parser("profiles", help="the build profiles (shipped and configured)")
    gc = actions.add_parser(
        "gc", help="list template versions nobody needs (--apply retires what a dry run listed)"
    )
    gc.add_argument("--backend", action="append", metavar="NAME", help="only this backend")
    gc.add_argument("--apply", action="store_true", help="retire what a recent dry run listed")
    gc.add_argument("--window-minutes", type=float, default=30.0, help="(default 30)")


def _migrate_parser(sub: Any) -> None:
    """`deploybot migrate plan|apply`: what leaving a hypervisor would take, and the
    templates rebuilt on the target (issue 30)."""
    migrate = sub.add_parser(
        "migrate", help="plan a move off vSphere (read-only dry run), then apply its templates"
    )
    actions = migrate.add_subparsers(dest="migrate_command", required=True, metavar="ACTION")
    plan = actions.add_parser(
        "plan",
        help="classify every template (rebuild, on target, not mappable) and VM (moves as is, "
        "decisions, blocked) of the source; "
        "reads both sides, changes nothing",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", metavar="BACKEND", help="the vSphere backend")
    source.add_argument("--from-ova", metavar="URL", help="an OVA on a web server (its head)")
    plan.add_argument("--to", dest="target", required=True, metavar="BACKEND", help="the target")
    plan.add_argument("--folder", help="only templates and VMs under this VM folder")
    plan.add_argument("--name", metavar="PATTERN", help="only names matching (shell pattern)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON, for machines")
    plan.add_argument("--out", metavar="FILE", help="write the plan file (for an apply)")
    plan.add_argument("--user", default=default_user(), help="who plans (kept with the plan)")
    apply = actions.add_parser(
        "apply",
        help="rebuild the plan's templates on its target through template builds (refused "
        "when the plan is too old or the source changed); waits for them",
    )
    apply.add_argument("plan", metavar="PLAN", help="a plan file (--out), or a plan's id")
    apply.add_argument("--user", default=default_user(), help="who asks for the builds")
    apply.add_argument(
        "--json", action="store_true", help="the end as JSON (progress goes to stderr)"
    )
    apply.add_argument(
        "--no-wait",
        action="store_true",
        help="ask for the builds and leave them to a running `deploybot serve`",
    )


def _length(text: str) -> int:
    """A lease length for argparse: "7d" -> seconds; argparse words the refusal."""
    try:
        seconds = parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not seconds:
        raise argparse.ArgumentTypeError(f"{text!r}: extend by a length, like 7d")
    return seconds


def configure_logging(path: Path, *, to_stderr: bool = False, json_lines: bool = False) -> None:
    """Every command logs to `path`, which the messages people see point at; `serve`
    also to stderr, for the container's log. The file is made 0600 before anything is
    written to it: it names people, machines and jobs, like the database."""
    fd = os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    formatter = (
        JsonFormatter()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    for handler in handlers:
        handler.setFormatter(formatter)
    for handler in handlers:
        handler.addFilter(WithoutBodies())  # on the handlers: it sees every logger's records
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(logging.INFO)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with `deploy`'s key=value words allowed anywhere on it:
    argparse ends a positional list at the first option, so `deploy web01 10.0.0.5
    --backend pve upgrade=yes` would otherwise be refused."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "deploy":
        args.words += [word for word in extra if not word.startswith("-")]
        extra = [word for word in extra if word.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def run(argv: Sequence[str] | None, commands: Mapping[str, Command]) -> int:
    args = parse(argv)
    try:
        settings = load_settings(args.config)
    except UserError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    if args.command != "demo":
        try:
            configure_logging(
                settings.log_file,
                to_stderr=args.command == "serve",
                json_lines=settings.log_format == "json",
            )
        except OSError as exc:
            print(
                f"log_file {settings.log_file}: cannot write it ({exc.strerror}); point "
                "log_file at a file this user may write.",
                file=sys.stderr,
            )
            return 2
    try:
        return asyncio.run(commands[args.command](args, settings))
    except UserError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except Exception:
        log.exception("deploybot %s failed", args.command)
        print(
            f"deploybot {args.command} failed unexpectedly; the details are in "
            f"{settings.log_file}.",
            file=sys.stderr,
        )
        return 1
