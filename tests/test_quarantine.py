"""Rows that fail validation when read are quarantined: reported once, never fatal.

Each test writes what an older version, a hand edit or a disk fault could leave in the
database straight into the SQLite file, then starts a real Deployer on it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimBackend
from backends.tags import job_tag
from bot.app.runtime import running_deployer
from bot.config.settings import Settings
from bot.models import Approval, Job, JobEvent, JobState, utcnow
from bot.models.errors import JobUnreadable, RequestInvalid, UserError
from bot.operations import gc
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from handlers.commands import answer
from handlers.messages.slack import gc_report
from store.db import Store
from store.jobs import job_row
from tests.support.deployer import make_settings


def args(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


def make_job(settings: Settings, text: str, state: JobState = JobState.QUEUED) -> Job:
    return Job.for_request(build_request(args(text), settings, "alice"), state)


async def store_jobs(settings: Settings, *jobs: Job, approvals: tuple[Approval, ...] = ()) -> None:
    store = await Store.open(settings.database)  # creates the schema
    try:
        by_job = {a.job_id: a for a in approvals}
        for job in jobs:
            await store.jobs.insert(job, by_job.get(job.id))
    finally:
        await store.close()


def sql(settings: Settings, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    """Write (or read) the file as another tool would, behind the bot's back."""
    conn = sqlite3.connect(settings.database, isolation_level=None)
    try:
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


def quarantine_rows(settings: Settings) -> list[tuple[Any, ...]]:
    return sql(settings, "SELECT table_name, row_key, job_id, reason FROM quarantine ORDER BY id")


def job_state(settings: Settings, job_id: str) -> str:
    return str(sql(settings, "SELECT state FROM jobs WHERE id = ?", [job_id])[0][0])


