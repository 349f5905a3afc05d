"""`migrate apply` (issue 30): a plan of a vcsim source, read through the read-only
session type behind a counting proxy, applied to the simulator as the target (which
builds templates through the real build kind: queue, pre-flight, smoke deploy, publish).
Each profile is built once, the final counts match, an apply run again starts nothing
twice, builds that need an approver wait for one, and a plan that is too old, whose
source changed or whose file was edited is refused with nothing started. The source
never sees a mutating SOAP method."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
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
from bot.migration.apply import PlanTooOld, SourceChanged
from bot.migration.plan import Plan, PlanFileError, classify, make_plan, read_plan, write_plan
from bot.models import utcnow
from bot.models.builds import BuildState
from bot.models.plans import KeptPlan
from handlers.messages.migration import CHAT_FINDINGS, applied_lines, kept_plan_lines
from tests.support.deployer import SIM_SCALE, make_settings
from tests.support.slack.bot import ALICE, BOB, slack_bot
from tests.support.slack.fake_api import Call
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
from tests.support.vsphere.soapproxy import READ_METHODS, SoapProxy

GOLDEN_SCOPE = Scope(folder="golden")


@pytest.fixture(scope="module")
def lab(vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path_factory: Any) -> Iterator[Simulated]:
    workdir = tmp_path_factory.mktemp("apply-vcsim")
    with simulator(vcsim_binary, vcsim_tls, workdir, esx=False, vms_per_pool=4) as simulated:
        apply_inventory(simulated.sim)
        yield simulated


@pytest.fixture
async def proxy(lab: Simulated) -> AsyncIterator[SoapProxy]:
    counting = SoapProxy(lab.sim.port, lab.sim.tls)
    await counting.start()
    yield counting
    await counting.stop()


def lab_settings(tmp_path: Path, lab: Simulated, proxy: SoapProxy, **overrides: Any) -> Settings:
    """The simulator as the target, vcsim (through the proxy) as the source."""
    backends = [
        {"kind": "sim", "name": "sim", "time_scale": SIM_SCALE},
        lab.sim.config(port=proxy.port),
    ]
    return make_settings(tmp_path, backends=backends, **overrides)


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
    text = "\n".join(applied_lines(outcome, ends=True))
    assert "Source templates: 5 in scope: 3 rebuild, 1 on target, 1 not mappable." in text
    assert "Target sim after the apply: 3 of the 3 profile(s)" in text
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
    assert "Target sim after the apply: 0 of the 1 profile(s)" in text


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
    # but the finding does not follow from them.
    findings = json.loads(json.dumps(document))
    win = next(f for f in findings["findings"] if f["name"] == "win2019")
    win.update(category="rebuildable", profile="debian-13", missing=None, detail=[])
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
    assert "Source templates: 5 in scope: 4 rebuild, 0 on target, 1 not mappable." in text
    assert "Target sim after the apply: 3 of the 3 profile(s)" in text
    assert "smoke test passed" in text  # the builds' own progress, run by this process
    code, text = await deploybot(config, tmp_path, "migrate", "apply", plan_id)
    assert code == 0, text
    assert text.count("not again") == 3 and "build started" not in text
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env.update(DEPLOYBOT_CONFIG=str(config), VCSIM_PASSWORD=PASSWORD)
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("deploybot")),
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode() + stderr.decode()


async def test_slack_plans_and_applies_by_id_for_approvers_only(
    lab: Simulated, proxy: SoapProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/deploy migrate plan` keeps the plan and answers a compact table with its id;
    `/deploy migrate apply ID` starts the builds; both refuse a non-approver; applied
    again, nothing starts twice and the end is counted."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    backends = [
        {"kind": "sim", "name": "sim", "time_scale": SIM_SCALE},
        lab.sim.config(port=proxy.port),
    ]
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
        assert "Source templates: 5 in scope" in started.text
        await h.deployer.drain()
        await h.settle()
        builds = await h.deployer.store.builds.recent()
        assert sorted(b.state for b in builds) == [BuildState.PUBLISHED] * 3
        assert {b.requester for b in builds} == {BOB}
        again = await ask(f"migrate apply {plan_id}", BOB)
        assert again.text.count("not again") == 3 and "build started" not in again.text
        assert "Target sim after the apply: 3 of the 3 profile(s)" in again.text
        assert "win2019: no build profile is for its guest OS" in again.text
        missing = await ask("migrate apply mnotaplan2", BOB)
        assert "There is no migration plan mnotaplan2" in missing.text
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
