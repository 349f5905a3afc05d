"""The `deploybot` console script: the CLI of bot/app/cli.py with the terminal front ends."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from backends.building import BuildsTemplates
from backends.config import BackendConfig
from backends.migrating import Scope
from bot.app.cli import default_user, run
from bot.app.runtime import make_backend, open_store, running_deployer, secret_problems
from bot.config.settings import Settings
from bot.kinds.build import retire
from bot.migration import sources
from bot.migration.apply import Outcome
from bot.migration.plan import Plan, make_plan, write_plan
from bot.migration.service import keep_plan, load_plan
from bot.models import JobState
from bot.models.builds import Build, BuildState
from bot.models.errors import BackendError, ConfigError, UserError
from bot.operations import gc
from bot.operations.check import run_checks
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs, ExtendLease, KnownHosts, ListVMs
from bot.sshca.authority import load_host_ca
from handlers import commands
from handlers.demo import run_demo
from handlers.messages.builds import (
    build_started,
    builds_table,
    profiles_table,
    template_versions_table,
)
from handlers.messages.core import secrets_missing
from handlers.messages.destroys import destroy_answer
from handlers.messages.hostkeys import authority_answer
from handlers.messages.migration import (
    applied_json,
    applied_lines,
    apply_handed_off,
    build_progress,
    plan_failed,
    plan_json,
    plan_kept,
    plan_lines,
    plan_not_written,
    started_lines,
    unknown_backend,
)
from handlers.messages.reports import HISTORY_HEADER, history, history_line
from handlers.messages.retire import retire_report
from handlers.messages.slack import bad_command_name, check_lines, gc_report, gc_unknown_backends
from handlers.terminal import Shell, TerminalBuilds, TerminalThread

POLL_S = 5.0  # how often `migrate apply` reads again builds that run in another process


async def demo(args: argparse.Namespace, settings: Settings) -> int:
    return await run_demo(args.time_scale)


async def refuse_missing_secrets(settings: Settings) -> None:
    """Every secret the configuration names and the environment lacks, named at once
    before anything starts (`check-config`, `shell`, `serve`)."""
    if problems := await secret_problems(settings, os.environ):
        raise ConfigError(secrets_missing(problems))


async def shell(args: argparse.Namespace, settings: Settings) -> int:
    await refuse_missing_secrets(settings)
    async with running_deployer(settings, TerminalThread()) as deployer:
        await Shell(deployer, args.user).run()
    return 0


async def deploy(args: argparse.Namespace, settings: Settings) -> int:
    words = list(args.words)
    if args.backend:
        words.append(f"on={args.backend}")
    command = parse(" ".join(words))
    if not isinstance(command, DeployArgs):
        print(
            "`deploybot deploy` takes NAME [ADDRESS] [key=value ...]; "
            "for the other commands use `deploybot shell`.",
            file=sys.stderr,
        )
        return 2
    # A one-shot runner: it runs its own job and never takes over another process's.
    async with running_deployer(
        settings, TerminalThread(), runner_kind="deploy", takes_over=False
    ) as deployer:
        job = await deployer.request_deploy(command, args.user, can_wait_for_approval=False)
        await deployer.drain()
        final = (await deployer.status(job.id)).job
    return 0 if final.state is JobState.SUCCEEDED else 1


async def list_vms(args: argparse.Namespace, settings: Settings) -> int:
    me = default_user()
    command = ListVMs(everyone=args.all, user=args.user, page=max(1, args.page))
    async with running_deployer(
        settings, TerminalThread(), runner_kind="list", takes_over=False, start=False
    ) as deployer:  # only reads the store: no runner, no recovery
        lines = await commands.reply_text(deployer, me, command)
    print("\n".join(lines))
    return 0


async def destroy(args: argparse.Namespace, settings: Settings) -> int:
    # A one-shot runner, like `deploy`: it carries out its own destroy and waits for it.
    async with running_deployer(
        settings, TerminalThread(), runner_kind="destroy", takes_over=False
    ) as deployer:
        job = await deployer.request_destroy(args.target, args.user, can_wait_for_approval=False)
        await deployer.drain()
        final = (await deployer.status(job.id)).job
    if final.state is not JobState.DESTROYED:
        print(destroy_answer(final), file=sys.stderr)
        return 1
    return 0


async def lease(args: argparse.Namespace, settings: Settings) -> int:
    # Only `lease extend` so far: a store write (and a power-on of a VM whose lease had
    # ended), so no runner and no recovery, like `list`.
    async with running_deployer(
        settings, TerminalThread(), runner_kind="lease", takes_over=False, start=False
    ) as deployer:
        command = ExtendLease(args.target, args.length)
        lines = await commands.reply_text(deployer, args.user, command)
    print("\n".join(lines))
    return 0


async def known_hosts(args: argparse.Namespace, settings: Settings) -> int:
    # Only reads the store, like `list`: no runner, no recovery.
    async with running_deployer(
        settings, TerminalThread(), runner_kind="known-hosts", takes_over=False, start=False
    ) as deployer:
        lines = await commands.reply_text(deployer, default_user(), KnownHosts(args.target))
    print("\n".join(line.removeprefix("    ") for line in lines))
    return 0


async def ssh_ca(args: argparse.Namespace, settings: Settings) -> int:
    # The configuration, the environment and the store's jobs (no backend). The lines
    # for known_hosts alone go to stdout (`deploybot ssh-ca >> ~/.ssh/known_hosts`),
    # what they are to stderr.
    ca = load_host_ca(settings, os.environ)
    if ca is None:
        print("\n".join(authority_answer(ca)), file=sys.stderr)
        return 1
    async with running_deployer(
        settings, TerminalThread(), runner_kind="ssh-ca", takes_over=False, start=False
    ) as deployer:
        revoked = await deployer.revoked_host_keys()
    for line in authority_answer(ca, revoked):
        if line.startswith("    "):
            print(line.removeprefix("    "))
        else:
            print(line, file=sys.stderr)
    return 0


async def history_command(args: argparse.Namespace, settings: Settings) -> int:
    state = None
    if args.state:
        try:
            state = JobState(args.state)
        except ValueError:
            choices = ", ".join(s.value for s in JobState)
            print(f"--state {args.state}: not a job state; use one of {choices}.", file=sys.stderr)
            return 2
    store = await open_store(settings)
    shown = 0
    try:  # a page at a time: `history 100000` holds one page, not a hundred thousand jobs
        pages = store.jobs.history_pages(
            requester=args.user, state=state, name=args.name, limit=max(1, args.limit)
        )
        async for page in pages:
            lines = [history_line(job) for job in page]
            print("\n".join(lines if shown else [HISTORY_HEADER, *lines]))
            shown += len(page)
    finally:
        await store.close()
    if not shown:
        print("\n".join(history([], filtered=bool(args.user or state or args.name))))
    return 0


async def check_config(args: argparse.Namespace, settings: Settings) -> int:
    await refuse_missing_secrets(settings)
    print("The configuration is valid.")
    print(f"  backends: {', '.join(f'{b.name} ({b.kind})' for b in settings.backends)}")
    print(f"  subnets: {', '.join(str(s.cidr) for s in settings.subnets)}")
    print(f"  database: {settings.database}")  # never holds a password (bot/config/settings.py)
    ca = load_host_ca(settings, os.environ)  # loads: refuse_missing_secrets said otherwise
    print(f"  host CA: {f'{ca.fingerprint} from {ca.source}' if ca else 'none'}")
    return 0


async def check(args: argparse.Namespace, settings: Settings) -> int:
    from handlers.slack.check import slack_checks  # slack_sdk loads only when needed

    results = await run_checks(settings) + await slack_checks(settings.slack, os.environ)
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [dataclasses.asdict(r) for r in results]}))
    else:
        print("\n".join(check_lines(results)))
    return 0 if ok else 1


async def gc_command(args: argparse.Namespace, settings: Settings) -> int:
    known = [b.name for b in settings.backends]
    scope = args.backend or known
    unknown = sorted(set(scope) - set(known))
    if unknown:
        print(gc_unknown_backends(unknown, known), file=sys.stderr)
        return 2
    backends = {c.name: make_backend(c) for c in settings.backends if c.name in scope}
    store = await open_store(settings)
    try:
        if args.apply:
            window_s = args.window_minutes * 60
            report = await gc.apply(store, backends, scope, settings.timeouts, window_s)
        else:
            report = await gc.dry_run(store, backends, scope)
    finally:
        for backend in backends.values():
            await backend.close()
        await store.close()
    print("\n".join(gc_report(report, args.window_minutes)))
    failed = [why for _f, why in report.left if why.startswith("removal failed")]
    return 1 if failed or report.locked or report.unreachable or report.refused else 0


async def template(args: argparse.Namespace, settings: Settings) -> int:
    if args.template_command == "profiles":
        print("\n".join(profiles_table(settings.images.all_profiles())))
        return 0
    if args.template_command == "list":
        return await _template_list(args, settings)
    if args.template_command == "gc":
        return await _template_gc(args, settings)
    # A one-shot runner, like `deploy`: it runs its own build (and its smoke deploy).
    async with running_deployer(
        settings,
        TerminalThread(),
        runner_kind="build",
        takes_over=False,
        build_notes=TerminalBuilds(),
    ) as deployer:
        build = await deployer.builds.request(
            args.profile,
            args.backend,
            args.user,
            placement=args.node,
            storage=args.storage,
            name=args.name,
            can_wait_for_approval=False,  # nobody could approve it while this one runs
        )
        print(f"┌ {build_started(build)}")
        await deployer.drain()
        final = await deployer.queries.build(build.id)
    return 0 if final is not None and final.state is BuildState.PUBLISHED else 1


async def _template_list(args: argparse.Namespace, settings: Settings) -> int:
    scope = [c for c in settings.backends if args.backend in (None, c.name)]
    if not scope:
        print(f"--backend {args.backend}: no such backend.", file=sys.stderr)
        return 2
    store = await open_store(settings)
    try:
        for config in scope:
            backend = make_backend(config)
            try:
                if isinstance(backend, BuildsTemplates):
                    versions = await backend.template_versions()
                    print("\n".join(template_versions_table(config.name, versions)))
            finally:
                await backend.close()
        print("\n".join(builds_table(await store.builds.recent(args.backend, None, 20))))
    finally:
        await store.close()
    return 0


async def _template_gc(args: argparse.Namespace, settings: Settings) -> int:
    known = [b.name for b in settings.backends]
    scope = args.backend or known
    if unknown := sorted(set(scope) - set(known)):
        print(gc_unknown_backends(unknown, known), file=sys.stderr)
        return 2
    backends = {c.name: make_backend(c) for c in settings.backends if c.name in scope}
    store = await open_store(settings)
    keep = settings.images.keep_previous
    try:
        if args.apply:
            report = await retire.apply(
                store, backends, scope, keep, args.window_minutes * 60, settings.timeouts.destroy_s
            )
        else:
            report = await retire.dry_run(store, backends, scope, keep)
    finally:
        for backend in backends.values():
            await backend.close()
        await store.close()
    print("\n".join(retire_report(report, args.window_minutes)))
    failed = [why for _v, why in report.left if why.startswith("removal failed")]
    return 1 if failed or report.unreachable else 0


async def migrate(args: argparse.Namespace, settings: Settings) -> int:
    """`migrate plan`: reads the source through its read-only session type and the
    target's built templates; writes nothing but the plan file and the plan kept in the
    store. `migrate apply`: see `_migrate_apply`."""
    if args.migrate_command == "apply":
        return await _migrate_apply(args, settings)
    configs = {c.name: c for c in settings.backends}
    wanted = [("--to", args.target)] + ([("--from", args.source)] if args.source else [])
    for option, name in wanted:
        if name not in configs:
            print(unknown_backend(option, name, sorted(configs)), file=sys.stderr)
            return 2
    try:
        if args.source:
            sources.check_distinct(settings.backends, args.source, args.target)
    except UserError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    try:
        plan = await _migration_plan(args, settings, configs)
    except BackendError as exc:  # the source or the target did not answer, or refused
        print(plan_failed(exc.message), file=sys.stderr)
        return 1
    if args.out:
        try:
            write_plan(plan, Path(args.out))
        except OSError as exc:
            print(plan_not_written(args.out, exc.strerror or str(exc)), file=sys.stderr)
            return 2
    store = await open_store(settings)
    try:
        kept = await keep_plan(store, plan, args.user)
    finally:
        await store.close()
    if args.json:
        print(json.dumps({**plan_json(plan), "plan_id": kept.id}, indent=2, sort_keys=True))
    else:
        print("\n".join(plan_lines(plan, args.out)))
        print(plan_kept(kept, settings.migration.plan_valid_s))
    return 0


async def _migrate_apply(args: argparse.Namespace, settings: Settings) -> int:
    """Check the plan, ask for its builds (run here, or left to a serving process with
    --no-wait), wait for them with their progress, then the counts at both ends. Exit
    0 when every migrating template's profile is on the target."""
    store = await open_store(settings)
    try:
        plan = await load_plan(store, args.plan)
    finally:
        await store.close()
    # The target alone: the source is read through its read-only session type only,
    # never held here as a backend that could write to it.
    configs = {c.name: c for c in settings.backends}
    if plan.target not in configs:
        print(unknown_backend("the plan's target", plan.target, sorted(configs)), file=sys.stderr)
        return 2
    try:  # before a backend of the target is even made: it may be the source's server
        sources.check_distinct(settings.backends, plan.source, plan.target)
    except UserError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    backends = {plan.target: make_backend(configs[plan.target])}
    # With --json, stdout holds the JSON document alone: progress goes to stderr.
    said = sys.stderr if args.json else sys.stdout
    notes = None if args.no_wait else TerminalBuilds(said)
    async with running_deployer(
        settings,
        TerminalThread(),
        backends=backends,
        runner_kind="migrate",
        takes_over=False,
        build_notes=notes,
    ) as deployer:
        migrations = deployer.migrations
        applied = await migrations.apply(plan, args.user, hand_off=args.no_wait)
        outcome = await migrations.outcome(applied)
        if args.no_wait:
            _print_applied(outcome, ends=False, as_json=args.json)
            print(apply_handed_off(outcome), file=said)
            return 0
        if all(r.ended for r in outcome.rebuilds):  # nothing to wait for: the end at once
            _print_applied(outcome, ends=True, as_json=args.json)
            return 1 if outcome.missing() else 0
        print("\n".join(started_lines(outcome)), file=said, flush=True)

        async def changed(build: Build) -> None:
            print(build_progress(build), file=said, flush=True)

        async def settle() -> None:
            await deployer.drain()
            await deployer.builds.expire()  # no serving process may be there to do it

        applied = await migrations.wait(applied, settle, changed, POLL_S)
        outcome = await migrations.outcome(applied)
    _print_applied(outcome, ends=True, as_json=args.json)
    return 1 if outcome.missing() else 0


