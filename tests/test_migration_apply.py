"""`migrate apply` (issue 30): a plan of a vcsim source, read through the read-only
session type behind a counting proxy, applied to the simulator as the target (which
builds templates through the real build kind: queue, pre-flight, smoke deploy, publish).
Each profile is built once, the final counts match, an apply run again starts nothing
twice, builds that need an approver wait for one, and a plan that is too old, whose
source changed or whose file was edited is refused with nothing started. The source
never sees a mutating SOAP method."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from backends.base import VMRef
from backends.migrating import Scope, TemplateFacts
from backends.sim import SimBackend
from backends.vsphere.config import Config
from backends.vsphere.readonly import create
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.images.profiles import catalogue
from bot.migration.apply import Applied, Outcome, PlanTooOld, Rebuild, SourceChanged, check_age
from bot.migration.plan import (
    Plan,
    PlanFileError,
    classify,
    make_plan,
    read_plan,
    seal_of,
    write_plan,
)
from bot.models import utcnow
from bot.models.builds import BuildState
from bot.models.errors import UserError
from bot.models.notices import MIGRATION_ENDED
from bot.models.plans import KeptPlan
from handlers.messages.migration import CHAT_FINDINGS, STAYS, applied_lines, kept_plan_lines
from tests.support.cli import run_async
from tests.support.deployer import SIM_SCALE, make_settings
from tests.support.slack.bot import ALICE, BOB, CHANNEL, Harness, new_fake, slack_bot
from tests.support.slack.fake_api import Call, FakeSlack
from tests.support.vsphere.migration import GOLDEN, apply_inventory, edit_notes
from tests.support.vsphere.simulator import (
    PASSWORD,
    PASSWORD_ENV,
    Simulated,
    TlsFiles,
    simulator,
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)
from tests.support.vsphere.soapproxy import READ_METHODS, SoapProxy, counting_proxy

GOLDEN_SCOPE = Scope(folder="golden")


@pytest.fixture(scope="module")
def lab(vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path_factory: Any) -> Iterator[Simulated]:
    workdir = tmp_path_factory.mktemp("apply-vcsim")
    with simulator(vcsim_binary, vcsim_tls, workdir, esx=False, vms_per_pool=4) as simulated:
        apply_inventory(simulated.sim)
        yield simulated


@pytest.fixture
async def proxy(lab: Simulated) -> AsyncIterator[SoapProxy]:
    async with counting_proxy(lab.sim.port, lab.sim.tls) as counting:
        yield counting


def lab_backends(lab: Simulated, proxy: SoapProxy) -> list[dict[str, Any]]:
    """The simulator as the target, vcsim (through the proxy) as the source."""
    return [
        {"kind": "sim", "name": "sim", "time_scale": SIM_SCALE},
        lab.sim.config(port=proxy.port),
    ]


def lab_settings(tmp_path: Path, lab: Simulated, proxy: SoapProxy, **overrides: Any) -> Settings:
    return make_settings(tmp_path, backends=lab_backends(lab, proxy), **overrides)


@pytest.fixture
def target() -> SimBackend:
    return SimBackend("sim", time_scale=SIM_SCALE)


@pytest.fixture
async def deployer(
    tmp_path: Path,
    lab: Simulated,
    proxy: SoapProxy,
    target: SimBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Deployer]:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    settings = lab_settings(tmp_path, lab, proxy)
    async with running_deployer(settings, backends={"sim": target}, grace_s=5) as d:
        yield d


async def plan_of(
    lab: Simulated, proxy: SoapProxy, target: SimBackend, scope: Scope, **when: Any
) -> Plan:
    source = create(Config.model_validate(lab.sim.config(port=proxy.port)), {
        PASSWORD_ENV: PASSWORD})  # fmt: skip
    try:
        versions = await target.template_versions()
        return await make_plan(source, "sim", versions, catalogue(), scope, **when)
    finally:
        await source.close()


async def built_once(deployer: Deployer, profile: str) -> None:
    """A template of `profile` built on the simulator before the plan (bob approves)."""
    build = await deployer.builds.request(profile, "sim", "bob")
    await deployer.drain()
    done = await deployer.store.builds.get(build.id)
    assert done is not None and done.state is BuildState.PUBLISHED, done


async def test_apply_builds_each_profile_once_and_the_counts_match(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    await built_once(deployer, "ubuntu-22.04")  # ubuntu-jammy's profile: on the target
    plan = await plan_of(lab, proxy, target, GOLDEN_SCOPE)
    assert {f.name: f.profile for f in plan.findings} == GOLDEN
    assert plan.counts()["template"] == {"rebuildable": 3, "on-target": 1, "not-mappable": 1}

    applied = await deployer.migrations.apply(plan, "bob")
    # One build per profile: alma-9-golden and alma-base share alma-9's.
    started = {r.profile: r.templates for r in applied.rebuilds if r.started}
    assert started == {"alma-9": ("alma-9-golden", "alma-base"), "debian-13": (
        "debian-13-golden",)}  # fmt: skip
    await deployer.drain()
    outcome = await deployer.migrations.outcome(applied)
    assert {r.profile: r.build.state for r in outcome.rebuilds if r.build} == {
        "alma-9": BuildState.PUBLISHED,
        "debian-13": BuildState.PUBLISHED,
        "ubuntu-22.04": BuildState.PUBLISHED,  # the build made before the plan
    }
    # Source against destination: every profile the migrating templates need is built.
    assert outcome.wanted() == {"alma-9", "debian-13", "ubuntu-22.04"}
    assert outcome.missing() == set() and outcome.failed() == []
    assert [f.name for f in outcome.left()] == ["win2019"]
    built = {v.profile: v.name for v in await target.template_versions() if v.current}
    assert built == {"alma-9": "alma-9", "debian-13": "debian-13", "ubuntu-22.04": "ubuntu-22.04"}
    # Per category, per source template: alma-9-golden and alma-base count twice on
    # the target (one template of alma-9 stands for both); win2019 has none there.
    assert [(c.kind, c.category.value, c.source, c.target) for c in outcome.counts()] == [
        ("template", "rebuildable", 3, 3),
        ("template", "on-target", 1, 1),
        ("template", "not-mappable", 1, 0),
        ("vm", "moves-as-is", 0, None),
        ("vm", "needs-decisions", 0, None),
        ("vm", "blocked", 0, None),
    ]
    text = "\n".join(applied_lines(outcome, ends=True))
    assert "Counts, source vcenter against target sim after the apply:" in text
    assert table_of(text) == {
        "rebuild": (3, "3"), "on target": (1, "1"), "not mappable": (1, "0"),
        "total": (5, "4"), "moves as is": (0, STAYS), "decisions": (0, STAYS),
        "blocked": (0, STAYS),
    }  # fmt: skip
    assert (
        "Profiles on sim: 3 of the 3 the migrating templates need: alma-9 (alma-9 v1), "
        "debian-13 (debian-13 v1), ubuntu-22.04 (ubuntu-22.04 v1)." in text
    )
    assert "win2019: no build profile is for its guest OS" in text

    # Run again: nothing is started twice (the store knows the builds).
    again = await deployer.migrations.apply(plan, "bob")
    assert [r.started for r in again.rebuilds] == [False, False, False]
    assert {r.build.id for r in again.rebuilds if r.build} == {
        r.build.id for r in applied.rebuilds if r.build
    }
    # ubuntu-jammy was on the target at plan time: its profile's build is named, not redone.
    jammy = next(r for r in again.rebuilds if r.profile == "ubuntu-22.04")
    assert jammy.templates == ("ubuntu-jammy",) and jammy.build is not None
    assert jammy.build.state is BuildState.PUBLISHED and not jammy.started
    assert len(await deployer.store.builds.recent()) == 3
    # A template removed from the target since (by hand): its profile is built again.
    alma = next(r.build for r in again.rebuilds if r.profile == "alma-9")
    assert alma is not None and alma.vm_id is not None
    await target.destroy_template(VMRef(alma.vm_id, alma.id, alma.vm_placement, alma.installation))
    third = await deployer.migrations.apply(plan, "bob")
    assert [r.profile for r in third.rebuilds if r.started] == ["alma-9"]
    await deployer.drain()
    rebuilt = (await deployer.migrations.outcome(third)).rebuilds[0].build
    assert rebuilt is not None and (rebuilt.state, rebuilt.version) == (BuildState.PUBLISHED, 2)
    # The source was only read, twice per apply's check and once per plan.
    assert proxy.mutations() == [] and set(proxy.methods()) <= READ_METHODS


async def test_a_profile_in_flight_is_not_started_again_and_approval_is_waited_for(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    """alice is no approver: the builds she asks for wait for one (`[approval] builds`),
    the apply says so, a second apply meanwhile starts nothing, and bob's approval runs
    them."""
    plan = await plan_of(lab, proxy, target, Scope(folder="golden", name="alma-*"))
    applied = await deployer.migrations.apply(plan, "alice")
    ((rebuild),) = applied.rebuilds
    assert rebuild.build is not None and rebuild.build.state is BuildState.AWAITING_APPROVAL
    outcome = await deployer.migrations.outcome(applied)
    text = "\n".join(applied_lines(outcome, ends=False))
    assert f"waits for an approver: /deploy approve {rebuild.build.id}" in text
    assert "Under way: 1 build(s)" in text

    again = await deployer.migrations.apply(plan, "carol")
    assert [(r.started, r.build.id if r.build else None) for r in again.rebuilds] == [
        (False, rebuild.build.id)
    ]
    await deployer.decide_build(rebuild.build.id, "bob", True)
    await deployer.drain()
    done = await deployer.migrations.outcome(applied)
    assert done.missing() == set() and done.rebuilds[0].build is not None
    assert done.rebuilds[0].build.state is BuildState.PUBLISHED
    assert len(await deployer.store.builds.recent()) == 1
    assert proxy.mutations() == []


async def test_a_failed_build_is_left_with_its_error(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    """deb-old maps to debian-12, whose name the simulator's hand-made template holds:
    the build kind's pre-flight refuses it, and the apply's end says so."""
    plan = await plan_of(lab, proxy, target, Scope(folder="legacy"))
    applied = await deployer.migrations.apply(plan, "bob")
    await deployer.drain()
    outcome = await deployer.migrations.outcome(applied)
    assert outcome.missing() == {"debian-12"}
    ((failed),) = outcome.failed()
    assert failed.build is not None and failed.build.state is BuildState.FAILED
    text = "\n".join(applied_lines(outcome, ends=True))
    assert "Left: 1 profile(s) not built:" in text
    assert "debian-12 (deb-old): failed: debian-12 is a template deploybot did not build" in text
    assert table_of(text)["rebuild"] == (1, "0")
    assert "Profiles on sim: 0 of the 1 the migrating templates need." in text


async def test_an_old_plan_is_refused_and_nothing_starts(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    made = utcnow() - timedelta(hours=2, minutes=5)
    plan = await plan_of(lab, proxy, target, GOLDEN_SCOPE, now=made)
    with pytest.raises(PlanTooOld) as refused:
        await deployer.migrations.apply(plan, "bob")
    message = refused.value.message
    assert "made 2 h 5 min ago" in message and "valid for 60 min" in message
    assert "make a new plan (migrate plan --from vcenter --to sim)" in message
    assert await deployer.store.builds.recent() == []


async def test_a_changed_source_is_refused_naming_what_changed(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    plan = await plan_of(lab, proxy, target, GOLDEN_SCOPE)
    edit_notes(lab.sim, "win2019", "Windows Server 2019, edited after the plan")
    try:
        with pytest.raises(SourceChanged) as refused:
            await deployer.migrations.apply(plan, "bob")
    finally:
        edit_notes(lab.sim, "win2019", "Windows 2019")
    message = refused.value.message
    assert "The source vcenter changed since this plan was made (win2019 changed)" in message
    assert "Nothing was started: make a new plan" in message
    assert await deployer.store.builds.recent() == []
    # Back as it was: the same plan applies (its digest matches the source again).
    applied = await deployer.migrations.apply(plan, "bob")
    assert len([r for r in applied.rebuilds if r.started]) == 3
    await deployer.drain()


async def test_an_edited_plan_file_is_refused(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend, tmp_path: Path
) -> None:
    plan = await plan_of(lab, proxy, target, GOLDEN_SCOPE)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    document = json.loads(path.read_text())
    # A fact edited: the digest no longer matches.
    facts = json.loads(json.dumps(document))
    facts["facts"][0]["annotation"] = "edited"
    path.write_text(json.dumps(facts))
    with pytest.raises(PlanFileError, match="do not match its digest"):
        await deployer.migrations.load(str(path))
    # A finding edited (win2019 made rebuildable): the facts still hash to the digest,
    # the seal does not; sealed again (anyone may), the finding does not follow from them.
    findings = json.loads(json.dumps(document))
    win = next(f for f in findings["findings"] if f["name"] == "win2019")
    win.update(category="rebuildable", profile="debian-13", missing=None, detail=[])
    path.write_text(json.dumps(findings))
    with pytest.raises(PlanFileError, match="does not match its seal"):
        read_plan(path)
    findings["seal"] = seal_of(findings)
    path.write_text(json.dumps(findings))
    edited = read_plan(path)
    with pytest.raises(PlanFileError, match="finding for win2019 does not follow"):
        await deployer.migrations.apply(edited, "bob")
    assert await deployer.store.builds.recent() == []


async def test_the_cli_plans_then_applies_and_waits_with_the_counts(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path
) -> None:
    """The command line end to end: `migrate plan` keeps the plan (file and id),
    `migrate apply FILE` builds on the simulator (a state file shared by the processes)
    and waits, printing the counts at both ends; by its id again, nothing is started
    twice; an unknown plan is refused."""
    config = tmp_path / "deploybot.toml"
    source = lab.sim.config(port=proxy.port)
    state = tmp_path / "sim-state.json"
    config.write_text(
        f'database = "{tmp_path / "db.sqlite"}"\nlog_file = "{tmp_path / "bot.log"}"\n\n'
        f'[[backends]]\nkind = "sim"\nname = "sim"\ntime_scale = {SIM_SCALE}\n'
        f'state_file = "{state}"\n\n[[backends]]\n{_toml(source)}\n\n'
        # The simulator's guests: addresses nothing connects to (its guests are not real).
        '[[subnets]]\ncidr = "10.0.0.0/24"\ngateway = "10.0.0.1"\n'
        'dns = ["10.0.0.2"]\n\n[defaults]\nbackend = "sim"\n'
        'ssh_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2'
        'ycJ0b1Fq8 test"]\n'
    )
    out = tmp_path / "plan.json"
    code, text = await deploybot(
        config, tmp_path, "migrate", "plan", "--from", "vcenter", "--to", "sim",
        "--folder", "golden", "--out", str(out),
    )  # fmt: skip
    assert code == 0, text
    (kept,) = [w for w in text.split() if w.startswith("m") and len(w) == 11 and w[-1] == ":"]
    plan_id = kept[:-1]
    code, text = await deploybot(config, tmp_path, "migrate", "apply", str(out))
    assert code == 0, text
    assert "alma-9           for alma-9-golden, alma-base: build started" in text
    assert table_of(text) == {
        "rebuild": (4, "4"), "on target": (0, "0"), "not mappable": (1, "0"),
        "total": (5, "4"), "moves as is": (0, STAYS), "decisions": (0, STAYS),
        "blocked": (0, STAYS),
    }  # fmt: skip
    assert "Profiles on sim: 3 of the 3 the migrating templates need: alma-9" in text
    assert "smoke test passed" in text  # the builds' own progress, run by this process
    code, text = await deploybot(config, tmp_path, "migrate", "apply", plan_id)
    assert code == 0, text
    assert text.count("not again") == 3 and "build started" not in text
    # --json: the same counts, stdout a JSON document alone.
    code, stdout, stderr = await run_deploybot(
        config, tmp_path, "migrate", "apply", plan_id, "--json"
    )  # fmt: skip
    assert code == 0, stdout + stderr
    document = json.loads(stdout)
    assert document["counts"] == {
        "template": {
            "rebuildable": {"source": 4, "target": 4},
            "on-target": {"source": 0, "target": 0},
            "not-mappable": {"source": 1, "target": 0},
        },
        "vm": {
            c: {"source": 0, "target": None, "note": STAYS}
            for c in ("moves-as-is", "needs-decisions", "blocked")
        },
    }
    assert document["ended"] is True and document["left"]["under_way"] == []
    assert [p["profile"] for p in document["profiles_on_target"]] == [
        "alma-9", "debian-13", "ubuntu-22.04"]  # fmt: skip
    assert [f["name"] for f in document["left"]["not_mappable"]] == ["win2019"]
    code, text = await deploybot(config, tmp_path, "migrate", "apply", "mnotaplan2")
    assert code == 2 and "There is no migration plan mnotaplan2" in text
    assert proxy.mutations() == []


def _toml(entry: dict[str, Any]) -> str:
    lines = []
    for key, value in entry.items():
        text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
        lines.append(f"{key} = {text}")
    return "\n".join(lines)


async def deploybot(config: Path, cwd: Path, *args: str) -> tuple[int, str]:
    code, out, err = await run_deploybot(config, cwd, *args)
    return code, out + err


async def run_deploybot(config: Path, cwd: Path, *args: str) -> tuple[int, str, str]:
    return await run_async(config, cwd, {"VCSIM_PASSWORD": PASSWORD}, *args)


async def test_slack_plans_and_applies_by_id_for_approvers_only(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/deploy migrate plan` keeps the plan and answers a compact table with its id;
    `/deploy migrate apply ID` starts the builds; both refuse a non-approver; applied
    again, nothing starts twice and the end is counted."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    backends = lab_backends(lab, proxy)
    async with slack_bot(tmp_path, backends=backends) as h:

        async def ask(text: str, user: str) -> Call:
            await h.command(text, user=user)
            await h.settle()
            return h.fake.called("chat.postEphemeral", user=user)[-1]

        plan_text = "migrate plan --from vcenter --to sim folder=golden"
        refused = await ask(plan_text, ALICE)
        assert "Only approvers plan and apply migrations" in refused.text
        answer = await ask(plan_text, BOB)
        assert answer.args["blocks"][0]["text"]["text"].startswith("```")
        assert "Templates: 5 in scope: 4 rebuild, 0 on target, 1 not mappable." in answer.text
        assert "alma-base" in answer.text and "not mappable" in answer.text
        found = re.search(r"Migration plan (m[a-z0-9]{9}) \(dry run", answer.text)
        assert found, answer.text
        plan_id = found.group(1)
        assert f"/deploy migrate apply {plan_id}" in answer.text

        refused = await ask(f"migrate apply {plan_id}", ALICE)
        assert "Only approvers" in refused.text
        assert await h.deployer.store.builds.recent() == []
        started = await ask(f"migrate apply {plan_id}", BOB)
        assert started.text.count("build started") == 3, started.text
        # Answered at once: the builds are queued, the target holds none yet.
        assert "Counts, source vcenter against target sim now:" in started.text
        assert table_of(started.text)["rebuild"] == (4, "0")
        await h.deployer.drain()
        await h.settle()
        builds = await h.deployer.store.builds.recent()
        assert sorted(b.state for b in builds) == [BuildState.PUBLISHED] * 3
        assert {b.requester for b in builds} == {BOB}
        again = await ask(f"migrate apply {plan_id}", BOB)
        assert again.text.count("not again") == 3 and "build started" not in again.text
        assert table_of(again.text)["rebuild"] == (4, "4")
        assert table_of(again.text)["total"] == (5, "4")
        assert "Profiles on sim: 3 of the 3 the migrating templates need" in again.text
        assert "win2019: no build profile is for its guest OS" in again.text
        missing = await ask("migrate apply mnotaplan2", BOB)
        assert "There is no migration plan mnotaplan2" in missing.text
        # From chat, --from names a configured backend: a URL is refused unread.
        url = await ask("migrate plan --from http://127.0.0.1:9/a.ova --to sim", BOB)
        assert "--from takes the name of a configured backend" in url.text, url.text
        assert "--from-ova URL" in url.text
        audit = [(e.actor, e.action, e.outcome) for e in await h.deployer.store.audit.events()]
        assert (ALICE, f"migrate apply {plan_id}", "refused") in audit
    assert proxy.mutations() == []


async def test_no_wait_leaves_the_builds_to_a_serving_process(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    """`--no-wait`: the builds are recorded queued and nobody's, so a serving process
    (here the fixture's, which takes over queued work) claims and runs them."""
    plan = await plan_of(lab, proxy, target, Scope(folder="golden", name="debian-*"))
    applied = await deployer.migrations.apply(plan, "bob", hand_off=True)
    ((rebuild),) = applied.rebuilds
    assert rebuild.started and rebuild.build is not None
    assert (rebuild.build.state, rebuild.build.owner) == (BuildState.QUEUED, None)
    await deployer.drain()  # claims what is queued and nobody's, and runs it
    done = await deployer.migrations.outcome(applied)
    assert done.missing() == set() and done.rebuilds[0].build is not None
    assert done.rebuilds[0].build.owner == deployer.runner.id
    assert done.rebuilds[0].build.state is BuildState.PUBLISHED


ROW = re.compile(
    r"^  (rebuild|on target|not mappable|total|moves as is|decisions|blocked) +(\d+) +(.+)$"
)


def table_of(text: str) -> dict[str, tuple[int, str]]:
    """The apply's count table: category -> (source count, what the target column says)."""
    rows = [ROW.match(line) for line in text.splitlines()]
    return {m.group(1): (int(m.group(2)), m.group(3)) for m in rows if m is not None}


def _debian(source_id: str, name: str) -> TemplateFacts:
    return TemplateFacts(
        source_id=source_id,
        name=name,
        guest_id="debian10_64Guest",
        annotation="Debian 12",
        extra=(),
        nics=(),
        disk_controllers=(),
        hardware_version="vmx-13",
    )


def test_the_chat_table_keeps_source_text_on_one_line_and_inside_its_block() -> None:
    """Names and notes come from the source: in chat's monospace block a backtick would
    end the block and a newline would break the table, so neither passes; the first
    findings are shown, the rest counted (Slack escapes <, > and & as for every answer)."""
    odd = _debian("u-odd", "a-evil```<!here>\nname")
    many = [_debian(f"u{i:02}", f"deb-{i:02}") for i in range(CHAT_FINDINGS + 3)]
    plan = classify("vcenter", "pve", Scope(), [odd, *many], catalogue(), [], utcnow())
    kept = KeptPlan(digest=plan.digest, document="{}", created_by="bob")
    lines = kept_plan_lines(kept, plan, 3600)
    text = "\n".join(lines)
    assert "```" not in text and "\n" not in "".join(lines)
    assert "a-evil'''<!here> name" in text  # one line, its backticks quoted
    assert "... and 4 more" in text  # 16 findings, 12 shown
    assert f"`/deploy migrate apply {kept.id}`" in text


async def test_the_source_is_never_its_own_target(
    lab: Simulated,
    proxy: SoapProxy,
    target: SimBackend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same backend, or a second entry naming the same server (host:port, the host
    in another case), is refused as the target of a plan and of an apply: its builds
    would land on the vCenter being left. Nothing is read, nothing started."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    source = lab.sim.config(port=proxy.port)
    again = {**source, "name": "vcenter-again", "host": source["host"].upper() + "."}
    backends = [{"kind": "sim", "name": "sim", "time_scale": SIM_SCALE}, source, again]
    settings = make_settings(tmp_path, backends=backends)
    plan = await plan_of(lab, proxy, target, GOLDEN_SCOPE)
    read = len(proxy.seen)
    async with running_deployer(settings, backends={"sim": target}, grace_s=5) as d:
        with pytest.raises(UserError, match="--from and --to both name vcenter: "):
            await d.migrations.plan("vcenter", "vcenter", GOLDEN_SCOPE, "bob")
        same = r"vcenter and vcenter-again are the same server \(127\.0\.0\.1:\d+\)"
        with pytest.raises(UserError, match=same):
            await d.migrations.plan("vcenter", "vcenter-again", GOLDEN_SCOPE, "bob")
        for onto in ("vcenter", "vcenter-again"):
            with pytest.raises(UserError, match="Nothing was changed"):
                await d.migrations.apply(replace(plan, target=onto), "bob")
        assert await d.store.builds.recent() == []
    assert len(proxy.seen) == read and proxy.mutations() == []


async def test_the_cli_refuses_a_target_that_is_the_source(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path
) -> None:
    config = tmp_path / "deploybot.toml"
    source = lab.sim.config(port=proxy.port)
    again = {**source, "name": "vcenter-again"}
    config.write_text(
        f'database = "{tmp_path / "db.sqlite"}"\nlog_file = "{tmp_path / "bot.log"}"\n\n'
        f"[[backends]]\n{_toml(source)}\n\n[[backends]]\n{_toml(again)}\n\n"
        '[[subnets]]\ncidr = "10.0.0.0/24"\ngateway = "10.0.0.1"\ndns = ["10.0.0.2"]\n'
    )
    for onto, said in (("vcenter", "both name vcenter"), ("vcenter-again", "same server")):
        code, text = await deploybot(
            config, tmp_path, "migrate", "plan", "--from", "vcenter", "--to", onto
        )
        assert code == 2 and said in text and "Nothing was changed" in text, text
        assert "Traceback" not in text
    assert proxy.mutations() == []


def _small_plan(made_at: Any) -> Plan:
    facts = [_debian("vm-1", "deb-a")]
    return classify("vcenter", "sim", GOLDEN_SCOPE, facts, catalogue(), [], made_at)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("made_at", "2099-01-01T00:00:00+00:00"),  # re-dated: never too old
        ("target", "elsewhere"),  # re-targeted
        ("target_templates", [["x", "debian-12", 1]]),
    ],
)
def test_a_plan_file_re_dated_or_re_targeted_is_refused(
    key: str, value: Any, tmp_path: Path
) -> None:
    """The digest covers the source's facts; the seal the rest of the document."""
    path = tmp_path / "plan.json"
    write_plan(_small_plan(utcnow()), path)
    assert read_plan(path).target == "sim"  # as written, it reads back
    document = json.loads(path.read_text())
    document[key] = value
    path.write_text(json.dumps(document))
    with pytest.raises(PlanFileError, match=r"does not match its seal.*make a new plan"):
        read_plan(path)
    del document["seal"]
    path.write_text(json.dumps(document))
    with pytest.raises(PlanFileError, match="does not match its seal"):
        read_plan(path)


