"""Every step x every fault on the simulator: the job fails, the rollback runs in
reverse, and nothing is left on the hypervisor."""

from __future__ import annotations

import pytest

from backends.sim import SimBackend
from backends.sim.vm import FAULT_KINDS
from bot.app.service import Deployer
from bot.jobs.steps import Step, resume_point
from bot.kinds.deploy.pipeline import STEPS as DEPLOY_STEPS
from bot.kinds.deploy.runs import vm_ref
from bot.models import Job, JobEvent, JobState
from bot.models.errors import Conflict, RequestInvalid
from bot.requests.grammar import parse
from tests.support.deployer import REQUEST, Recorder, deploy

# The steps every deploy walks (register: only with an IPAM record; forget_key: only
# where deploybot chose the host key; certify: only with a host CA, its own tests in
# tests/test_host_certificates.py).
STEPS = tuple(
    step.name for step in DEPLOY_STEPS if step.name not in ("certify", "register", "forget_key")
)

# Which simulator operation each step calls.
STEP_OPS = {
    "check_free": "find_by_name",
    "clone": "clone",
    "identity": "apply_identity",
    "resize": "grow_disk",
    "power_on": "power_on",
    "address": "wait_for_address",
    "ssh": "probe_ssh",
}
# What the rollback must undo, in order, after a failure in each step.
UNDO_AFTER = {
    "check_free": [],
    "clone": ["destroy"],
    "identity": ["destroy"],
    "resize": ["destroy"],
    "power_on": ["stop", "destroy"],
    "address": ["stop", "destroy"],
    "ssh": ["stop", "destroy"],
}


async def undo_events(deployer: Deployer, job: Job) -> list[str]:
    events = (await deployer.status(job.id)).events
    return [e.detail.split()[0] for e in events if e.step == "rollback" and e.phase == "undo"]


def test_every_step_is_covered() -> None:
    assert set(STEP_OPS) == set(STEPS) == set(UNDO_AFTER)


