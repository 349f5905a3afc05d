"""Whole deploys through the real pipeline (queue, SQLite, steps, rollback) onto the fake
Proxmox API, with the real SSH check against the guest's sshd on 127.0.10.0/24."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from backends.sshcheck import fingerprint
from bot.app.runtime import running_deployer
from bot.config.settings import Settings
from bot.kinds.deploy.pipeline import STEPS as DEPLOY_STEPS
from bot.kinds.deploy.runs import vm_ref
from bot.models import HostKeySource, Job, JobEvent, JobState
from bot.models.errors import Conflict, RequestInvalid
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from handlers.messages.core import finished, slack_outcome_dm
from handlers.messages.text import step_label
from tests.support.deployer import Recorder
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import make_backend, pve_settings, start_fake
from tests.support.proxmox import ADDRESS, ORIGINAL, deploy, free_port, ours_left

# The steps every deploy walks (register: only with an IPAM record).
STEPS = tuple(step.name for step in DEPLOY_STEPS if step.name != "register")

# The fake server's fixtures, shared by the Proxmox test modules.
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls


@pytest.fixture
async def fake(pve_schema: ApiSchema, pve_tls: Tls) -> AsyncIterator[FakePVE]:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as server:
        yield server


def detail(events: list[JobEvent], step: str, phase: str = "finished") -> str:
    return next(e.detail for e in events if e.step == step and e.phase == phase)


async def test_a_deploy_ends_with_a_reachable_vm(fake: FakePVE, tmp_path: Path) -> None:
    job, events = await deploy(fake, pve_settings(tmp_path, fake), f"web01 {ADDRESS} disk=+10G")
    assert job.state is JobState.SUCCEEDED, job.error
    assert (job.final_address, job.ssh_line) == (ADDRESS, f"ssh ubuntu@{ADDRESS}")
    vmid = int(job.vm_id or 0)
    vm = fake.cluster.vms[vmid]
    assert vm.running and vm.config["name"] == "web01"
    assert vm_ref(job).tag in vm.config["tags"].split(";")
    assert vm.config["scsi0"].endswith("size=14G")
    seen = fake.cluster.guest.host_keys[vmid]  # the fingerprint of the guest's sshd's key
    assert job.host_key is not None and fingerprint(job.host_key) == seen
    assert job.host_key_source is HostKeySource.AGENT  # one of the keys the agent read
    assert detail(events, "clone").startswith(f"VM {vmid} on pve1@lab")
    assert detail(events, "ssh") == (
        f"{ADDRESS}:{fake.cluster.guest.ssh_port} answers, host key {seen} "
        "(confirmed through the QEMU guest agent)"
    )


async def test_a_storage_without_vm_disks_is_refused_as_such(fake: FakePVE, tmp_path: Path) -> None:
    """`local` exists on the node but holds ISOs and backups: not "no such storage"."""
    backend = make_backend(fake)
    settings = pve_settings(tmp_path, fake)
    async with running_deployer(settings, backends={"pve": backend}, grace_s=5) as d:
        args = parse(f"web01 {ADDRESS} storage=local")
        assert isinstance(args, DeployArgs)
        with pytest.raises(RequestInvalid) as refused:
            await d.request_deploy(args, "alice")
        assert "'local' is not a storage for VM disks on pve" in refused.value.message
        assert "local-lvm" in refused.value.message  # what to choose instead
        assert await d.history() == []


async def test_a_7_4_server_says_why_ciupgrade_was_not_sent(
    pve_schema: ApiSchema,
    pve_tls: Tls,
    tmp_path: Path,
) -> None:
    async with start_fake(pve_schema, pve_tls, release="7.4", ssh_port=free_port()) as old:
        job, events = await deploy(old, pve_settings(tmp_path, old), f"web01 {ADDRESS}")
    assert job.state is JobState.SUCCEEDED, job.error
    assert detail(events, "identity").startswith("server 7.4: ciupgrade not sent")


async def test_two_deploys_racing_for_a_vmid_take_the_next_one(
    fake: FakePVE, tmp_path: Path
) -> None:
    fake.inject("nextid", "race")  # another client clones into the id we were given
    job, _events = await deploy(fake, pve_settings(tmp_path, fake), f"web01 {ADDRESS}")
    assert job.state is JobState.SUCCEEDED, job.error
    intruder = next(v for v in fake.cluster.vms.values() if v.config["name"].startswith("intruder"))
    assert job.vm_id != str(intruder.vmid)
    assert not [
        r
        for r in fake.requests
        if r.method != "GET" and r.path_params.get("vmid") == str(intruder.vmid)
    ]


Setup = Callable[[FakePVE], Any]
# A failure in each step (and the lock timeouts and task errors of the issue): the step
# that fails, the step at whose start the fault is planted, the fault, the reason given.
FAILURES: dict[str, tuple[str, str, Setup, str]] = {
    "check_free": (
        "check_free",
        "check_free",
        lambda f: f.inject("resources", "error", message="cfs not ready"),
        "cfs not ready",
    ),
    "clone task": (
        "clone",
        "clone",
        lambda f: f.inject("clone", "task_error", message="clone failed: disk full"),
        "disk full",
    ),
    "clone lock": (
        "clone",
        "clone",
        lambda f: f.inject("clone", "lock_timeout", times=10_000),
        "got timeout",
    ),
    # The clone outlives its step: the destroy waits for the clone's lock, then removes it.
    "clone slow": (
        "clone",
        "clone",
        lambda f: setattr(f.cluster.timings, "clone_s", 1.6),
        "timed out",
    ),
    "identity task": (
        "identity",
        "identity",
        lambda f: f.inject("config", "task_error", message="bad cloud-init drive"),
        "bad cloud-init drive",
    ),
    "identity lock": (
        "identity",
        "identity",
        lambda f: f.inject("config", "task_lock_timeout", times=10_000),
        "got timeout",
    ),
    "resize": (
        "resize",
        "resize",
        lambda f: f.inject("resize", "task_error", message="no space left"),
        "no space left",
    ),
    "power_on": (
        "power_on",
        "power_on",
        lambda f: f.inject("start", "task_error", message="start failed: kvm died"),
        "kvm died",
    ),
    "address": (  # a template without qemu-guest-agent
        "address",
        "check_free",
        lambda f: setattr(f.cluster.vms[9000], "agent_installed", False),
        "has not answered",
    ),
    "ssh": (  # no sshd answers
        "ssh",
        "check_free",
        lambda f: setattr(f.cluster.guest, "ssh_port", None),
        "does not answer yet",
    ),
}


@pytest.mark.parametrize("case", FAILURES)
async def test_a_failure_in_any_step_leaves_no_vm_behind(
    fake: FakePVE, tmp_path: Path, case: str
) -> None:
    step, when, setup, reason = FAILURES[case]
    recorder = Recorder()

    async def at_step(job: Job, started: str) -> None:
        if started == when:
            setup(fake)

    recorder.on_step = at_step
    steps = ("check_free", "clone", "identity", "resize", "power_on", "address", "ssh")
    settings = pve_settings(tmp_path, fake)
    timeouts = {**settings.timeouts.model_dump(), **{f"{s}_s": 1.0 for s in steps}}
    job, events = await deploy(
        fake, pve_settings(tmp_path, fake, timeouts=timeouts), f"web01 {ADDRESS} disk=+2G", recorder
    )
    assert job.state is JobState.FAILED
    assert (job.failed_step, reason in (job.error or "")) == (step, True), job.error
    await fake.settled()
    assert ours_left(fake) == [] and set(fake.cluster.vms) == ORIGINAL
    assert job.wreckage is None
    _job, report = recorder.finished[job.id]
    assert report is not None and report.clean, report
    undone = [e.detail.split()[0] for e in events if e.step == "rollback" and e.phase == "undo"]
    started = STEPS.index(step) >= STEPS.index("power_on")
    # A clone retried after lock timeouts pushes one destroy per attempt (all of one id).
    expected = ["stop", "destroy"] if started else ["destroy"] if step != "check_free" else []
    assert (undone[:1], set(undone)) == (expected[:1], set(expected))
    stops = [t for t in fake.cluster.tasks.values() if t.type == "qmstop"]
    assert len(stops) == (1 if STEPS.index(step) > STEPS.index("power_on") else 0)
    for stop in stops:  # the VM was running: the stop task ended before the delete was sent
        delete = fake.sent("DELETE", "/nodes/{node}/qemu/{vmid}")[-1]
        assert stop.ended_s is not None and delete.at_s >= stop.ended_s


async def test_an_address_a_vm_built_by_hand_has_is_refused_and_skipped(
    fake: FakePVE, tmp_path: Path
) -> None:
    """A VM made in the web UI with a static cloud-init address (ipconfig0), no tag of
    ours: asking for its address is refused naming it; the next free address skips it."""
    fake.cluster.add_vm(4242, "legacy01", ipconfig0=f"ip={ADDRESS}/24,gw=127.0.10.1")
    subnet = {
        "name": "lab",
        "cidr": "127.0.10.0/24",
        "gateway": "127.0.10.1",
        "pool": "127.0.10.50-127.0.10.60",
    }
    approval = {"approvers": ["bob"], "always": True}  # recorded, not run
    settings = pve_settings(tmp_path, fake, subnets=[subnet], approval=approval)
    async with running_deployer(settings, backends={"pve": make_backend(fake)}) as d:
        asked = parse(f"web01 {ADDRESS}")
        assert isinstance(asked, DeployArgs)
        with pytest.raises(Conflict) as refused:
            await d.request_deploy(asked, "alice")
        assert f"{ADDRESS} is used by VM legacy01 (id 4242) on pve, ipconfig0" in (
            refused.value.message
        )
        picked = parse("web02")
        assert isinstance(picked, DeployArgs)
        job = await d.request_deploy(picked, "alice")
        assert job.address == "127.0.10.51"


async def deploy_all(
    fake: FakePVE,
    settings: Settings,
    texts: list[str],
    recorder: Recorder | None = None,
    **backend: Any,
) -> list[Job]:
    """Deploys asked for together, through one backend (`backend`: its config's
    overrides); their final records."""
    proxmox = make_backend(fake, **backend)
    async with running_deployer(settings, recorder, backends={"pve": proxmox}, grace_s=5) as d:
        asked = [parse(text) for text in texts]
        jobs = [await d.request_deploy(a, "alice") for a in asked if isinstance(a, DeployArgs)]
        await d.drain()
        return [(await d.status(j.id)).job for j in jobs]


def at_first(step: str, action: Callable[[], Any]) -> Recorder:
    """A recorder that runs `action` when `step` first starts."""
    recorder, done = Recorder(), list[object]()

    def on_step(job: Job, started: str) -> None:
        if started == step and not done:
            done.append(action())

    recorder.on_step = on_step
    return recorder


async def test_task_reads_answering_500_for_a_while_fail_no_deploy_in_flight(
    fake: FakePVE, tmp_path: Path
) -> None:
    """Issue 25, item 12: the task list and the task status answering 500 ("unable to
    read task index") while three clones run and end: every deploy goes on."""
    fake.cluster.timings.clone_s = 0.3

    def outage() -> None:
        for endpoint in ("tasks", "task_status"):
            fake.inject(endpoint, "error", for_s=0.6, message="unable to read task index")

    settings = pve_settings(tmp_path, fake, limits={"max_running": 3})
    texts = [f"web0{i} 127.0.10.{50 + i}" for i in range(3)]
    jobs = await deploy_all(fake, settings, texts, at_first("clone", outage))
    assert [j.state for j in jobs] == [JobState.SUCCEEDED] * 3, [j.error for j in jobs]
    failed = [r for r in fake.requests if r.status == 500 and "/tasks" in (r.template or "")]
    assert failed, "the reads were meant to fail for a while"


async def test_task_reads_failing_past_the_step_timeout_name_the_failure(
    fake: FakePVE, tmp_path: Path
) -> None:
    def outage() -> None:
        for endpoint in ("tasks", "task_status"):
            fake.inject(endpoint, "error", for_s=1.5, message="unable to read task index")

    settings = pve_settings(tmp_path, fake)
    timeouts = {**settings.timeouts.model_dump(), "clone_s": 1.0}
    settings = pve_settings(tmp_path, fake, timeouts=timeouts)
    (job,) = await deploy_all(fake, settings, [f"web01 {ADDRESS}"], at_first("clone", outage))
    assert (job.state, job.failed_step) == (JobState.FAILED, "clone")
    assert job.error is not None and job.error.startswith("timed out after 1 s (last: "), job.error
    assert "unable to read task index (asking again" in job.error, job.error
    await fake.settled()
    assert ours_left(fake) == []


async def test_a_node_out_of_reach_during_the_boot_wait_is_said_so(
    fake: FakePVE, tmp_path: Path
) -> None:
    """Issue 25, item 13: the node answering 595 to every question of the boot wait."""

    def no_route() -> None:
        fake.inject("agent_ping", "error", times=10_000, status=595, message="No route to host")

    recorder = at_first("address", no_route)
    settings = pve_settings(tmp_path, fake)
    timeouts = {**settings.timeouts.model_dump(), "address_s": 1.0}
    settings = pve_settings(tmp_path, fake, timeouts=timeouts)
    (job,) = await deploy_all(fake, settings, [f"web01 {ADDRESS}"], recorder)
    assert (job.state, job.failed_step) == (JobState.FAILED, "address")
    assert job.error is not None and "qemu-guest-agent" not in job.error, job.error
    assert "got no answer from the API (last: guest agent of VM" in job.error, job.error
    assert "answered 595 No route to host); check that node pve1 is up" in job.error
    assert any("waiting for pve (unreachable since" in text for _job, text in recorder.notes)


def clone_lock(fake: FakePVE) -> Callable[[], None]:
    """The template's file lock held by another task for good."""
    return lambda: fake.inject("clone", "lock_timeout", times=10_000)


async def test_a_lock_outlasting_a_shorter_step_is_named(fake: FakePVE, tmp_path: Path) -> None:
    """Issue 25, item 14: the step (1 s) ends before lock_wait_s (5 s): its timeout still
    names the lock and what to do about it."""
    settings = pve_settings(tmp_path, fake)
    timeouts = {**settings.timeouts.model_dump(), "clone_s": 1.0}
    settings = pve_settings(tmp_path, fake, timeouts=timeouts)
    recorder = at_first("clone", clone_lock(fake))
    (job,) = await deploy_all(fake, settings, [f"web01 {ADDRESS}"], recorder, lock_wait_s=5.0)
    assert (job.state, job.failed_step) == (JobState.FAILED, "clone")
    assert job.error is not None and job.error.startswith("timed out after 1 s (last: clone of ")
    assert "lock-9000.conf' - got timeout; still so after " in job.error, job.error
    assert "Find it in the task list of node pve1" in job.error, job.error


async def test_a_failure_ends_as_one_sentence_and_claims_no_undo_it_did_not_need(
    fake: FakePVE, tmp_path: Path
) -> None:
    """Issue 25, item 14: a reason ending in its own full stop gets no second one; a
    clone that never made its VM is not reported as "Rolled back: destroy VM ..."."""
    recorder = at_first("clone", clone_lock(fake))
    settings = pve_settings(tmp_path, fake)
    (job,) = await deploy_all(fake, settings, [f"web01 {ADDRESS}"], recorder, lock_wait_s=0.3)
    assert (job.state, job.failed_step) == (JobState.FAILED, "clone")
    assert job.error is not None and job.error.endswith("stop it."), job.error
    final, report = recorder.finished[job.id]
    lines = finished(final, report)
    assert lines[0] == f"failed at {step_label('clone')}: {job.error}", lines
    assert lines[1:] == [
        "Nothing had been built, so there was nothing to remove.",
        "Fix the cause (or ask an operator), then run the same /deploy again.",
    ], lines
    assert ".." not in slack_outcome_dm(final)


async def test_a_vm_that_was_built_is_reported_rolled_back(fake: FakePVE, tmp_path: Path) -> None:
    recorder = at_first(
        "identity", lambda: fake.inject("config", "task_error", message="bad cloud-init drive")
    )
    (job,) = await deploy_all(fake, pve_settings(tmp_path, fake), [f"web01 {ADDRESS}"], recorder)
    final, report = recorder.finished[job.id]
    assert f"Rolled back: destroy VM {job.vm_id}." in finished(final, report)