def test_a_plan_from_the_future_or_without_a_time_zone_is_refused() -> None:
    now = utcnow()
    check_age(_small_plan(now + timedelta(minutes=4)), now, 3600)  # a clock a little fast
    with pytest.raises(PlanFileError, match=r"later than now.*make a new plan"):
        check_age(_small_plan(now + timedelta(days=30)), now, 3600)
    with pytest.raises(PlanFileError, match=r"has no time zone.*make a new plan"):
        check_age(_small_plan(now.replace(tzinfo=None)), now, 3600)


async def test_a_permanent_error_says_what_to_fix_never_to_try_again(
    lab: Simulated,
    proxy: SoapProxy,
    target: SimBackend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A source whose name does not resolve will not resolve on a retry either: the
    plan and the apply say what to fix, never to try again; nothing is started."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    plan = await plan_of(lab, proxy, target, GOLDEN_SCOPE)
    unresolved = {**lab.sim.config(port=proxy.port), "host": "vcenter.invalid"}
    backends = [{"kind": "sim", "name": "sim", "time_scale": SIM_SCALE}, unresolved]
    settings = make_settings(tmp_path, backends=backends)
    async with running_deployer(settings, backends={"sim": target}, grace_s=5) as d:
        with pytest.raises(UserError) as refused:
            await d.migrations.apply(plan, "bob")
        message = refused.value.message
        assert "vcenter.invalid" in message and "try again" not in message, message
        assert "fix what this says" in message and "make a new plan" in message
        with pytest.raises(UserError) as refused:
            await d.migrations.plan("vcenter", "sim", GOLDEN_SCOPE, "bob")
        message = refused.value.message
        assert "vcenter.invalid" in message and "try again" not in message, message
        assert "fix what this says" in message and "no plan was kept" in message
        assert await d.store.builds.recent() == []


async def test_chat_plans_read_configured_backends_never_a_url(deployer: Deployer) -> None:
    """A URL typed in chat would be fetched by the bot (any host it can reach): refused
    before anything is opened; OVAs are planned from the command line."""
    with pytest.raises(UserError, match="--from takes the name of a configured backend"):
        await deployer.migrations.plan("http://127.0.0.1:9/a.ova", "sim", GOLDEN_SCOPE, "bob")


class _SlowTarget(SimBackend):
    """The simulator answering its templates late: a build publishes after the list
    was read and before the answer arrives (`meanwhile`)."""

    meanwhile: Any = None

    async def template_versions(self, *args: Any) -> Any:
        versions = await super().template_versions(*args)
        if self.meanwhile is not None:
            await self.meanwhile()
        return versions


async def test_a_build_that_publishes_during_the_apply_is_not_built_twice(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's builds are read before the target's templates: a build in flight
    that publishes between the two reads is seen in flight (or its template seen),
    never as a published build whose template is gone, which would build it again."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    slow = _SlowTarget("sim", time_scale=SIM_SCALE)
    scope = Scope(folder="golden", name="debian-*")
    plan = await plan_of(lab, proxy, slow, scope)
    settings = lab_settings(tmp_path, lab, proxy)
    async with running_deployer(settings, backends={"sim": slow}, grace_s=5) as d:
        first = await d.builds.request("debian-13", "sim", "bob")
        slow.meanwhile = d.drain  # the build runs to its end while the list is on its way
        applied = await d.migrations.apply(plan, "bob")
        slow.meanwhile = None
        await d.drain()
        builds = await d.store.builds.recent()
    assert [b.id for b in builds if b.profile == "debian-13"] == [first.id], builds
    (rebuild,) = [r for r in applied.rebuilds if r.profile == "debian-13"]
    assert not rebuild.started


def _windows(source_id: str, name: str) -> TemplateFacts:
    return replace(_debian(source_id, name), guest_id="windows2019srv_64Guest", annotation="W")


def test_the_chat_apply_reply_keeps_source_text_flat_and_caps_what_is_left() -> None:
    """The apply's answer in chat flattens source text as the plan's table does and
    lists the first templates left, the rest counted (the count comes first)."""
    odd = _debian("u-odd", "deb-evil```\nname")
    left = [_windows(f"w{i:02}", f"win-{i:02}```\nx") for i in range(CHAT_FINDINGS + 3)]
    plan = classify("vcenter", "pve", Scope(), [odd, *left], catalogue(), [], utcnow())
    (profile,) = {f.profile for f in plan.findings if f.profile}
    rebuild = Rebuild(profile, ("deb-evil```\nname",), refused="no approver`s\nanswer")
    outcome = Outcome(Applied(plan, (rebuild,)), {})
    lines = applied_lines(outcome, ends=True, cap=CHAT_FINDINGS)
    text = "\n".join(lines)
    assert "```" not in text and all("\n" not in line for line in lines)
    assert f"Left: {len(left)} template(s) not mappable" in text
    assert "... and 3 more" in text
    assert sum(line.startswith("  win-") for line in lines) == CHAT_FINDINGS
    assert "deb-evil''' name" in text and "no approver's answer" in text
    # The command line lists every one.
    every = applied_lines(outcome, ends=True)
    assert sum(line.startswith("  win-") for line in every) == len(left)


async def test_an_apply_counts_the_plans_vms_and_moves_none(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    """The simulator's VM DC0_C0_RP0_VM3 (blocked: no subnet maps its network): counted
    per category on the source, and said to stay there; nothing is built for it."""
    plan = await plan_of(lab, proxy, target, Scope(name="DC0_*"))
    applied = await deployer.migrations.apply(plan, "bob")
    assert applied.rebuilds == ()
    outcome = await deployer.migrations.outcome(applied)
    text = "\n".join(applied_lines(outcome, ends=True))
    assert table_of(text) == {
        "rebuild": (0, "0"), "on target": (0, "0"), "not mappable": (0, "0"),
        "total": (0, "0"), "moves as is": (0, STAYS), "decisions": (0, STAYS),
        "blocked": (1, STAYS),
    }  # fmt: skip
    assert "Left on vcenter: 1 VM(s), as the plan found them (an apply moves no VM" in text
    assert await deployer.store.builds.recent() == []
    assert proxy.mutations() == []


def _blocks_text(call: Call) -> str:
    blocks = call.args.get("blocks") or []
    return "\n".join(str(b["text"]["text"]).strip("`") for b in blocks if "text" in b)


def _ends(fake: FakeSlack) -> list[Call]:
    """The apply's end, told in the channel it was asked from."""
    return [
        c
        for c in fake.called("chat.postMessage", channel=CHANNEL)
        if "every build has ended" in c.text and "thread_ts" not in c.args
    ]


async def _plan_in_slack(h: Harness) -> str:
    await h.command("migrate plan --from vcenter --to sim folder=golden", user=BOB)
    await h.bot.settle()
    answer = h.fake.called("chat.postEphemeral", user=BOB)[-1]
    found = re.search(r"Migration plan (m[a-z0-9]{9}) \(dry run", answer.text)
    assert found, answer.text
    return found.group(1)


async def test_slack_tells_the_end_of_an_apply_in_its_channel_once(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/deploy migrate apply` answers at once; when its last build ends, the channel
    it was asked from gets the final table (drawn from the store), once: a restart of
    the bot on the same database and Slack does not say it again."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    backends = lab_backends(lab, proxy)
    fake = await new_fake()
    try:
        async with slack_bot(tmp_path, backends=backends, fake=fake) as h:
            plan_id = await _plan_in_slack(h)
            await h.command(f"migrate apply {plan_id}", user=BOB)
            await h.bot.settle()
            started = h.fake.called("chat.postEphemeral", user=BOB)[-1]
            assert "final table is posted in this channel" in started.text, started.text
            await h.deployer.drain()
            await h.settle()
            (end,) = _ends(fake)
            assert f"migration apply of plan {plan_id} from vcenter to sim" in end.text
            assert f"<@{BOB}>" in end.text  # the one who asked
            table = _blocks_text(end)
            assert table_of(table) == {
                "rebuild": (4, "4"), "on target": (0, "0"), "not mappable": (1, "0"),
                "total": (5, "4"), "moves as is": (0, STAYS), "decisions": (0, STAYS),
                "blocked": (0, STAYS),
            }  # fmt: skip
            assert "Profiles on sim: 3 of the 3 the migrating templates need" in table
            assert "win2019: no build profile is for its guest OS" in table
        async with slack_bot(tmp_path, backends=backends, fake=fake) as again:
            await again.settle()
        assert len(_ends(fake)) == 1
    finally:
        await fake.close()


async def test_the_end_of_an_apply_is_told_by_a_restart_when_its_teller_died(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process that took the apply stops delivering (as if killed) before its
    builds end: the end is in the store with the change that ended the last build, so
    the next process tells it once, and the one after that not again."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    backends = lab_backends(lab, proxy)
    fake = await new_fake()
    try:
        async with slack_bot(tmp_path, backends=backends, fake=fake) as h:
            plan_id = await _plan_in_slack(h)
            await h.threads.close()  # its deliverer is gone: nothing more reaches Slack
            await h.command(f"migrate apply {plan_id}", user=BOB)
            await h.bot.settle()
            await h.deployer.drain()
            builds = await h.deployer.store.builds.recent()
            assert sorted(b.state for b in builds) == [BuildState.PUBLISHED] * 3
        assert _ends(fake) == []
        async with slack_bot(tmp_path, backends=backends, fake=fake) as restarted:
            await restarted.settle()
        (end,) = _ends(fake)
        assert table_of(_blocks_text(end))["total"] == (5, "4")
        async with slack_bot(tmp_path, backends=backends, fake=fake) as third:
            await third.settle()
        assert len(_ends(fake)) == 1
    finally:
        await fake.close()


async def test_a_chat_apply_run_again_or_redelivered_tells_its_end_once(
    deployer: Deployer, lab: Simulated, proxy: SoapProxy, target: SimBackend
) -> None:
    """The same command recorded twice (its process died before its inbox item was
    done, and another ran it again) and another approver's re-run in the same channel,
    all while the build waits for an approver: one apply is kept, and the build's end
    tells its table once. The re-run says the table comes once."""
    kept, plan = await deployer.migrations.plan(
        "vcenter", "sim", Scope(folder="golden", name="alma-*"), "bob"
    )

    async def apply(user: str, key: str) -> Applied:
        return await deployer.migrations.apply(
            plan, user, origin="C0DEPLOYS", plan_id=kept.id, dedupe_key=key
        )

    first = await apply("alice", "slash:T1:trigger-1")
    (rebuild,) = first.rebuilds
    assert rebuild.build is not None and rebuild.build.state is BuildState.AWAITING_APPROVAL
    again = await apply("alice", "slash:T1:trigger-1")
    assert again.recorded == first.recorded and not again.joined
    rerun = await apply("carol", "slash:T1:trigger-2")
    assert rerun.recorded == first.recorded and rerun.joined
    text = "\n".join(applied_lines(await deployer.migrations.outcome(rerun), ends=False))
    assert f"under way ({first.recorded}): its final table is posted here once" in text
    await deployer.decide_build(rebuild.build.id, "bob", True)
    await deployer.drain()
    notices = await deployer.store.outbox.undelivered(rebuild.build.id)
    assert [n.text for n in notices if n.step == MIGRATION_ENDED] == [first.recorded]
