"""Issue 28 on the simulator, end to end: the SSH check confirms the host key the address
presents (through the sim's guest agent, or as the key deploybot chose), refuses another
key (an impostor on the address) and rolls back, and says plainly when the key is only
seen over SSH. The user gets a ready known_hosts line."""

from __future__ import annotations

import logging
from pathlib import Path

import asyncssh
import pytest

from backends.abilities import ChoosesHostKeys, ReadsHostKeys
from backends.sim import ChoosingSim, SimBackend, Simulator, sim_backend
from backends.sshcheck import fingerprint
from bot.app.runtime import running_deployer
from bot.kinds.deploy.runs import vm_ref
from bot.models import HostKeySource, Job, JobState
from handlers.commands import answer
from handlers.messages.core import finished, slack_outcome_dm
from tests.support.deployer import SIM_SCALE, Recorder, deploy, make_settings


async def run_deploy(
    tmp_path: Path, sim: Simulator, recorder: Recorder | None = None
) -> tuple[Job, list[str]]:
    settings = make_settings(tmp_path)
    async with running_deployer(settings, recorder or Recorder(), backends={"sim": sim}) as d:
        job = await deploy(d)
        said = await answer(d, "alice", "known-hosts web01")
    return job, said


def test_the_modes_have_the_abilities() -> None:
    agent, chosen, none = (sim_backend(host_keys=m) for m in ("agent", "chosen", "none"))
    assert isinstance(agent, ReadsHostKeys) and not isinstance(agent, ChoosesHostKeys)
    assert isinstance(chosen, ChoosesHostKeys) and not isinstance(chosen, ReadsHostKeys)
    assert not isinstance(none, ReadsHostKeys) and not isinstance(none, ChoosesHostKeys)


async def test_a_key_read_through_the_agent_is_confirmed(tmp_path: Path) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    job, said = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    (vm,) = sim.vms.values()
    assert vm.host_key is not None and vm.host_key.startswith("ssh-ed25519 AAAA")
    assert job.host_key == vm.host_key  # the whole public line, not a fingerprint
    assert job.host_key_source is HostKeySource.AGENT
    line = f"web01,10.0.0.50 {vm.host_key}"
    assert job.known_hosts_line == line
    text = "\n".join(finished(job, None))
    assert f"    {line}" in text
    assert fingerprint(vm.host_key) in text and "guest agent" in text
    dm = slack_outcome_dm(job)
    assert f"`{line}`" in dm and "guest agent" in dm
    assert said[-1] == f"    {line}" and "guest agent" in said[0]


async def test_an_impostor_on_the_address_fails_the_deploy_and_rolls_back(
    tmp_path: Path,
) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    sim.inject("probe_ssh", "impostor")
    recorder = Recorder()
    job, said = await run_deploy(tmp_path, sim, recorder)
    assert job.state is JobState.FAILED
    assert job.failed_step == "ssh"
    assert sim.vms == {}  # rolled back: nothing left
    assert job.error is not None
    assert "10.0.0.50 answered with host key SHA256:" in job.error
    assert "possible address conflict or interception" in job.error
    assert "try again" not in job.error
    # Both fingerprints: the impostor's and the new VM's (read through the agent).
    assert job.error.count("SHA256:") == 2
    text = "\n".join(finished(job, recorder.finished[job.id][1]))
    assert "10.0.0.50" in text and "interception" in text
    # No known_hosts line for a failed deploy: it says so, naming the job.
    assert said == [
        f"web01 (job {job.short_id}) is not ready (failed): only a VM that is ready has a "
        f"host key to show. See `/deploy status {job.short_id}`."
    ]


async def test_keys_replaced_after_the_agent_read_them_are_read_again(tmp_path: Path) -> None:
    """The agent read the guest's keys just before cloud-init replaced them: the key
    sshd then presents is read again through the agent, not taken for an interceptor's."""
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    sim.inject("host_keys", "rekeyed")  # the first read only
    job, _said = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    (vm,) = sim.vms.values()
    assert job.host_key == vm.host_key and job.host_key_source is HostKeySource.AGENT


async def test_a_chosen_key_is_the_one_presented_and_then_forgotten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sim = ChoosingSim("sim", time_scale=SIM_SCALE)
    job, _said = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    (vm,) = sim.vms.values()
    assert job.host_key_source is HostKeySource.CHOSEN
    assert job.host_key == vm.host_key  # the sshd presents the key deploybot made
    assert vm.identity is not None and vm.identity.host_key is None  # never kept whole
    assert not await sim.holds_host_key(vm_ref(job))  # forgotten before it was ready
    assert ("forget_host_key", vm.vm_id) in sim.task_log
    assert "chosen by deploybot" in "\n".join(finished(job, None))
    # The private half is in no row and no log line.
    db = (tmp_path / "jobs.db").read_bytes()
    assert b"PRIVATE KEY" not in db and "PRIVATE KEY" not in caplog.text