async def test_a_name_stored_by_unicode_case_folding_no_longer_bricks_the_bot(
    tmp_path: Path, sim: SimBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """What `/deploy İnfra 10.0.0.64` left in the database before names had to be ASCII:
    the name lower-cased to "i" and a combining dot, which no longer validates."""
    settings = make_settings(tmp_path)
    folded = "İnfra".lower()
    bad = make_job(settings, "infra 10.0.0.64", JobState.SUCCEEDED)
    good = make_job(settings, "web01 10.0.0.50", JobState.SUCCEEDED)
    await store_jobs(settings, bad, good)
    request = {**bad.request.model_dump(mode="json"), "name": folded}
    sql(
        settings,
        "UPDATE jobs SET name = ?, request = ? WHERE id = ?",
        [folded, json.dumps(request), bad.id],
    )
    async with running_deployer(settings, backends={"sim": sim}) as d:
        assert [j.id for j in await d.history(10)] == [good.id]
        assert [j.id for j in await d.history(10)] == [good.id]  # read again: no new record
        with pytest.raises(JobUnreadable) as caught:
            await d.status(bad.id[:8])
        assert f"Job {bad.id} cannot be shown: its stored record is damaged" in str(caught.value)
        assert "not an ASCII character" in str(caught.value)
        said = await answer(d, "alice", f"status {bad.id}")
        assert said[0].startswith(f"Job {bad.id} cannot be shown")
        assert (await d.status(good.id)).job.state is JobState.SUCCEEDED
        # Its address is no longer held by the damaged job.
        again = await d.request_deploy(args("infra2 10.0.0.64"), "alice")
        await d.drain()
        assert (await d.status(again.id)).job.state is JobState.SUCCEEDED
    ((table, key, job_id, reason),) = quarantine_rows(settings)
    assert (table, key, job_id) == ("jobs", bad.id, bad.id)
    reported = [r for r in caplog.records if r.name == "store.quarantine"]
    assert len(reported) == 1 and reported[0].levelno == logging.WARNING
    assert bad.id in reported[0].getMessage()
    assert reason.startswith("request.name: Value error")
    assert job_state(settings, bad.id) == "quarantined"
    raw = json.loads(sql(settings, "SELECT raw FROM quarantine")[0][0])
    assert raw["state"] == "succeeded" and raw["name"] == folded  # kept as it was


async def test_a_damaged_queued_job_is_not_run_and_frees_its_name(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(tmp_path)
    broken = make_job(settings, "web01 10.0.0.50")
    fine = make_job(settings, "web02 10.0.0.51")
    await store_jobs(settings, broken, fine)
    sql(settings, "UPDATE jobs SET request = '{\"name\": ' WHERE id = ?", [broken.id])
    async with running_deployer(settings, backends={"sim": sim}) as d:
        await d.drain()
        assert (await d.status(fine.id)).job.state is JobState.SUCCEEDED
        assert [vm.name for vm in sim.vms.values()] == ["web02"]  # the broken one never ran
        with pytest.raises(JobUnreadable, match="request: not valid JSON"):
            await d.status(broken.id)
        with pytest.raises(JobUnreadable):
            await d.cancel(broken.id, "alice")
        again = await d.request_deploy(args("web01 10.0.0.50"), "alice")
        await d.drain()
        assert (await d.status(again.id)).job.state is JobState.SUCCEEDED
    assert [r[:3] for r in quarantine_rows(settings)] == [("jobs", broken.id, broken.id)]


async def test_a_damaged_running_job_is_not_recovered_and_gc_keeps_its_vm(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(tmp_path)
    running = make_job(settings, "web01 10.0.0.50")
    await store_jobs(settings, running)
    store = await Store.open(settings.database)
    installation = store.installation_id
    await store.close()
    vm_id = sim.add_vm("web01", tags={job_tag(running.id, installation)}, running=True)
    sql(
        settings,
        "UPDATE jobs SET state = 'running', vm_id = ?, created_at = 'yesterday' WHERE id = ?",
        [vm_id, running.id],
    )
    async with running_deployer(settings, backends={"sim": sim}) as d:
        await d.drain()
        assert sim.task_log == []  # not stopped, not destroyed: a person must look first
        report = await gc.dry_run(d.store, d.backends, ["sim"])
    assert [(f.vm.vm_id, f.category, f.orphan) for f in report.findings] == [
        (vm_id, "quarantined_job", False)
    ]
    assert "job record damaged, set aside" in "\n".join(gc_report(report, 30))
    assert job_state(settings, running.id) == "quarantined"


async def test_damaged_wreckage_rows_are_skipped_by_the_sweep(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(tmp_path)
    failed = make_job(settings, "web01 10.0.0.50")
    await store_jobs(settings, failed)
    vm_id = sim.add_vm("web01", tags={job_tag(failed.id)})
    sql(
        settings,
        "UPDATE jobs SET state = 'failed', vm_id = ?, wreckage = 'VM', address = '10.0.0.99' "
        "WHERE id = ?",
        [vm_id, failed.id],
    )
    async with running_deployer(settings, backends={"sim": sim}) as d:
        assert await d.sweep_wreckage() == []
        assert vm_id in sim.vms
    assert "address '10.0.0.99' is not the request's" in quarantine_rows(settings)[0][3]


async def test_a_damaged_approval_sets_its_job_aside(tmp_path: Path, sim: SimBackend) -> None:
    settings = make_settings(tmp_path, approval={"approvers": ["bob"], "always": True})
    job = make_job(settings, "web01 10.0.0.50", JobState.AWAITING_APPROVAL)
    approval = Approval(job_id=job.id, reason_required="always", expires_at=utcnow())
    await store_jobs(settings, job, approvals=(approval,))
    sql(settings, "UPDATE approvals SET expires_at = 'soon' WHERE job_id = ?", [job.id])
    async with running_deployer(settings, backends={"sim": sim}) as d:
        with pytest.raises(JobUnreadable, match=r"\(approvals: expires_at: Input should be"):
            await d.status(job.id)
        with pytest.raises(UserError):
            await d.approve(job.id, "bob")
        assert await d.expire_approvals() == []
        assert await d.store.approvals.expired(utcnow().replace(year=2999)) == []
        await d.drain()
    assert sim.vms == {}
    assert [r[:3] for r in quarantine_rows(settings)] == [("approvals", job.id, job.id)]


async def test_a_damaged_approval_of_a_finished_job_is_only_history(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(tmp_path)
    job = make_job(settings, "web01 10.0.0.50", JobState.SUCCEEDED)
    approval = Approval(job_id=job.id, reason_required="always", expires_at=utcnow())
    await store_jobs(settings, job, approvals=(approval,))
    sql(settings, "UPDATE approvals SET state = 'maybe' WHERE job_id = ?", [job.id])
    async with running_deployer(settings, backends={"sim": sim}) as d:
        info = await d.status(job.id)
        assert info.job.state is JobState.SUCCEEDED and info.approval is None
        assert (await d.status(job.id)).approval is None
    assert [r[:3] for r in quarantine_rows(settings)] == [("approvals", job.id, job.id)]
    assert job_state(settings, job.id) == "succeeded"  # still holds its name and address


async def test_a_damaged_event_is_left_out_of_the_status(tmp_path: Path, sim: SimBackend) -> None:
    settings = make_settings(tmp_path)
    job = make_job(settings, "web01 10.0.0.50", JobState.SUCCEEDED)
    await store_jobs(settings, job)
    store = await Store.open(settings.database)
    for step in ("clone", "power_on"):
        await store.jobs.add_event(JobEvent(job_id=job.id, step=step, phase="finished"))
    await store.close()
    sql(settings, "UPDATE job_events SET at = 'noon' WHERE step = 'clone'")
    async with running_deployer(settings, backends={"sim": sim}) as d:
        info = await d.status(job.id)
        assert [e.step for e in info.events] == ["power_on"]
        assert [e.step for e in (await d.status(job.id)).events] == ["power_on"]
    ((table, key, job_id, _reason),) = quarantine_rows(settings)
    assert (table, job_id) == ("job_events", job.id) and key.isdigit()
    assert job_state(settings, job.id) == "succeeded"  # the job itself is intact


async def test_damaged_saved_settings_are_refused_until_replaced(
    settings: Settings, sim: SimBackend
) -> None:
    await store_jobs(settings)
    sql(
        settings,
        "INSERT INTO user_prefs (user, ssh_keys, updated_at) VALUES ('alice', ?, 'now')",
        [json.dumps(["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGvFv0mBq3ZkBUnh3BwrQ8Ql"])],
    )
    async with running_deployer(settings, backends={"sim": sim}) as d:
        with pytest.raises(RequestInvalid, match="Your saved settings could not be read"):
            await d.request_deploy(args("web01 10.0.0.50"), "alice")
        # Forms and the settings view show none, so new ones can be saved over them.
        assert (await d.prefs("alice")).ssh_keys == ()
        key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGvFv0mBq3ZkBUnh3BwrQ8QlUjcB1uWs6KmRZVb0iCq0"
        assert (await d.save_ssh_key("alice", key)).ssh_keys == (key,)
        job = await d.request_deploy(args("web01 10.0.0.50"), "alice")
        assert job.request.ssh_keys == (key,)
        await d.drain()
    assert [r[:2] for r in quarantine_rows(settings)] == [("user_prefs", "alice")]


async def test_text_that_is_not_utf8_and_a_null_id_are_set_aside(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(tmp_path)
    good = make_job(settings, "web01 10.0.0.50", JobState.SUCCEEDED)
    odd = make_job(settings, "web02 10.0.0.51", JobState.QUEUED)
    await store_jobs(settings, good, odd)
    sql(settings, "UPDATE jobs SET name = CAST(X'FF77' AS TEXT) WHERE id = ?", [odd.id])
    row = {**job_row(make_job(settings, "web03 10.0.0.52", JobState.QUEUED)), "id": None}
    columns = ", ".join(row)
    marks = ", ".join("?" for _ in row)
    sql(settings, f"INSERT INTO jobs ({columns}) VALUES ({marks})", list(row.values()))
    async with running_deployer(settings, backends={"sim": sim}) as d:
        await d.drain()
        assert [j.id for j in await d.history(10)] == [good.id]
        assert sim.vms == {}
    keys = sorted(r[1] for r in quarantine_rows(settings))
    assert keys == sorted([odd.id, "rowid 3"])