async def test_a_deploy_walks_every_step(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    job = await deploy(deployer)
    assert job.state is JobState.SUCCEEDED
    assert job.final_address == "10.0.0.50"
    assert job.ssh_line == "ssh ubuntu@10.0.0.50"
    ok_steps = [step for _id, step, phase in recorder.steps if phase == "ok"]
    assert ok_steps == list(STEPS)
    (vm,) = sim.vms.values()
    assert vm.running and vm.name == "web01" and job.vm_id == vm.vm_id
    assert vm.identity is not None and str(vm.identity.address) == "10.0.0.50/24"
    assert vm.disk_gib == 4 + 10
    assert vm_ref(job).tag in vm.tags
    assert vm_ref(job).tag == f"deploybot-{deployer.store.installation_id}-{job.id}"


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("step", STEPS)
async def test_a_fault_in_any_step_rolls_back_everything(
    deployer: Deployer, sim: SimBackend, recorder: Recorder, step: str, kind: str
) -> None:
    sim.inject(STEP_OPS[step], kind)  # type: ignore[arg-type]
    job = await deploy(deployer)
    assert job.state is JobState.FAILED
    assert job.failed_step == step
    assert job.error
    if kind == "hang":
        assert "timed out" in job.error
    if kind == "crash":
        assert "internal error" in job.error and "SimulatedCrash" not in job.error
    assert sim.vms == {}, f"left behind: {list(sim.vms)}"
    assert job.wreckage is None
    assert await undo_events(deployer, job) == UNDO_AFTER[step]
    # A VM that was running was stopped, and the stop finished before the destroy.
    ops = [op for op, _vm in sim.task_log if op in ("power_off", "destroy")]
    if "power_off" in ops:
        assert ops.index("power_off") < ops.index("destroy")
    _job, report = recorder.finished[job.id]
    assert report is not None and report.clean


@pytest.mark.parametrize("step", [s for s in STEPS if s != "check_free"])
async def test_a_retryable_error_is_retried_within_the_step(
    deployer: Deployer, sim: SimBackend, step: str
) -> None:
    sim.inject(STEP_OPS[step], "flaky", times=2)
    job = await deploy(deployer)
    assert job.state is JobState.SUCCEEDED


@pytest.mark.parametrize("step", STEPS)
async def test_a_cancel_in_any_step_rolls_back(
    deployer: Deployer, sim: SimBackend, recorder: Recorder, step: str
) -> None:
    async def cancel_at(job: Job, started: str) -> None:
        if started == step:
            await deployer.cancel(job.id, "alice")

    recorder.on_step = cancel_at
    job = await deploy(deployer)
    assert job.state is JobState.CANCELLED
    assert sim.vms == {}
    assert job.wreckage is None


async def test_a_cancel_during_a_hung_call_rolls_back(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    sim.inject("wait_for_address", "hang")
    job = await deployer.request_deploy(parse(REQUEST), "alice")  # type: ignore[arg-type]
    await recorder.seen("address").wait()
    await deployer.cancel(job.id, "bob")
    await deployer.drain()
    final = (await deployer.status(job.id)).job
    assert final.state is JobState.CANCELLED
    assert sim.vms == {}
    assert await undo_events(deployer, final) == ["stop", "destroy"]


async def test_a_failing_undo_is_reported_and_the_job_still_ends(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    sim.inject("probe_ssh", "error")
    sim.inject("destroy", "error")
    job = await deploy(deployer)
    assert job.state is JobState.FAILED
    assert job.failed_step == "ssh"  # the original error, not the rollback's
    (vm_id,) = sim.vms
    assert job.wreckage is not None and f"VM {vm_id}" in job.wreckage
    _job, report = recorder.finished[job.id]
    assert report is not None
    assert report.undone == [f"stop VM {vm_id}"]
    assert any(f.startswith(f"destroy VM {vm_id}") for f in report.failed)


async def test_a_hanging_undo_times_out_and_the_vm_is_checked_afterwards(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    """The destroy's answer never comes, but the hypervisor did it: the check after the
    rollback sees the VM gone, so nothing is reported as left behind."""
    sim.inject("power_on", "error")
    sim.inject("destroy", "hang")
    job = await deploy(deployer)
    assert job.state is JobState.FAILED
    _job, report = recorder.finished[job.id]
    assert report is not None and any("timed out" in f for f in report.failed)
    assert sim.vms == {}
    assert job.wreckage is None


async def test_an_existing_vm_of_that_name_stops_the_deploy_before_anything_is_built(
    deployer: Deployer, sim: SimBackend
) -> None:
    other = sim.add_vm("web01")
    job = await deploy(deployer)
    assert job.state is JobState.FAILED and job.failed_step == "check_free"
    assert "already exists" in (job.error or "")
    assert list(sim.vms) == [other]  # the VM that was there is untouched
    assert ("clone", other) not in sim.task_log


async def test_an_address_held_by_a_live_vm_is_refused(deployer: Deployer, sim: SimBackend) -> None:
    first = await deploy(deployer, "web01 10.0.0.50")
    assert first.state is JobState.SUCCEEDED
    with pytest.raises(Conflict, match=f"belongs to web01 \\(job {first.id}\\)"):
        await deploy(deployer, "web02 10.0.0.50")
    assert len(sim.vms) == 1


async def test_rollback_never_touches_a_vm_without_the_job_tag(
    deployer: Deployer, sim: SimBackend
) -> None:
    """If the VM at the recorded id is not ours, rollback refuses and reports it."""
    sim.inject("power_on", "error")
    original_clone = sim.clone

    async def clone_then_lose_tag(spec, ref):  # type: ignore[no-untyped-def]
        await original_clone(spec, ref)
        sim.vms[ref.vm_id].tags.clear()  # someone re-tagged it behind our back

    sim.clone = clone_then_lose_tag  # type: ignore[method-assign]
    job = await deploy(deployer)
    assert job.state is JobState.FAILED
    assert job.failed_step == "identity"  # identity refuses too: not our VM
    assert len(sim.vms) == 1  # left alone
    assert ("destroy", next(iter(sim.vms))) not in sim.task_log


async def test_deploys_run_concurrently_and_independently(
    deployer: Deployer, sim: SimBackend
) -> None:
    sim.inject("power_on", "error")
    jobs = [
        await deployer.request_deploy(parse(f"vm{i} 10.0.0.{60 + i}"), "alice")  # type: ignore[arg-type]
        for i in range(6)
    ]
    await deployer.drain()
    states = [(await deployer.status(j.id)).job.state for j in jobs]
    assert states.count(JobState.FAILED) == 1
    assert states.count(JobState.SUCCEEDED) == 5
    assert len(sim.vms) == 5


async def test_an_outage_makes_the_job_wait_and_say_so(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    """The hypervisor stops answering when power-on starts and comes back once the
    thread has said the job is waiting: the deploy carries on instead of failing."""

    def outage_at_power_on(job: Job, step: str) -> None:
        if step == "power_on":
            sim.down = True

    async def back_when_told(job: Job, text: str) -> None:
        recorder.notes.append((job.id, text))
        sim.down = False

    recorder.on_step = outage_at_power_on
    recorder.job_note = back_when_told  # type: ignore[method-assign]
    job = await deploy(deployer)
    assert job.state is JobState.SUCCEEDED
    notes = [text for _id, text in recorder.notes]
    assert notes[0].startswith("waiting for sim (unreachable since ")
    assert "connection refused" in notes[0]
    assert notes[1] == "sim answers again; carrying on."
    events = (await deployer.status(job.id)).events
    assert [e.detail for e in events if e.phase == "note"] == notes


async def test_an_outage_longer_than_the_step_fails_it_with_the_reason(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    def outage(job: Job, step: str) -> None:
        sim.down = True

    recorder.on_step = outage
    job = await deploy(deployer)
    assert job.state is JobState.FAILED and job.failed_step == "check_free"
    assert "timed out" in (job.error or "") and "connection refused" in (job.error or "")


async def test_a_request_while_the_hypervisor_is_down_is_refused_and_recorded_nowhere(
    deployer: Deployer, sim: SimBackend
) -> None:
    sim.down = True
    with pytest.raises(RequestInvalid, match=r"sim did not answer .*try again in a minute"):
        await deployer.request_deploy(parse(REQUEST), "alice")  # type: ignore[arg-type]
    assert await deployer.history() == []


def _events(*pairs: tuple[str, str]) -> list[JobEvent]:
    return [JobEvent(job_id="jresume", step=step, phase=phase) for step, phase in pairs]


@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        ([], None),
        ([("check_free", "finished"), ("clone", "started")], None),  # a clone half done
        ([("clone", "finished")], "identity"),
        ([("clone", "finished"), ("identity", "started")], "identity"),
        ([("identity", "finished"), ("resize", "started")], "resize"),  # aims at a marked size
        ([("identity", "finished"), ("resize", "skipped"), ("power_on", "started")], "power_on"),
        ([("power_on", "finished"), ("address", "started")], "address"),
        ([("address", "finished"), ("ssh", "started")], "address"),  # read the address again
        ([("ssh", "finished")], "address"),  # the success write was lost
        ([("ssh", "finished"), ("register", "finished")], "address"),
        ([("ssh", "finished"), ("certify", "finished")], "address"),  # certified again
        ([("ssh", "finished"), ("certify", "skipped")], "address"),
        ([("power_on", "finished"), ("note", "note")], "address"),  # not a step: ignored
    ],
)
def test_resume_point(pairs: list[tuple[str, str]], expected: str | None) -> None:
    point = resume_point(DEPLOY_STEPS, _events(*pairs))
    assert (DEPLOY_STEPS[point].name if point is not None else None) == expected


def test_the_deploy_declares_each_step_once_with_its_undo() -> None:
    names = [step.name for step in DEPLOY_STEPS]
    assert names == [*STEPS, "certify", "forget_key", "register"]
    assert len(set(names)) == len(names)
    undone = [s.name for s in DEPLOY_STEPS if s.undo is not None]
    assert undone == ["clone", "power_on", "register"]
    assert [s.name for s in DEPLOY_STEPS if s.polled] == ["ssh"]
    assert [s.name for s in DEPLOY_STEPS if not s.resumable] == ["check_free"]


async def _nothing(service: object, run: object) -> None:
    return None


def test_a_step_naming_no_timeout_setting_is_refused_where_it_is_declared() -> None:
    with pytest.raises(ValueError, match=r"step clone: no \[timeouts\] setting clone"):
        Step("clone", _nothing, "clone")


async def test_an_id_taken_by_another_client_is_chosen_anew_and_theirs_is_untouched(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    def steal_the_next_id(job: Job, step: str) -> None:
        if step == "clone":  # between choosing the id and cloning, someone else uses it
            sim.add_vm("someone-elses", running=True)
            sim.inventory.next_id -= 1  # ...without the simulator's counter having moved for us

    recorder.on_step = steal_the_next_id
    job = await deploy(deployer, "web01 10.0.0.50")
    assert job.state is JobState.SUCCEEDED
    names = sorted(vm.name for vm in sim.vms.values())
    assert names == ["someone-elses", "web01"]
    assert sim.vms[job.vm_id or ""].name == "web01"
