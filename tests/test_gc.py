"""`deploybot gc` logic: classification, the dry-run rule, and never touching untagged VMs."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.base import job_tag
from backends.sim import SimBackend
from bot import gc
from bot.errors import DeployBotError
from bot.models import Job, JobState
from bot.parser import DeployArgs, parse
from bot.requests import build_request
from bot.settings import Settings
from store.db import Store
from tests.conftest import make_settings


async def seeded(tmp_path: Path) -> tuple[Settings, Store, SimBackend, dict[str, str]]:
    """A hypervisor with one VM of each kind, and a store that knows some of their jobs."""
    settings = make_settings(tmp_path)
    store = await Store.open(settings.database)
    sim = SimBackend("sim", time_scale=0.001)

    async def job(name: str, address: str, state: JobState) -> Job:
        args = parse(f"{name} {address}")
        assert isinstance(args, DeployArgs)
        made = Job.for_request(build_request(args, settings, "alice"), JobState.QUEUED)
        await store.insert_job(made)
        path = {
            JobState.SUCCEEDED: [JobState.RUNNING, JobState.SUCCEEDED],
            JobState.FAILED: [JobState.RUNNING, JobState.ROLLING_BACK, JobState.FAILED],
            JobState.RUNNING: [JobState.RUNNING],
        }[state]
        current = JobState.QUEUED
        for nxt in path:
            assert await store.transition(made.id, [current], nxt)
            current = nxt
        return made

    ok = await job("keep", "10.0.0.10", JobState.SUCCEEDED)
    failed = await job("wreck", "10.0.0.11", JobState.FAILED)
    busy = await job("busy", "10.0.0.12", JobState.RUNNING)
    vms = {
        "succeeded": sim.add_vm("keep", tags={job_tag(ok.id)}),
        "wreck": sim.add_vm("wreck", tags={job_tag(failed.id)}),
        "busy": sim.add_vm("busy", tags={job_tag(busy.id)}),
        "unknown": sim.add_vm("ghost", tags={job_tag("jghost1")}, running=False),
        "untagged": sim.add_vm("someone-elses"),
        "other-tags": sim.add_vm("prod-db", tags={"prod", "backup"}),
    }
    return settings, store, sim, vms


async def test_dry_run_counts_per_category_and_changes_nothing(tmp_path: Path) -> None:
    _settings, store, sim, vms = await seeded(tmp_path)
    try:
        report = await gc.dry_run(store, {"sim": sim}, ["sim"])
    finally:
        await store.close()
    counts = report.counts()["sim"]
    assert counts == {"succeeded_job": 1, "ended_job": 1, "job_in_flight": 1, "unknown_job": 1}
    assert {f.vm.vm_id for f in report.orphans} == {vms["wreck"], vms["unknown"]}
    assert set(sim.vms) == set(vms.values())
    assert not [op for op, _ in sim.task_log if op in ("power_off", "destroy")]


async def test_apply_needs_a_recent_dry_run_of_the_same_scope(tmp_path: Path) -> None:
    settings, store, sim, vms = await seeded(tmp_path)
    try:
        with pytest.raises(DeployBotError, match="No dry run of this scope"):
            await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=600)
        await gc.dry_run(store, {"sim": sim}, ["sim"])
        with pytest.raises(DeployBotError, match="No dry run"):
            await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=0)
        report = await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=600)
    finally:
        await store.close()
    assert {f.vm.vm_id for f in report.removed} == {vms["wreck"], vms["unknown"]}
    left = {f.vm.vm_id: why for f, why in report.left}
    assert left == {vms["succeeded"]: "its job succeeded", vms["busy"]: "its job is in flight"}
    assert set(sim.vms) == {vms["succeeded"], vms["busy"], vms["untagged"], vms["other-tags"]}


async def test_apply_leaves_orphans_the_dry_run_did_not_list(tmp_path: Path) -> None:
    settings, store, sim, vms = await seeded(tmp_path)
    try:
        await gc.dry_run(store, {"sim": sim}, ["sim"])
        late = sim.add_vm("late", tags={job_tag("jlate12")})
        sim.inject("destroy", "error")
        report = await gc.apply(store, {"sim": sim}, ["sim"], settings.timeouts, window_s=600)
    finally:
        await store.close()
    reasons = {f.vm.vm_id: why for f, why in report.left}
    assert reasons[late] == "not in the dry run: run the dry run again"
    failed = [why for vm_id, why in reasons.items() if vm_id in (vms["wreck"], vms["unknown"])]
    assert len(failed) == 1 and failed[0].startswith("removal failed")
    assert late in sim.vms