def _print_applied(outcome: Outcome, *, ends: bool, as_json: bool) -> None:
    if as_json:
        print(json.dumps(applied_json(outcome, ends=ends), indent=2, sort_keys=True))
    else:
        print("\n".join(applied_lines(outcome, ends=ends)))


async def _migration_plan(
    args: argparse.Namespace, settings: Settings, configs: dict[str, BackendConfig]
) -> Plan:
    target = make_backend(configs[args.target])
    try:
        if args.source:
            source = sources.open_source(configs[args.source], os.environ)
        else:
            source = sources.ova_source(args.from_ova, settings.images.connect_timeout_s)
        try:
            versions = (
                await target.template_versions() if isinstance(target, BuildsTemplates) else []
            )
            scope = Scope(args.folder, args.name)
            profiles = settings.images.all_profiles()
            storage = await sources.target_storage_type(target)
            return await make_plan(
                source, args.target, versions, profiles, scope,
                subnets=settings.subnets, storage_type=storage,
            )  # fmt: skip
        finally:
            await source.close()
    finally:
        await target.close()


async def serve(args: argparse.Namespace, settings: Settings) -> int:
    from handlers.slack.serve import serve as serve_slack  # Bolt loads only when needed

    return await serve_slack(settings, http=args.http, environ=os.environ)


async def manifest(args: argparse.Namespace, settings: Settings) -> int:
    from handlers.slack.manifest import COMMAND_RE, manifest_yaml

    command = args.slash_command or settings.slack.command
    if not COMMAND_RE.match(command):
        print(bad_command_name(command), file=sys.stderr)
        return 2
    print(manifest_yaml(command), end="")
    return 0


COMMANDS = {
    "demo": demo,
    "shell": shell,
    "deploy": deploy,
    "history": history_command,
    "list": list_vms,
    "destroy": destroy,
    "lease": lease,
    "known-hosts": known_hosts,
    "ssh-ca": ssh_ca,
    "check-config": check_config,
    "check": check,
    "serve": serve,
    "manifest": manifest,
    "gc": gc_command,
    "template": template,
    "migrate": migrate,
}


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
