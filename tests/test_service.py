"""Approvals, cancels, conflicts and permissions through the Deployer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from backends.base import CloneSpec, PermanentError, Storage, Template
from backends.sim import SimBackend
from backends.tags import job_tag
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.models import ApprovalState, Job, JobState, utcnow
from bot.models.errors import Conflict, JobNotFound, NotAllowed, RequestInvalid, TransitionRefused
from bot.ownership.recovery import INTERRUPTED
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from handlers.messages.reports import templates
from store.db import Store
from tests.support.deployer import SIM_SCALE, TEST_KEY, Recorder, make_settings


def args(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


@pytest.fixture
async def strict(tmp_path: Path, sim: SimBackend, recorder: Recorder) -> AsyncIterator[Deployer]:
    """Every deploy needs approval from bob or carol; only alice, bob, carol may deploy."""
    settings = make_settings(
        tmp_path,
        approval={
            "approvers": ["bob", "carol"],
            "deployers": ["alice", "bob", "carol"],
            "always": True,
            "expire_after_s": 60,
        },
    )
    async with running_deployer(settings, recorder, backends={"sim": sim}, grace_s=5) as d:
        yield d


async def test_approval_then_deploy(strict: Deployer, recorder: Recorder) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    assert job.state is JobState.AWAITING_APPROVAL
    assert job.approval_reason == "every deploy needs approval"
    await strict.drain()
    assert (await strict.status(job.id)).job.state is JobState.AWAITING_APPROVAL
    approved = await strict.approve(job.id, "bob")
    assert approved.state is JobState.QUEUED
    await strict.drain()
    info = await strict.status(job.id)
    assert info.job.state is JobState.SUCCEEDED
    assert info.approval is not None
    assert (info.approval.state, info.approval.decided_by) == (ApprovalState.APPROVED, "bob")
    assert info.approval.decided_at is not None


async def test_requester_and_strangers_cannot_approve(strict: Deployer) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "bob")
    with pytest.raises(NotAllowed, match="your own request"):
        await strict.approve(job.id, "bob")
    with pytest.raises(NotAllowed, match="may not approve deploys; the approvers are bob, carol"):
        await strict.approve(job.id, "mallory")
    assert (await strict.status(job.id)).job.state is JobState.AWAITING_APPROVAL


async def test_two_approvers_at_once_decide_once(strict: Deployer) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    results = await asyncio.gather(
        strict.approve(job.id, "bob"),
        strict.reject(job.id, "carol", "not today"),
        strict.approve(job.id, "carol"),
        return_exceptions=True,
    )
    wins = [r for r in results if not isinstance(r, BaseException)]
    losses = [r for r in results if isinstance(r, TransitionRefused)]
    assert len(wins) == 1 and len(losses) == 2
    assert "not awaiting approval" in str(losses[0])
    await strict.drain()


async def test_reject_records_the_reason(strict: Deployer, recorder: Recorder) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    rejected = await strict.reject(job.id, "carol", "use the staging subnet")
    assert rejected.state is JobState.REJECTED
    info = await strict.status(job.id)
    assert info.approval is not None and info.approval.note == "use the staging subnet"
    assert (job.id, JobState.REJECTED, "use the staging subnet") in recorder.updates
    # The name and address are free again.
    again = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    assert again.state is JobState.AWAITING_APPROVAL


async def test_pending_approvals_expire(strict: Deployer) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    assert await strict.expire_approvals(utcnow()) == []
    expired = await strict.expire_approvals(utcnow() + timedelta(seconds=61))
    assert [j.id for j in expired] == [job.id]
    assert expired[0].state is JobState.EXPIRED
    with pytest.raises(TransitionRefused):
        await strict.approve(job.id, "bob")


async def test_only_listed_people_may_deploy(strict: Deployer) -> None:
    with pytest.raises(NotAllowed, match="mallory is not on the list"):
        await strict.request_deploy(args("web01 10.0.0.50"), "mallory")
    assert await strict.history() == []


async def test_rules_decide_which_requests_wait(tmp_path: Path, sim: SimBackend) -> None:
    settings = make_settings(
        tmp_path,
        approval={"approvers": ["bob"], "cores_over": 8, "templates": ["rocky-9"]},
    )
    async with running_deployer(settings, backends={"sim": sim}) as d:
        small = await d.request_deploy(args("small 10.0.0.71"), "alice")
        big = await d.request_deploy(args("big 10.0.0.70 cpu=12"), "alice")
        rocky = await d.request_deploy(args("el 10.0.0.72 template=rocky-9"), "alice")
        assert small.state is JobState.QUEUED
        assert big.approval_reason == "cores over 8 needs approval"
        assert rocky.approval_reason == "deploys of rocky-9 need approval"
        await d.drain()  # the waiting job does not block the queue
        assert (await d.status(small.id)).job.state is JobState.SUCCEEDED
        with pytest.raises(NotAllowed, match="needs approval"):
            await d.request_deploy(
                args("big2 10.0.0.73 cpu=12"), "alice", can_wait_for_approval=False
            )


async def test_same_name_in_flight_is_a_conflict(strict: Deployer) -> None:
    first = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    with pytest.raises(Conflict, match=f"already being deployed by job {first.id}"):
        await strict.request_deploy(args("web01 10.0.0.51"), "alice")
    with pytest.raises(Conflict, match=f"10.0.0.50 is already taken by job {first.id}"):
        await strict.request_deploy(args("web02 10.0.0.50"), "alice")


async def test_twenty_simultaneous_requests_for_one_name_make_one_job(strict: Deployer) -> None:
    results = await asyncio.gather(
        *(strict.request_deploy(args(f"web01 10.0.0.{100 + i}"), "alice") for i in range(20)),
        return_exceptions=True,
    )
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, Conflict) for r in results if isinstance(r, BaseException))
    assert len(await strict.history(50)) == 1


async def test_unknown_template_or_node_is_refused_before_recording(strict: Deployer) -> None:
    with pytest.raises(RequestInvalid, match="'centos-5' is not a template on sim"):
        await strict.request_deploy(args("web01 10.0.0.50 template=centos-5"), "alice")
    with pytest.raises(RequestInvalid, match="'node9' is neither a backend nor a node"):
        await strict.request_deploy(args("web01 10.0.0.50 on=node9"), "alice")
    assert await strict.history() == []


async def test_request_time_errors_say_what_kind_they_are(tmp_path: Path, sim: SimBackend) -> None:
    settings = make_settings(tmp_path)
    async with running_deployer(settings, backends={"sim": sim}) as deployer:
        sim.inject("templates", "error")  # permanent: waiting would not help
        with pytest.raises(RequestInvalid) as permanent:
            await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
        assert "simulated error" in permanent.value.message
        assert "try again" not in permanent.value.message
        sim.inject("templates", "flaky")
        with pytest.raises(RequestInvalid, match=r"did not answer .*; try again in a minute"):
            await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
        assert await deployer.history() == []
    bare = SimBackend("sim", templates=())
    async with running_deployer(make_settings(tmp_path / "b"), backends={"sim": bare}) as empty:
        with pytest.raises(RequestInvalid) as nothing:
            await empty.request_deploy(args("web01 10.0.0.50"), "alice")
        assert "it has no templates at all: ask an operator to add one" in nothing.value.message
        assert "choose one of  " not in nothing.value.message


async def test_a_deploy_nobody_could_log_in_to_is_refused(tmp_path: Path, sim: SimBackend) -> None:
    settings = make_settings(tmp_path, defaults={"ssh_keys": []})
    async with running_deployer(settings, backends={"sim": sim}) as deployer:
        with pytest.raises(RequestInvalid) as refused:
            await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
        assert "No SSH key to log in to web01" in refused.value.message
        assert "/deploy key" in refused.value.message and "try again" not in refused.value.message
        assert await deployer.history() == [] and sim.vms == {}
        await deployer.save_ssh_key("alice", TEST_KEY)
        job = await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
        assert job.request.ssh_keys == (TEST_KEY,)


class RefusingStorages(SimBackend):
    """The simulator, except that its storage list is refused for good (a permission)."""

    async def storages(self, placement: str | None = None) -> list[Storage]:
        raise PermanentError("storage list: permission check failed (Datastore.Audit)")


class RefusingTemplates(SimBackend):
    """The simulator, except that it refuses our credentials for good."""

    async def templates(self) -> list[Template]:
        raise PermanentError("the password of u was refused by sim: check $SIM_PASSWORD")


async def test_templates_say_try_again_only_when_waiting_may_help(
    tmp_path: Path, sim: SimBackend
) -> None:
    refusing = RefusingTemplates("refusing", time_scale=SIM_SCALE)
    settings = make_settings(tmp_path)
    async with running_deployer(settings, backends={"sim": sim, "refusing": refusing}) as deployer:
        sim.inject("templates", "flaky")
        text = "\n".join(templates(await deployer.templates()))
    (flaky,) = [line for line in text.splitlines() if line.startswith("sim: ")]
    (refused,) = [line for line in text.splitlines() if line.startswith("refusing: ")]
    assert flaky.endswith("; try again shortly.")
    assert "check $SIM_PASSWORD" in refused and "try again" not in refused


async def test_a_refused_listing_is_not_called_unanswered(tmp_path: Path) -> None:
    sim = RefusingStorages("sim", time_scale=SIM_SCALE)
    async with running_deployer(make_settings(tmp_path), backends={"sim": sim}) as deployer:
        with pytest.raises(RequestInvalid) as refused:
            await deployer.request_deploy(args("web01 10.0.0.50 storage=local-lvm"), "alice")
    assert "sim: storage list: permission check failed" in refused.value.message
    assert "did not answer" not in refused.value.message
    assert "try again" not in refused.value.message


async def test_cancel_permissions_and_states(strict: Deployer) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    with pytest.raises(NotAllowed, match="Only alice or an approver"):
        await strict.cancel(job.id, "dave")
    cancelled = await strict.cancel(job.id, "alice")
    assert cancelled.state is JobState.CANCELLED
    with pytest.raises(TransitionRefused, match="nothing to cancel"):
        await strict.cancel(job.id, "alice")
    with pytest.raises(JobNotFound, match="There is no job jzzzzzz"):
        await strict.status("jzzzzzz")


async def test_cancel_of_a_queued_job_keeps_it_from_starting(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(tmp_path, limits={"max_running": 1, "max_running_per_backend": 1})
    async with running_deployer(settings, backends={"sim": sim}) as d:
        first = await d.request_deploy(args("one 10.0.0.81"), "alice")
        second = await d.request_deploy(args("two 10.0.0.82"), "alice")
        assert d.queue.is_waiting(second.id)
        cancelled = await d.cancel(second.id, "alice")
        assert cancelled.state is JobState.CANCELLED
        await d.drain()
        assert (await d.status(first.id)).job.state is JobState.SUCCEEDED
        assert (await d.status(second.id)).job.state is JobState.CANCELLED
        assert [vm.name for vm in sim.vms.values()] == ["one"]


async def test_a_restart_requeues_queued_jobs_and_rolls_back_interrupted_ones(
    tmp_path: Path, sim: SimBackend, recorder: Recorder
) -> None:
    """What a killed process leaves: a job marked running with a VM, and a queued job."""
    settings = make_settings(tmp_path)
    store = await Store.open(settings.database)
    running = Job.for_request(
        build_request(args("one 10.0.0.81"), settings, "alice"), JobState.QUEUED
    )
    queued = Job.for_request(
        build_request(args("two 10.0.0.82"), settings, "alice"), JobState.QUEUED
    )
    await store.jobs.insert(running)
    await store.jobs.insert(queued)
    vm_id = sim.add_vm("one", tags={job_tag(running.id)}, running=True)
    stranger = sim.add_vm("someone-elses", running=True)
    await store.jobs.transition(running.id, [JobState.QUEUED], JobState.RUNNING, vm_id=vm_id)
    await store.close()

    async with running_deployer(settings, recorder, backends={"sim": sim}) as d:
        await d.drain()
        first = (await d.status(running.id)).job
        second = (await d.status(queued.id)).job
    assert first.state is JobState.FAILED
    assert first.error == "interrupted by a restart of the bot"
    assert second.state is JobState.SUCCEEDED
    names = sorted(vm.name for vm in sim.vms.values())
    assert names == ["someone-elses", "two"]
    assert stranger in sim.vms
    assert ("power_off", vm_id) in sim.task_log and ("destroy", vm_id) in sim.task_log


async def test_a_restart_with_a_vm_that_never_appeared_has_nothing_to_clean(
    tmp_path: Path, sim: SimBackend, recorder: Recorder
) -> None:
    settings = make_settings(tmp_path)
    store = await Store.open(settings.database)
    job = Job.for_request(build_request(args("one 10.0.0.81"), settings, "alice"), JobState.QUEUED)
    await store.jobs.insert(job)
    reserved = await sim.prepare_clone(CloneSpec(job.id, "one", "ubuntu-24.04"))
    await store.jobs.transition(job.id, [JobState.QUEUED], JobState.RUNNING, vm_id=reserved.vm_id)
    await store.close()
    async with running_deployer(settings, recorder, backends={"sim": sim}) as d:
        info = await d.status(job.id)
    assert info.job.state is JobState.FAILED and info.job.error == INTERRUPTED
    assert not [e for e in info.events if e.step == "rollback"]
    assert sim.task_log == []
    _job, report = recorder.finished[job.id]
    assert report is not None and report.clean and report.undone == []


async def test_wreckage_is_retried_until_it_is_gone(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    sim.inject("power_on", "error")
    sim.inject("destroy", "error", times=2)
    job = await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
    await deployer.drain()
    failed = (await deployer.status(job.id)).job
    assert failed.wreckage is not None and failed.vm_id in sim.vms
    assert await deployer.sweep_wreckage() == []  # the second destroy fails too
    assert (await deployer.status(job.id)).job.wreckage is not None
    assert await deployer.sweep_wreckage() == [job.id]
    cleaned = (await deployer.status(job.id)).job
    assert cleaned.wreckage is None and sim.vms == {}
    assert (job.id, f"the VM left behind ({failed.vm_id}) has now been removed.") in recorder.notes
    assert cleaned.state is JobState.FAILED  # the job's outcome does not change


async def test_a_succeeded_vm_holds_its_name_until_it_is_gone(
    deployer: Deployer, sim: SimBackend
) -> None:
    first = await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
    await deployer.drain()
    done = (await deployer.status(first.id)).job
    assert done.state is JobState.SUCCEEDED
    with pytest.raises(
        Conflict, match=f"web01 already exists on sim \\(job {first.id}, VM {done.vm_id}\\)"
    ):
        await deployer.request_deploy(args("web01 10.0.0.60"), "alice")
    with pytest.raises(Conflict, match=f"10.0.0.50 belongs to web01 \\(job {first.id}\\)"):
        await deployer.request_deploy(args("web02 10.0.0.50"), "alice")
    assert done.vm_id is not None
    del sim.vms[done.vm_id]  # someone deleted the VM by hand
    again = await deployer.request_deploy(args("web01 10.0.0.50"), "alice")
    released = await deployer.status(first.id)
    assert released.job.state is JobState.RELEASED
    assert released.events[-1].detail.endswith("its name and address are free again")
    await deployer.drain()
    assert (await deployer.status(again.id)).job.state is JobState.SUCCEEDED


async def test_cancel_while_awaiting_approval_closes_the_approval(strict: Deployer) -> None:
    job = await strict.request_deploy(args("web01 10.0.0.50"), "alice")
    await strict.cancel(job.id[:6], "alice")
    info = await strict.status(job.id)
    assert info.job.state is JobState.CANCELLED and info.approval is not None
    assert (info.approval.state, info.approval.decided_by) == (ApprovalState.CANCELLED, "alice")
    with pytest.raises(TransitionRefused, match="alice cancelled it at"):
        await strict.approve(job.id, "bob")
    with pytest.raises(TransitionRefused, match="not awaiting approval"):
        await strict.may_decide(job.id, "carol")
    # Past its expiry it is not listed as pending, and expiring leaves it cancelled.
    later = utcnow() + timedelta(days=1)
    assert await strict.store.approvals.expired(later) == []
    assert await strict.expire_approvals(later) == []
    after = await strict.status(job.id)
    assert after.approval is not None and after.approval.state is ApprovalState.CANCELLED
    assert after.job.state is JobState.CANCELLED


async def test_a_cancel_racing_an_approval_leaves_both_rows_agreeing(strict: Deployer) -> None:
    for number in range(10):
        job = await strict.request_deploy(args(f"race{number} 10.0.0.{60 + number}"), "alice")
        results = await asyncio.gather(
            strict.cancel(job.id, "alice"), strict.approve(job.id, "bob"), return_exceptions=True
        )
        assert sum(not isinstance(r, BaseException) for r in results) >= 1
        info = await strict.status(job.id)
        assert info.approval is not None
        pairs = {
            (JobState.CANCELLED, ApprovalState.CANCELLED),
            (JobState.QUEUED, ApprovalState.APPROVED),
            (JobState.RUNNING, ApprovalState.APPROVED),
            (JobState.SUCCEEDED, ApprovalState.APPROVED),
            (JobState.ROLLING_BACK, ApprovalState.APPROVED),
        }
        assert (info.job.state, info.approval.state) in pairs
    await strict.drain()
