"""Fencing (bot/ownership/claims.py): a runner that cannot prove it holds a job touches
nothing of it, and a job is never taken from a runner that may be alive and paused.

Each `Deployer` is what one process would run, on a real SQLite file or PostgreSQL
database (both, like tests/test_ownership.py). Time is an injected clock: a lease runs
out when the test says so, and renewals happen when the test calls `tick`. The last
test stops a real PostgreSQL server under a running deploy.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.config.settings import Settings
from bot.models import Claim, Job, JobState
from bot.ownership.claims import WORKING, Lost, Proof
from bot.requests.validation import build_request
from store.db import Store
from store.owners import RunnerRow
from tests.support.deployer import Recorder, make_settings
from tests.support.ownership import Clock, database, gate, request, runner
from tests.support.postgres import PASSWORD, PASSWORD_ENV, start_again, stop_fast

__all__ = ["database"]  # a fixture, used by name
LEASE_S = 300.0
# Renewals only when a test ticks (the loop's tick is far off).
OWNERSHIP: dict[str, Any] = {"ownership": {"tick_s": 100, "lease_s": LEASE_S}}


def fenced_settings(tmp_path: Path, database: str, **more: Any) -> Settings:
    return make_settings(tmp_path, database=database, **OWNERSHIP, **more)


async def queued_job(settings: Settings, store: Store, name: str, address: str) -> Job:
    made = build_request(request(f"{name} {address}"), settings, "alice")
    job = Job.for_request(made, JobState.QUEUED)
    job = job.model_copy(update={"installation": store.installation_id})
    await store.jobs.insert(job)
    return job


async def until_paused(deployer: Any, job_id: str) -> None:
    ownership = deployer.ownership
    while job_id not in ownership.paused:
        ownership.on_pause.clear()
        await asyncio.wait_for(ownership.on_pause.wait(), timeout=30)


def ops(sim: SimBackend) -> list[str]:
    return [op for op, _vm in sim.task_log]


async def test_every_claim_has_its_epoch_and_an_old_claim_changes_nothing(
    tmp_path: Path, database: str
) -> None:
    settings = fenced_settings(tmp_path, database)
    store = await Store.open(settings.database, password=settings.database_password)
    try:
        job = await queued_job(settings, store, "e01", "10.0.0.50")
        clock = Clock()
        until = clock.now + timedelta(seconds=LEASE_S)
        first = await store.runners.claim(job.id, "r-one", clock.now, until)
        assert first == 1
        assert await store.jobs.transition(
            job.id, [JobState.QUEUED], JobState.RUNNING, held_by=Claim(runner="r-one", epoch=1)
        )
        later = clock.now + timedelta(seconds=LEASE_S + 1)  # r-one's lease has run out
        again = await store.runners.claim(
            job.id, "r-one", later, later + timedelta(seconds=9), WORKING
        )
        assert again == 2  # the same runner, claiming again: a new epoch
        old, new = Claim(runner="r-one", epoch=1), Claim(runner="r-one", epoch=2)
        assert not await store.jobs.update(job.id, held_by=old, vm_id="101")
        expected = [JobState.RUNNING]
        assert not await store.jobs.transition(job.id, expected, JobState.ROLLING_BACK, held_by=old)
        assert await store.jobs.update(job.id, held_by=new, vm_id="102")
        # A write that sets the owner is a claim too: the epoch moves on with it.
        assert await store.jobs.update(job.id, owner="r-two")
        stored = await store.jobs.get(job.id)
        assert stored is not None and (stored.vm_id, stored.claim_epoch) == ("102", 3)
    finally:
        await store.close()


async def test_a_job_pauses_before_its_next_step_until_the_lease_is_renewed(
    tmp_path: Path, database: str
) -> None:
    settings, sim, held, clock = (
        fenced_settings(tmp_path, database),
        SimBackend("sim", time_scale=0.001),
        Recorder(),
        Clock(),
    )
    release = gate(held, "identity")
    async with runner(settings, sim, clock, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("identity").wait()
        clock.advance(LEASE_S + 1)  # no renewal since: the lease cannot be proven
        release.set()
        await until_paused(first, job.id)
        # Paused after the identity, before the resize: no disk, no power while unproven.
        assert "power_on" not in ops(sim) and "resize" not in ops(sim)
        assert (await first.status(job.id)).job.state is JobState.RUNNING
        await first.ownership.tick()  # renewed: it is still this runner's
        await first.drain()
        done = (await first.status(job.id)).job
        events = await first.store.jobs.events(job.id)
    assert done.state is JobState.SUCCEEDED and done.owner == first.runner.id
    notes = [e.detail for e in events if e.phase == "note"]
    assert any(n.startswith("paused") and "before resize" in n for n in notes), notes


async def test_a_paused_job_taken_over_meanwhile_stops_without_touching_its_vm(
    tmp_path: Path, database: str
) -> None:
    settings, sim, held = (
        fenced_settings(tmp_path, database),
        SimBackend("sim", time_scale=0.001),
        Recorder(),
    )
    clock, late = Clock(), Clock()
    release = gate(held, "identity")
    async with runner(settings, sim, clock, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("identity").wait()
        clock.advance(LEASE_S + 1)
        late.advance(LEASE_S + 1)
        release.set()
        await until_paused(first, job.id)
        before = len(sim.task_log)
        async with runner(settings, sim, late) as taker:
            await taker.ownership.tick()  # it has not watched a whole lease: leaves it
            assert (await taker.status(job.id)).job.owner == first.runner.id
            late.advance(LEASE_S)
            await taker.ownership.tick()  # now it has: takes over and rolls back
            await taker.ownership.settle()
            taken = (await taker.status(job.id)).job
            assert taken.state is JobState.FAILED and taken.owner == taker.runner.id
            taker_ops = sim.task_log[before:]
            await first.ownership.tick()  # the first learns the job is not its own
            await first.drain()
    # The first runner made no call on the VM after its pause; the taker did the rollback.
    assert sim.task_log[before:] == taker_ops and "destroy" in [op for op, _ in taker_ops]
    assert not sim.vms
    rolling = [u for u in held.updates if u[0] == job.id and u[1] is JobState.ROLLING_BACK]
    assert not rolling  # the first runner never began a rollback of its own


async def test_a_lapsed_lease_of_a_runner_that_stopped_is_taken_at_once(
    tmp_path: Path, database: str
) -> None:
    """Only an owner that may be alive (its row does not say it stopped) is waited for."""
    settings, sim = fenced_settings(tmp_path, database), SimBackend("sim", time_scale=0.001)
    clock = Clock()
    store = await Store.open(settings.database, password=settings.database_password)
    try:
        lapsed = clock.now - timedelta(seconds=1)
        jobs: dict[str, str] = {}
        for name, (runner_id, stopped) in {
            "s01": ("r-stopped", True),
            "a01": ("r-alive", False),
        }.items():
            row = RunnerRow(runner_id, "serve", "elsewhere", 1, "1", lapsed, lapsed)
            await store.runners.register(row)
            if stopped:
                await store.runners.release(runner_id, lapsed)
            job = await queued_job(settings, store, name, f"10.0.0.{50 + len(jobs)}")
            assert await store.runners.claim(job.id, runner_id, lapsed, lapsed) == 1
            assert await store.jobs.transition(
                job.id, [JobState.QUEUED], JobState.RUNNING, held_by=Claim(runner=runner_id)
            )
            jobs[name] = job.id
    finally:
        await store.close()
    async with runner(settings, sim, clock) as taker:
        await taker.ownership.settle()
        stopped_job = (await taker.status(jobs["s01"])).job
        alive_job = (await taker.status(jobs["a01"])).job
        assert stopped_job.state is JobState.FAILED and stopped_job.owner == taker.runner.id
        assert alive_job.state is JobState.RUNNING and alive_job.owner == "r-alive"
        clock.advance(LEASE_S)
        await taker.ownership.tick()
        await taker.ownership.settle()
        assert (await taker.status(jobs["a01"])).job.state is JobState.FAILED


async def test_hold_answers_at_once_while_proven_and_lost_for_an_old_epoch(
    tmp_path: Path, database: str
) -> None:
    settings, sim, clock = (
        fenced_settings(tmp_path, database),
        SimBackend("sim", time_scale=0.001),
        Clock(),
    )
    async with runner(settings, sim, clock) as first:
        store, me = first.store, first.runner.id
        job = await queued_job(settings, store, "h01", "10.0.0.60")
        epoch = await store.runners.claim(job.id, me, clock.now, first.ownership.claim_until())
        assert epoch is not None
        assert await first.ownership.hold(job.id, epoch) == 0.0  # proven: no wait
        clock.advance(LEASE_S + 1)
        waiting = asyncio.create_task(first.ownership.hold(job.id, epoch))
        await until_paused(first, job.id)
        again = await store.runners.claim(job.id, me, clock.now, first.ownership.claim_until())
        assert again == epoch + 1  # claimed again (a recovery, say): the old claim is over
        await first.ownership.tick()
        with pytest.raises(Lost):
            await waiting


async def test_jobs_claimed_from_the_queue_are_on_the_renewal_list_at_once(
    tmp_path: Path, database: str
) -> None:
    """Claiming queued work renews again, so the jobs claimed are on the renewal's list
    (held, proven from memory): before, every step of each of them asked the store
    until the next tick's renewal listed them."""
    settings, sim, clock = (
        fenced_settings(tmp_path, database),
        SimBackend("sim", time_scale=0.001),
        Clock(),
    )
    async with runner(settings, sim, clock) as first:
        job = await queued_job(settings, first.store, "q01", "10.0.0.62")
        assert await first.ownership.claim_queued() == 1
        assert first.ownership.held.get(job.id) == 1  # its first claim's epoch
        assert first.ownership.proven(job.id, 1) is Proof.HELD