async def test_a_chosen_key_is_forgotten_by_the_rollback(tmp_path: Path) -> None:
    """The destroy fails (the VM stays as wreckage): its stored user-data must not
    keep the private key."""
    sim = ChoosingSim("sim", time_scale=SIM_SCALE)
    sim.inject("power_on", "error")
    sim.inject("destroy", "error")
    job, _said = await run_deploy(tmp_path, sim)
    assert job.state is JobState.FAILED and job.wreckage
    (vm,) = sim.vms.values()
    assert vm.host_key is not None  # the identity installed the chosen key
    assert not await sim.holds_host_key(vm_ref(job))


async def test_a_forget_that_keeps_failing_fails_the_deploy(tmp_path: Path) -> None:
    sim = ChoosingSim("sim", time_scale=SIM_SCALE)
    sim.inject("forget_host_key", "error", times=1)  # the ready step's; the undo's works
    job, _said = await run_deploy(tmp_path, sim)
    assert job.state is JobState.FAILED and job.failed_step == "forget_key"
    assert sim.vms == {}


async def test_without_either_the_key_is_only_seen_over_ssh(tmp_path: Path) -> None:
    sim = sim_backend("sim", host_keys="none", time_scale=SIM_SCALE)
    job, said = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.host_key_source is HostKeySource.SSH
    text = "\n".join(finished(job, None))
    assert "only seen over SSH" in text and "can neither read" in text
    assert "only seen over SSH" in said[0]


async def test_an_old_job_shows_its_fingerprint_as_before(tmp_path: Path) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    job, _said = await run_deploy(tmp_path, sim)
    old = job.model_copy(update={"host_key": "SHA256:abc", "host_key_source": None})
    assert old.known_hosts_line is None
    assert finished(old, None)[-1] == "Its host key is SHA256:abc: check that ssh shows the same."


@pytest.mark.parametrize("typed", ["known-hosts nosuch", "known-hosts"])
async def test_known_hosts_refusals_say_what_to_do(tmp_path: Path, typed: str) -> None:
    settings = make_settings(tmp_path)
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(settings, Recorder(), backends={"sim": sim}) as d:
        said = await answer(d, "alice", typed)
    text = "\n".join(said)
    assert ("holds no VM called nosuch" in text) or ("/deploy known-hosts NAME" in text)


def test_the_sim_key_generator_is_ed25519() -> None:
    from backends.sshcheck import new_host_key

    pair = new_host_key()
    key = asyncssh.import_private_key(pair.private_openssh)
    assert " ".join(key.export_public_key().decode().split()[:2]) == pair.public
    assert "PRIVATE" not in repr(pair)


async def test_gc_lists_and_blanks_a_vm_that_still_holds_its_private_host_key(
    tmp_path: Path,
) -> None:
    """Every forget failed and so did the destroy: the VM is wreckage whose stored
    user-data keeps the private key. gc says so, and --apply removes the VM (and with a
    VM it keeps, the key)."""
    from bot.operations import gc

    sim = ChoosingSim("sim", time_scale=SIM_SCALE)
    sim.inject("forget_host_key", "error", times=2)  # the ready step's and the undo's
    sim.inject("destroy", "error", times=50)
    settings = make_settings(tmp_path)
    async with running_deployer(settings, Recorder(), backends={"sim": sim}) as d:
        job = await deploy(d)
        assert job.state is JobState.FAILED and job.wreckage
        assert await sim.holds_host_key(vm_ref(job))
        report = await gc.dry_run(d.store, {"sim": sim}, ["sim"])
        assert [f.vm.vm_id for f in report.holding_keys] == [job.vm_id]
        sim.faults.clear()
        applied = await gc.apply(d.store, {"sim": sim}, ["sim"], settings.timeouts, 600)
    assert [f.vm.vm_id for f in applied.removed] == [job.vm_id]
    assert sim.vms == {}


async def test_gc_apply_blanks_the_key_of_a_vm_it_keeps(tmp_path: Path) -> None:
    from bot.operations import gc

    sim = ChoosingSim("sim", time_scale=SIM_SCALE)
    settings = make_settings(tmp_path)
    async with running_deployer(settings, Recorder(), backends={"sim": sim}) as d:
        jobs = [await deploy(d), await deploy(d, "web02 10.0.0.51")]
        assert all(job.state is JobState.SUCCEEDED for job in jobs)
        vms = sorted(sim.vms.values(), key=lambda vm: vm.vm_id)
        for vm in vms:
            vm.user_data_key = "-----BEGIN OPENSSH PRIVATE KEY-----"  # put back by hand
        ids = [vm.vm_id for vm in vms]
        report = await gc.dry_run(d.store, {"sim": sim}, ["sim"])
        assert sorted(f.vm.vm_id for f in report.holding_keys) == ids  # every one, not the first
        applied = await gc.apply(d.store, {"sim": sim}, ["sim"], settings.timeouts, 600)
    assert sorted(f.vm.vm_id for f in applied.keys_forgotten) == ids
    assert all(vm.user_data_key is None and vm.running for vm in vms)  # the VMs are kept
