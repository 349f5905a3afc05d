"""Destroy and list through the Deployer: who may, approvals, refusals, takeover, paging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.models import IpamState, Job, JobState, utcnow
from bot.models.errors import JobNotFound, NotAllowed, RequestInvalid, TransitionRefused
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from handlers.commands import answer
from handlers.messages.core import cancelling
from tests.support.deployer import Recorder, make_settings


def args(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


async def deployed(deployer: Deployer, text: str, user: str = "alice") -> Job:
    job = await deployer.request_deploy(args(text), user)
    await deployer.drain()
    job = (await deployer.status(job.id)).job
    assert job.state is JobState.SUCCEEDED, job.error
    return job


@pytest.fixture
async def strict(tmp_path: Path, sim: SimBackend, recorder: Recorder) -> AsyncIterator[Deployer]:
    """Destroys need approval from bob or carol; dave may destroy anyone's VM."""
    settings = make_settings(
        tmp_path,
        approval={
            "approvers": ["bob", "carol"],
            "destroy": "always",
            "destroyers": ["dave"],
            "expire_after_s": 60,
        },
    )
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:
        yield d


async def test_the_requester_destroys_and_the_name_and_address_are_free(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")
    assert job.vm_id in sim.vms and sim.vms[job.vm_id].running
    asked = await deployer.request_destroy("web01", "alice")
    assert asked.state is JobState.DESTROYING and asked.destroy_by == "alice"
    await deployer.drain()
    gone = (await deployer.status(job.id)).job
    assert gone.state is JobState.DESTROYED
    assert gone.destroyed_at is not None and gone.destroy_approver is None
    assert job.vm_id not in sim.vms
    assert gone.ipam_state in (None, IpamState.RELEASED)
    assert [s for i, s, _ in recorder.steps if i == job.id][-4:] == [
        "stop",
        "stop",
        "destroy",
        "destroy",
    ]
    assert recorder.finished[job.id][0].state is JobState.DESTROYED
    audit = [(e.actor, e.outcome) for e in await deployer.store.audit.events()]
    assert ("alice", "destroyed") in audit and ("alice", "requested") in audit
    again = await deployed(deployer, "web01 10.0.0.50")  # name and address free again
    assert again.id != job.id


async def test_a_job_id_prefix_names_the_vm_too(deployer: Deployer, sim: SimBackend) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")
    await deployer.request_destroy(job.short_id, "alice")
    await deployer.drain()
    assert (await deployer.status(job.id)).job.state is JobState.DESTROYED


async def test_strangers_unknown_names_and_unfinished_jobs_are_refused(
    deployer: Deployer, sim: SimBackend
) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")
    with pytest.raises(NotAllowed, match=r"Only alice .* may destroy web01"):
        await deployer.request_destroy("web01", "mallory")
    with pytest.raises(JobNotFound, match="holds no VM called web99: check the name"):
        await deployer.request_destroy("web99", "alice")
    assert (await deployer.status(job.id)).job.state is JobState.SUCCEEDED
    assert sim.vms[job.vm_id or ""].running
    refused = [e for e in await deployer.store.audit.events() if e.outcome == "refused"]
    assert [e.actor for e in refused] == ["alice", "mallory"]
    # A job that is not ready yet: said, with what to do.
    waiting = await deployer.request_deploy(args("web02 10.0.0.51"), "alice")
    assert waiting.state is JobState.QUEUED
    with pytest.raises(TransitionRefused, match=r"still (queued|running): wait until it is ready"):
        await deployer.request_destroy("web02", "alice")
    await deployer.drain()
    lines = await answer(deployer, "mallory", "destroy web01")
    assert lines[0].startswith("Only alice (who deployed it), an approver")


async def test_approvers_and_destroyers_may_destroy_others_vms(
    tmp_path: Path, sim: SimBackend, recorder: Recorder
) -> None:
    settings = make_settings(
        tmp_path, approval={"approvers": ["bob"], "destroyer_groups": ["S0TEAM"]}
    )
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:

        async def members(group: str) -> frozenset[str]:
            return frozenset({"erin"}) if group == "S0TEAM" else frozenset()

        d.groups.members = members
        first = await deployed(d, "web01 10.0.0.50")
        second = await deployed(d, "web02 10.0.0.51")
        await d.request_destroy("web01", "bob")  # an approver
        await d.request_destroy("web02", "erin")  # a member of a destroyer group
        await d.drain()
        for job in (first, second):
            assert (await d.status(job.id)).job.state is JobState.DESTROYED


async def test_destroy_with_approval_another_approver_decides(
    strict: Deployer, sim: SimBackend
) -> None:
    job = await deployed(strict, "web01 10.0.0.50", user="bob")
    asked = await strict.request_destroy("web01", "bob")
    assert asked.state is JobState.DESTROY_REQUESTED
    assert sim.vms[job.vm_id or ""].running  # nothing touched while it waits
    with pytest.raises(NotAllowed, match="the destroy you asked for"):
        await strict.approve(job.id, "bob")
    with pytest.raises(NotAllowed, match="may not approve destroys"):
        await strict.approve(job.id, "dave")
    results = await asyncio.gather(
        strict.approve(job.id, "carol"),
        strict.reject(job.id, "carol", "no"),
        return_exceptions=True,
    )
    assert sum(isinstance(r, Job) for r in results) == 1  # one compare-and-set wins
    await strict.drain()
    done = (await strict.status(job.id)).job
    if isinstance(results[0], Job):
        assert done.state is JobState.DESTROYED and done.destroy_approver == "carol"
        assert job.vm_id not in sim.vms
    else:
        assert done.state is JobState.SUCCEEDED and job.vm_id in sim.vms


async def test_a_rejected_withdrawn_or_expired_destroy_keeps_the_vm(
    strict: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    job = await deployed(strict, "web01 10.0.0.50")
    await strict.request_destroy("web01", "alice")
    kept = await strict.reject(job.id, "bob", "still in use")
    assert kept.state is JobState.SUCCEEDED and job.vm_id in sim.vms
    assert recorder.updates[-1][2] == "destroy rejected by bob: still in use"
    await strict.request_destroy("web01", "dave")
    withdrawn = await strict.cancel(job.id, "alice")
    assert withdrawn.state is JobState.SUCCEEDED
    assert cancelling(withdrawn).endswith("the destroy was withdrawn; web01 stays.")
    await strict.request_destroy("web01", "alice")
    expired = await strict.expire_approvals(utcnow() + timedelta(seconds=61))
    assert [j.id for j in expired] == [job.id]
    assert (await strict.status(job.id)).job.state is JobState.SUCCEEDED
    assert sim.vms[job.vm_id or ""].running


async def test_a_vm_whose_tag_was_removed_by_hand_is_refused_and_untouched(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")
    assert job.vm_id is not None
    sim.vms[job.vm_id].tags.clear()  # someone edited the VM on the hypervisor
    await deployer.request_destroy("web01", "alice")
    await deployer.drain()
    kept = (await deployer.status(job.id)).job
    assert kept.state is JobState.SUCCEEDED
    assert job.vm_id in sim.vms and sim.vms[job.vm_id].running
    note = recorder.updates[-1][2]
    assert "does not carry tag" in note and "nothing was touched" in note
    assert "Put the tag back" in note and "try again" not in note
    events = (await deployer.status(job.id)).events
    assert events[-1].phase == "failed" and "does not carry tag" in events[-1].detail


async def test_a_destroy_whose_runner_died_is_taken_over_and_finished(
    deployer: Deployer, sim: SimBackend
) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")
    past = utcnow() - timedelta(seconds=60)
    moved = await deployer.store.jobs.transition(
        job.id,
        [JobState.SUCCEEDED],
        JobState.DESTROYING,
        destroy_by="alice",
        destroy_asked_at=past,
        owner="rdeadrunner01",
        lease_until=past,
    )
    assert moved
    await deployer.ownership.tick()  # the lapsed lease: taken over and recovered
    await deployer.ownership.settle()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.DESTROYED and done.owner == deployer.runner.id
    assert job.vm_id not in sim.vms


async def test_destroy_cannot_be_approved_from_the_cli(strict: Deployer) -> None:
    await deployed(strict, "web01 10.0.0.50")
    with pytest.raises(NotAllowed, match="Destroys need approval here"):
        await strict.request_destroy("web01", "alice", can_wait_for_approval=False)


async def test_two_vms_of_one_name_ask_which(tmp_path: Path, recorder: Recorder) -> None:
    settings = make_settings(
        tmp_path,
        backends=[
            {"kind": "sim", "name": "sim", "time_scale": 0.001},
            {"kind": "sim", "name": "lab", "time_scale": 0.001},
        ],
    )
    async with running_deployer(settings, recorder, grace_s=5) as d:
        await deployed(d, "web01 10.0.0.50 on=sim")
        await deployed(d, "web01 10.0.0.51 on=lab")
        with pytest.raises(RequestInvalid, match=r"names several VMs .* say which with its job id"):
            await d.request_destroy("web01", "alice")


async def test_list_pages_mine_all_and_someones(deployer: Deployer) -> None:
    for number in range(12):
        job = await deployer.request_deploy(args(f"web{number:02d} 10.0.0.{60 + number}"), "alice")
    await deployer.request_deploy(args("db01 10.0.0.90"), "bob")
    await deployer.drain()
    first = await deployer.list_vms("alice", 1, 10)
    assert (first.total, first.pages, len(first.jobs)) == (12, 2, 10)
    assert first.jobs[0].name == "web11"  # newest first
    second = await deployer.list_vms("alice", 2, 10)
    assert [j.name for j in second.jobs] == ["web01", "web00"]
    everyone = await deployer.list_vms(None, 1, 10)
    assert everyone.total == 13 and everyone.jobs[0].name == "db01"
    lines = await answer(deployer, "alice", "list @bob")
    assert lines[0] == "VMs of bob: 1 (page 1 of 1)" and lines[2].startswith("db01 ")
    assert "UTC" in lines[2] and "ready" in lines[2]  # the lease end (14 days by default)
    mine = await answer(deployer, "alice", "list")
    assert mine[0] == "Your VMs: 12 (page 1 of 2)" and mine[-1] == "More: add page=2."
    assert job.state is JobState.QUEUED


async def test_two_destroys_at_once_destroy_once(deployer: Deployer, sim: SimBackend) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")
    results = await asyncio.gather(
        deployer.request_destroy("web01", "alice"),
        deployer.request_destroy(job.id, "bob"),
        return_exceptions=True,
    )
    assert sum(isinstance(r, Job) for r in results) == 1
    refused = [r for r in results if not isinstance(r, Job)]
    assert isinstance(refused[0], TransitionRefused)
    assert "being destroyed already" in refused[0].message
    await deployer.drain()
    assert (await deployer.status(job.id)).job.state is JobState.DESTROYED


async def test_a_runner_that_lost_its_destroy_stops_before_the_next_move(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    job = await deployed(deployer, "web01 10.0.0.50")

    async def taken_over(current: Job, step: str) -> None:
        if current.id == job.id and step == "stop":  # another runner took the job over
            await deployer.store.jobs.update(job.id, owner="rsomeoneelse1")

    recorder.on_step = taken_over
    await deployer.request_destroy("web01", "alice")
    await deployer.drain()
    left = (await deployer.status(job.id)).job
    assert left.state is JobState.DESTROYING and left.owner == "rsomeoneelse1"
    assert job.vm_id in sim.vms  # no destroy from here: the new owner carries on
