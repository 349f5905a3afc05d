"""Several runners on one database (a real SQLite file, and a real PostgreSQL database:
each test runs on both), one simulated hypervisor.

Each `Deployer` here is what one process would run: its own store connection, its own
runner id, its own queue. Time is an injected clock, so a claim lapses when the test
says so; a runner's `tick` is called directly instead of waiting for its loop.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from backends.sim import SimBackend
from bot.app.service import Deployer
from bot.models import Claim, Job, JobState, utcnow
from bot.ownership.claims import host_identity
from bot.ownership.recovery import INTERRUPTED
from bot.requests.validation import build_request
from store.db import Store
from store.owners import RunnerRow
from tests.support.deployer import Recorder, make_settings
from tests.support.ownership import Clock, database, gate, request, runner

__all__ = ["database"]  # a fixture, used by name
LEASE_S = 30.0
# Every request waits for an approver; ticks only when a test calls them.
QUIET: dict[str, Any] = {
    "approval": {"always": True, "approvers": ["bob"]},
    "ownership": {"tick_s": 100, "lease_s": 300},
}


def destroys(sim: SimBackend) -> list[str]:
    return [vm for op, vm in sim.task_log if op == "destroy"]


async def test_a_second_runner_leaves_the_first_ones_running_job_alone(
    tmp_path: Path, database: str
) -> None:
    settings, sim, held = (
        make_settings(tmp_path, database=database),
        SimBackend("sim", time_scale=0.001),
        Recorder(),
    )
    release = gate(held, "power_on")
    async with runner(settings, sim, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("power_on").wait()
        async with runner(settings, sim) as second:  # starts, ticks, recovers nothing
            await second.ownership.tick()
            assert not second.ownership.recovering
            assert (await second.status(job.id)).job.state is JobState.RUNNING
        release.set()
        await first.drain()
        done = (await first.status(job.id)).job
    assert done.state is JobState.SUCCEEDED and done.owner == first.runner.id
    assert not destroys(sim) and sim.vms[str(done.vm_id)].running


async def test_an_expired_lease_is_taken_over_once_and_the_old_owner_backs_off(
    tmp_path: Path,
    database: str,
) -> None:
    settings, sim, held = (
        make_settings(tmp_path, database=database),
        SimBackend("sim", time_scale=0.001),
        Recorder(),
    )
    late = Clock()  # the other runners' clock: the first one's lease has lapsed for them
    release = gate(held, "power_on")
    async with runner(settings, sim, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("power_on").wait()
        late.advance(LEASE_S + 1)
        async with runner(settings, sim, late) as b, runner(settings, sim, late) as c:
            # A lapsed lease is taken over only by a runner that has renewed without a
            # break for a whole lease itself (its owner may be alive and paused)...
            await asyncio.gather(b.ownership.tick(), c.ownership.tick())
            assert not (b.ownership.recovering or c.ownership.recovering)
            late.advance(LEASE_S)  # ...as these now have
            await asyncio.gather(b.ownership.tick(), c.ownership.tick())
            await asyncio.gather(b.drain(), c.drain())
        taken = (await first.status(job.id)).job
        assert taken.state is JobState.FAILED and taken.error == INTERRUPTED
        assert taken.owner in (b.runner.id, c.runner.id)
        # The first runner learns at its next tick that the job is not its own any more,
        # stops, and its rollback (fenced by owner) leaves the VM business to the taker.
        await first.ownership.tick()
        release.set()
        await first.drain()
    # One rollback, by the one runner that won the takeover; none by the first runner.
    assert destroys(sim) == [taken.vm_id]
    interrupted = [n for n in held.notes if n[0] == job.id]
    assert not [u for u in held.updates if u[0] == job.id and u[1] is JobState.ROLLING_BACK]
    assert not interrupted


async def test_two_runners_run_each_queued_job_exactly_once(tmp_path: Path, database: str) -> None:
    settings = make_settings(
        tmp_path, database=database, limits={"max_running": 3, "max_running_per_backend": 3}
    )
    sim = SimBackend("sim", time_scale=0.001)
    store = await Store.open(settings.database, password=settings.database_password)
    ids = []
    for n in range(8):  # queued by a process that is gone: nobody holds them
        made = build_request(request(f"q{n:02d} 10.0.0.{60 + n}"), settings, "alice")
        job = Job.for_request(made, JobState.QUEUED)
        job = job.model_copy(update={"installation": store.installation_id})
        await store.jobs.insert(job)
        ids.append(job.id)
    await store.close()
    async with runner(settings, sim) as a, runner(settings, sim) as b:
        while True:
            await asyncio.gather(a.drain(), b.drain())
            await asyncio.gather(a.ownership.tick(), b.ownership.tick())
            if not (a.queue.running_count or b.queue.running_count):
                states = [(await a.status(i)).job.state for i in ids]
                if all(s.final for s in states):
                    break
    ran_a, ran_b = set(a.queue.started_order), set(b.queue.started_order)
    assert ran_a | ran_b == set(ids) and not ran_a & ran_b
    assert all(s is JobState.SUCCEEDED for s in states)
    assert len([op for op, _ in sim.task_log if op == "clone"]) == len(ids)


async def test_a_graceful_shutdown_hands_queued_jobs_back(tmp_path: Path, database: str) -> None:
    limits = {"max_running": 1, "max_running_per_backend": 1}
    settings = make_settings(tmp_path, database=database, limits=limits)
    sim, held = SimBackend("sim", time_scale=0.001), Recorder()
    release = gate(held, "power_on")
    async with runner(settings, sim, progress=held) as first:
        jobs = [
            await first.request_deploy(request(f"h{n} 10.0.0.{70 + n}"), "alice") for n in range(3)
        ]
        await held.seen("power_on").wait()
        release.set()
    # The running one finished within the grace period; the two waiting ones are free.
    async with runner(settings, sim) as second:
        await second.drain()
        states = [(await second.status(j.id)).job for j in jobs]
    assert [j.state for j in states] == [JobState.SUCCEEDED] * 3
    assert states[0].owner == first.runner.id
    assert states[1].owner == states[2].owner == second.runner.id


async def test_a_cancel_asked_in_another_process_is_carried_out_by_the_owner(
    tmp_path: Path,
    database: str,
) -> None:
    settings, sim, held = (
        make_settings(tmp_path, database=database),
        SimBackend("sim", time_scale=0.001),
        Recorder(),
    )
    release = gate(held, "address")
    async with runner(settings, sim, progress=held) as owner:
        job = await owner.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("address").wait()
        async with runner(settings, sim) as other:
            asked = await other.cancel(job.id, "alice")
            assert asked.state is JobState.RUNNING  # asked, not done: the owner does it
        await owner.ownership.tick()
        release.set()
        await owner.drain()
        final = (await owner.status(job.id)).job
    assert final.state is JobState.CANCELLED and final.cancel_requested == "alice"
    assert destroys(sim) == [final.vm_id] and not sim.vms


async def test_a_one_shot_runner_never_takes_over(tmp_path: Path, database: str) -> None:
    settings, sim = make_settings(tmp_path, database=database), SimBackend("sim", time_scale=0.001)
    late = Clock()
    late.advance(LEASE_S + 1)
    held = Recorder()
    release = gate(held, "power_on")
    async with runner(settings, sim, progress=held) as first:
        job = await first.request_deploy(request("web01 10.0.0.50"), "alice")
        await held.seen("power_on").wait()
        async with runner(settings, sim, late, takes_over=False, runner_kind="deploy") as cli:
            await cli.ownership.tick()
            assert not cli.ownership.recovering
            assert (await cli.status(job.id)).job.state is JobState.RUNNING
        release.set()
        await first.drain()
        assert (await first.status(job.id)).job.state is JobState.SUCCEEDED


async def test_a_dead_runner_on_this_host_frees_its_jobs_without_waiting(
    tmp_path: Path, database: str
) -> None:
    """A killed process's leases need not lapse: its pid is gone, so a restart recovers
    at once (the crash harnesses depend on it)."""
    settings, sim = make_settings(tmp_path, database=database), SimBackend("sim", time_scale=0.001)
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()  # reaped: its pid names no process now
    store = await Store.open(settings.database, password=settings.database_password)
    now = utcnow()
    until = now + timedelta(hours=1)  # a lease far from lapsing
    await store.runners.register(
        RunnerRow("rdead", "shell", host_identity(), gone.pid, "1", now, until)
    )
    made = build_request(request("web01 10.0.0.50"), settings, "alice")
    job = Job.for_request(made, JobState.QUEUED).model_copy(
        update={"owner": "rdead", "lease_until": until, "installation": store.installation_id}
    )
    await store.jobs.insert(job)
    assert await store.jobs.transition(
        job.id, [JobState.QUEUED], JobState.RUNNING, held_by=Claim(runner="rdead")
    )
    await store.close()
    async with runner(settings, sim) as restarted:
        final = (await restarted.status(job.id)).job
    assert final.state is JobState.FAILED and final.error == INTERRUPTED
    assert final.owner == restarted.runner.id


async def _held_running(deployer: Deployer, text: str, owner: str, until: datetime) -> Job:
    """A job in the state a runner's task leaves it in when it ends without a final
    state: running, held by `owner` (written as the pipeline writes it, through the store)."""
    job = await deployer.request_deploy(request(text), "alice")
    assert job.state is JobState.AWAITING_APPROVAL
    store = deployer.store
    fields: dict[str, Any] = {"owner": owner, "lease_until": until}
    assert await store.jobs.transition(
        job.id, [JobState.AWAITING_APPROVAL], JobState.QUEUED, **fields
    )
    assert await store.jobs.transition(
        job.id, [JobState.QUEUED], JobState.RUNNING, held_by=Claim(runner=owner)
    )
    return job


async def test_a_renewal_extends_only_the_leases_it_names(tmp_path: Path, database: str) -> None:
    """store/owners.renew_claims: named jobs (local, pending) get the new lease, the others
    keep theirs and come back marked not local; hand_back ends a lease at once."""
    settings = make_settings(tmp_path, database=database, **QUIET)
    clock = Clock()
    then, later = clock.now + timedelta(seconds=5), clock.now + timedelta(seconds=60)
    async with runner(settings, SimBackend("sim", time_scale=0.001), clock) as deployer:
        store = deployer.store
        a, b, c = [
            await _held_running(deployer, f"r{n} 10.0.0.{50 + n}", "r-other", then)
            for n in range(3)
        ]
        held = await store.runners.renew_claims(
            "r-other", clock.now, later, local=[a.id], pending=[b.id]
        )
        assert {(h.job_id, h.local) for h in held} == {(a.id, True), (b.id, False), (c.id, False)}
        leases = {j: (await store.jobs.get(j)).lease_until for j in (a.id, b.id, c.id)}  # type: ignore[union-attr]
        assert leases == {a.id: later, b.id: later, c.id: then}
        assert await store.runners.hand_back("r-other", [c.id]) == 1
        gone = await store.jobs.get(c.id)
        assert gone is not None and gone.lease_until is None and gone.owner == "r-other"
        assert [j.id for j in await store.runners.abandoned(clock.now)] == [
            c.id
        ]  # free to take over
        assert await store.runners.hand_back("r-else", [a.id]) == 0  # only the holder hands back


async def test_a_held_job_that_nothing_runs_is_finished_by_its_runner(
    tmp_path: Path, database: str
) -> None:
    """Its task ended without a final state (a write refused): the runner stops renewing
    it, hands it back at the next tick and rolls it back itself, saying why."""
    settings = make_settings(tmp_path, database=database, **QUIET)
    clock = Clock()
    async with runner(settings, SimBackend("sim", time_scale=0.001), clock) as deployer:
        me = deployer.runner.id
        job = await _held_running(deployer, "web01 10.0.0.50", me, deployer.ownership.claim_until())
        await deployer.ownership.tick()  # seen held with no task: perhaps one about to start
        assert (await deployer.status(job.id)).job.state is JobState.RUNNING
        await deployer.ownership.tick()  # still so: handed back and rolled back here
        await deployer.drain()
        done = (await deployer.status(job.id)).job
    assert done.state is JobState.FAILED, done
    assert done.error == "interrupted: the bot's run of it ended before the job did"
    assert done.owner == me