async def test_a_write_the_database_refused_waits_and_lands_when_it_is_back(
    tmp_path: Path, stoppable_pg: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL stopped for longer than `[store] write_retry_s` while a deploy runs:
    the deploy pauses (the write of its step is made again once a renewal proves the
    job is still this runner's) and succeeds; before, it ended on `Unavailable`."""
    url, workdir = stoppable_pg
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    settings = make_settings(tmp_path, database=url, store={"write_retry_s": 0.2}, **OWNERSHIP)
    sim, held = SimBackend("sim", time_scale=0.001), Recorder()
    release = gate(held, "identity")
    async with running_deployer(settings, held, backends={"sim": sim}, grace_s=5) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("identity").wait()
        stop_fast(workdir)
        try:
            with pytest.raises(Exception):  # noqa: B017 (the driver's: connection refused)
                await first.ownership.tick()
            release.set()  # its end cannot be written: it pauses
            await until_paused(first, job.id)
        finally:
            start_again(workdir)
        while job.id in first.ownership.paused:
            with contextlib.suppress(Exception):  # until the pool has connected again
                await first.ownership.tick()
            await asyncio.sleep(0.1)  # pacing the renewals, not synchronisation
        await first.drain()
        done = (await first.status(job.id)).job
    assert done.state is JobState.SUCCEEDED, (done.state, done.error)


async def test_a_job_taken_over_while_its_runner_renews_on_is_lost_at_once(
    tmp_path: Path, database: str
) -> None:
    """The last renewal did not list the job (claimed since, or taken over since): the
    store says which, so a lost job is not carried on just because the lease holds."""
    settings, sim, clock = (
        fenced_settings(tmp_path, database),
        SimBackend("sim", time_scale=0.001),
        Clock(),
    )
    async with runner(settings, sim, clock) as first:
        store, me = first.store, first.runner.id
        job = await queued_job(settings, store, "t01", "10.0.0.61")
        epoch = await store.runners.claim(job.id, me, clock.now, first.ownership.claim_until())
        assert epoch is not None and job.id not in first.ownership.held  # claimed since
        assert await first.ownership.hold(job.id, epoch) == 0.0  # the store says: ours
        later = clock.now + timedelta(seconds=LEASE_S + 1)  # its lease, to another runner
        assert await store.runners.claim(job.id, "r-other", later, later + timedelta(seconds=9))
        with pytest.raises(Lost):
            await first.ownership.hold(job.id, epoch)  # no pause: the lease still holds
        assert job.id not in first.ownership.paused


async def test_a_step_that_ends_after_its_job_was_taken_over_writes_nothing(
    tmp_path: Path, database: str
) -> None:
    """The old owner's step ends (here: fails on the VM the taker removed); its event
    would land in the taker's history and thread: it is fenced by the claim too, and
    the old owner stops there instead of rolling back."""
    settings, sim, held = (
        fenced_settings(tmp_path, database),
        SimBackend("sim", time_scale=0.001),
        Recorder(),
    )
    late = Clock()
    release = gate(held, "identity")
    async with runner(settings, sim, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("identity").wait()
        late.advance(LEASE_S + 1)
        async with runner(settings, sim, late) as taker:
            late.advance(LEASE_S)  # it has watched a whole lease
            await taker.ownership.tick()
            await taker.ownership.settle()
            taken = (await taker.status(job.id)).job
            assert taken.state is JobState.FAILED and not sim.vms
            before = [(e.step, e.phase) for e in await taker.store.jobs.events(job.id)]
            release.set()
            await first.drain()
            after = [(e.step, e.phase) for e in await taker.store.jobs.events(job.id)]
    assert after == before  # no "identity failed" from the old owner
    rolling = [u for u in held.updates if u[0] == job.id and u[1] is JobState.ROLLING_BACK]
    assert not rolling


async def test_a_destroy_right_after_the_deploy_is_not_taken_for_lost(
    tmp_path: Path, database: str
) -> None:
    """The last renewal listed the job under the deploy's claim; the destroy is a new
    claim (a later epoch) made since: not a sign that another runner holds the job (a
    template build's smoke VM, destroyed right after its deploy, was left behind)."""
    settings = fenced_settings(tmp_path, database)
    sim, held = SimBackend("sim", time_scale=0.001), Recorder()
    release = gate(held, "address")
    async with runner(settings, sim, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("address").wait()
        await first.ownership.tick()  # lists the job under the deploy's claim
        assert job.id in first.ownership.held
        release.set()
        await first.drain()
        await first.request_destroy("web01", "alice")
        await first.destroyer.settle()
        done = (await first.status(job.id)).job
    assert done.state is JobState.DESTROYED, (done.state, done.error)
    assert not sim.vms
