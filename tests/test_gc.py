"""`deploybot gc` logic: classification, the dry-run rule, and never touching untagged VMs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.sim import SimBackend
from backends.tags import job_tag
from bot.config.settings import Settings
from bot.models import Job, JobState
from bot.models.errors import UserError
from bot.operations import gc
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from store.db import Store
from tests.support.deployer import make_settings

OTHER_INSTALLATION = "zz2zz3zz4z"


async def seeded(tmp_path: Path) -> tuple[Settings, Store, SimBackend, dict[str, str]]:
    """A hypervisor with one VM of each kind, and a store that knows some of their jobs."""
    settings = make_settings(tmp_path)
    store = await Store.open(settings.database)
    sim = SimBackend("sim", time_scale=0.001)
    mine = store.installation_id
    legacy_ids: list[str] = []

    async def job(name: str, address: str, state: JobState, *, legacy: bool = False) -> Job:
        args = parse(f"{name} {address}")
        assert isinstance(args, DeployArgs)
        made = Job.for_request(build_request(args, settings, "alice"), JobState.QUEUED)
        made = made.model_copy(update={"installation": None if legacy else mine})
        if legacy:  # the ids of that time: 'j' and six characters
            made = made.model_copy(update={"id": f"jold{len(legacy_ids):03d}"})
            legacy_ids.append(made.id)
        await store.jobs.insert(made)
        path = {
            JobState.SUCCEEDED: [JobState.RUNNING, JobState.SUCCEEDED],
            JobState.FAILED: [JobState.RUNNING, JobState.ROLLING_BACK, JobState.FAILED],
            JobState.RUNNING: [JobState.RUNNING],
        }[state]
        current = JobState.QUEUED
        for nxt in path:
            assert await store.jobs.transition(made.id, [current], nxt)
            current = nxt
        return made

    ok = await job("keep", "10.0.0.10", JobState.SUCCEEDED)
    failed = await job("wreck", "10.0.0.11", JobState.FAILED)
    busy = await job("busy", "10.0.0.12", JobState.RUNNING)
    # Jobs recorded before installations had ids keep their bare tags, and count as ours.
    old_ok = await job("oldkeep", "10.0.0.13", JobState.SUCCEEDED, legacy=True)
    old_failed = await job("oldwreck", "10.0.0.14", JobState.FAILED, legacy=True)
    vms = {
        "succeeded": sim.add_vm("keep", tags={job_tag(ok.id, mine)}),
        "wreck": sim.add_vm("wreck", tags={job_tag(failed.id, mine)}),
        "busy": sim.add_vm("busy", tags={job_tag(busy.id, mine)}),
        "old-succeeded": sim.add_vm("oldkeep", tags={job_tag(old_ok.id)}),
        "old-wreck": sim.add_vm("oldwreck", tags={job_tag(old_failed.id)}),
        "unknown": sim.add_vm("ghost", tags={job_tag("jghost1", mine)}, running=False),
        "old-unknown": sim.add_vm("oldghost", tags={job_tag("jghost2")}, running=False),
        "other-installation": sim.add_vm(
            "theirs", tags={job_tag("jtheirs1234", OTHER_INSTALLATION)}
        ),
        "human-tag": sim.add_vm("managed", tags={"deploybot-managed", "deploybot-"}),
        "untagged": sim.add_vm("someone-elses"),
        "other-tags": sim.add_vm("prod-db", tags={"prod", "backup"}),
    }
    return settings, store, sim, vms


KEPT_VMS = (
    "succeeded",
    "busy",
    "old-succeeded",
    "old-unknown",
    "other-installation",
    "human-tag",
    "untagged",
    "other-tags",
)


async def test_dry_run_counts_per_category_and_changes_nothing(tmp_path: Path) -> None:
    _settings, store, sim, vms = await seeded(tmp_path)
    try:
        report = await gc.dry_run(store, {"sim": sim}, ["sim"])
    finally:
        await store.close()
    counts = report.counts()["sim"]
    assert counts == {
        "succeeded_job": 2,
        "ended_job": 2,
        "job_in_flight": 1,
        "unknown_job": 1,
        "unknown_legacy": 1,
        "other_installation": 1,
    }
    orphans = {vms["wreck"], vms["old-wreck"], vms["unknown"]}
    assert {f.vm.vm_id for f in report.orphans} == orphans
    assert vms["human-tag"] not in {f.vm.vm_id for f in report.findings}
    assert set(sim.vms) == set(vms.values())
    assert not [op for op, _ in sim.task_log if op in ("power_off", "destroy")]


async def test_apply_needs_a_recent_dry_run_of_the_same_scope(tmp_path: Path) -> None:
    settings, store, sim, vms = await seeded(tmp_path)
    try:
        with pytest.raises(UserError, match="No dry run of this scope"):
            await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=600)
        await gc.dry_run(store, {"sim": sim}, ["sim"])
        with pytest.raises(UserError, match="No dry run"):
            await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=0)
        report = await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=600)
    finally:
        await store.close()
    assert {f.vm.vm_id for f in report.removed} == {
        vms["wreck"],
        vms["old-wreck"],
        vms["unknown"],
    }
    left = {f.vm.vm_id: why for f, why in report.left}
    assert left[vms["succeeded"]] == left[vms["old-succeeded"]] == "its job succeeded"
    assert left[vms["busy"]] == "its job is in flight"
    assert left[vms["other-installation"]].startswith("another installation's VM")
    assert left[vms["old-unknown"]].startswith("an old-style tag")
    assert set(sim.vms) == {vms[k] for k in KEPT_VMS}


async def test_apply_leaves_orphans_the_dry_run_did_not_list(tmp_path: Path) -> None:
    settings, store, sim, vms = await seeded(tmp_path)
    try:
        await gc.dry_run(store, {"sim": sim}, ["sim"])
        late = sim.add_vm("late", tags={job_tag("jlate12", store.installation_id)})
        sim.inject("destroy", "error")
        report = await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=600)
    finally:
        await store.close()
    reasons = {f.vm.vm_id: why for f, why in report.left}
    assert reasons[late] == "not in the dry run: run the dry run again"
    orphans = (vms["wreck"], vms["old-wreck"], vms["unknown"])
    failed = [why for vm_id, why in reasons.items() if vm_id in orphans]
    assert len(failed) == 1 and failed[0].startswith("removal failed")
    assert late in sim.vms


def test_gc_command_dry_run_then_apply(tmp_path: Path) -> None:
    """The real command on a hypervisor (the simulator's state file) seeded with orphans."""
    state = tmp_path / "sim.json"

    async def seed() -> dict[str, str]:
        _settings, store, sim, vms = await seeded(tmp_path)
        await store.close()
        sim.state_file = state
        sim.inventory.save()  # the hypervisor as the seeding left it
        return vms

    vms = asyncio.run(seed())
    config = tmp_path / "deploybot.toml"
    config.write_text(
        f'database = "{tmp_path}/jobs.db"\nlog_file = "{tmp_path}/bot.log"\n'
        f'[[backends]]\nkind = "sim"\nname = "sim"\nstate_file = "{state}"\n'
        '[[subnets]]\ncidr = "10.0.0.0/24"\ngateway = "10.0.0.1"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env["DEPLOYBOT_CONFIG"] = str(config)

    def gc_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "handlers.entry", "gc", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = gc_cli("--apply")
    assert refused.returncode == 2 and "No dry run of this scope" in refused.stderr
    dry = gc_cli()
    assert dry.returncode == 0, dry.stderr
    assert "gc dry run over sim (nothing was touched):" in dry.stdout
    assert "2 VMs: job failed or was cancelled; 1 VM: job still in flight (kept); " in dry.stdout
    assert f"orphan: VM {vms['unknown']} (ghost) on sim, job jghost1" in dry.stdout
    theirs = vms["other-installation"]
    assert f"another installation: VM {theirs} (theirs) on sim, installation " in dry.stdout
    assert "Found 3 orphan(s)." in dry.stdout
    assert gc_cli("--backend", "nope").returncode == 2
    applied = gc_cli("--apply")
    assert applied.returncode == 0, applied.stderr
    assert "Found 3 orphan(s), removed 3, left 5." in applied.stdout
    left = {vm["vm_id"] for vm in json.loads(state.read_text())["vms"]}
    assert left == {vms[k] for k in KEPT_VMS}
