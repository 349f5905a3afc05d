"""Request economy on Proxmox: waits paced by learned durations, counted in requests
against the fake (whole deploys through the real pipeline, SSH check included)."""

from __future__ import annotations

import itertools
import socket
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.abilities import StepTime
from backends.base import CloneSpec
from backends.proxmox import create
from backends.proxmox.config import TYPICAL_S, Config
from backends.proxmox.inventory import LISTING_REUSE_S
from backends.proxmox.pacing import Pace, Pacing, PollTiming, Schedule, clone_key
from bot.app.runtime import running_deployer
from bot.jobs.durations import PACED_STEPS
from bot.kinds.deploy.preflight import Preflight
from bot.models import JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from store.db import Store
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Recorded, Tls
from tests.support.fakepve.testing import config_data, environ, pve_settings, start_fake

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

PING = "/nodes/{node}/qemu/{vmid}/agent/ping"
INTERFACES = "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces"
POLLS = {"/nodes/{node}/tasks/{upid}/status", "/nodes/{node}/tasks", PING}

# Requests of a whole deploy (issue 25: 25), and the guest agent's reads of the three
# SSH host key files that confirm the key the address presents (issue 28).
GOAL_REQUESTS = 25 + 3
# A process's first deploy of a template also asks the privileges of its 3 paths before
# cloning (bot/kinds/deploy/preflight.py; a running bot keeps the answer 5 minutes).
FIRST_ASK_GOAL = GOAL_REQUESTS + 3


def free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
async def fake(pve_schema: ApiSchema, pve_tls: Tls) -> AsyncIterator[FakePVE]:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port("127.0.10.1")) as server:
        yield server


async def deploy(
    fake: FakePVE, tmp_path: Path, pacing: Pacing, text: str, preflight: Preflight | None = None
) -> list[Recorded]:
    """One deploy with a backend of its own (as after a restart, but for `pacing`, which
    carries what the earlier ones learned, and `preflight`, the privilege check's memory
    of a running bot: a new process asks its 3 paths once more, 25 + 3 + 3 in
    docs/backends.md); the requests it sent."""
    before = len(fake.requests)
    backend = create(Config.model_validate(config_data(fake)), environ(fake), pacing=pacing)
    settings = pve_settings(tmp_path, fake)
    async with running_deployer(
        settings, backends={"pve": backend}, grace_s=5, preflight=preflight
    ) as deployer:
        args = parse(text)
        assert isinstance(args, DeployArgs)
        job = await deployer.request_deploy(args, "alice")
        await deployer.drain()
        info = await deployer.status(job.id)
    assert info.job.state is JobState.SUCCEEDED, info.job.error
    return fake.requests[before:]


def polls(sent: list[Recorded]) -> int:
    return sum(1 for r in sent if r.template in POLLS)


async def test_a_learned_deploy_stays_within_the_request_goal_and_polls_less(
    fake: FakePVE, tmp_path: Path
) -> None:
    pacing, preflight = Pacing(), Preflight()
    first = await deploy(fake, tmp_path, pacing, "web01 127.0.10.51", preflight)
    second = await deploy(fake, tmp_path, pacing, "web02 127.0.10.52", preflight)
    routes = Counter(f"{r.method} {r.template}" for r in second)
    assert len(second) <= GOAL_REQUESTS, routes
    assert polls(second) < polls(first), (polls(first), polls(second))


async def test_a_new_templates_first_deploy_starts_from_the_other_templates(
    fake: FakePVE, tmp_path: Path
) -> None:
    """Issue 25, item 15: a template never deployed starts from what this backend's
    other templates took, not from fast polling."""
    pacing = Pacing()
    first = await deploy(fake, tmp_path, pacing, "web01 127.0.10.51")
    new = await deploy(fake, tmp_path, pacing, "web02 127.0.10.52 template=debian-12")
    routes = Counter(f"{r.method} {r.template}" for r in new)
    assert len(new) <= FIRST_ASK_GOAL, routes
    assert polls(new) < polls(first), (polls(first), polls(new))
    assert pacing.expected_s("clone", clone_key("debian-12", None)) is not None


def test_a_first_deploy_starts_from_the_typical_durations(fake: FakePVE) -> None:
    """With no history and no `expect_s`, the first looks come at typical durations."""
    data = {k: v for k, v in config_data(fake).items() if k != "expect_s"}
    backend = create(Config.model_validate(data), environ(fake))
    assert backend.pacing.expected_s("clone", clone_key("any", None)) == TYPICAL_S["clone"]
    assert backend.pacing.expected_s("boot", "any") == TYPICAL_S["boot"] == 3.0
    chosen = create(Config.model_validate({**data, "expect_s": {"boot": 20.0}}), environ(fake))
    assert chosen.pacing.expected_s("boot", "any") == 20.0
    assert chosen.pacing.expected_s("clone", "any@") is None  # replaced: polled fast


async def test_the_agent_is_asked_for_interfaces_only_after_it_answered_ping(
    fake: FakePVE, tmp_path: Path
) -> None:
    sent = await deploy(fake, tmp_path, Pacing(), "web01 127.0.10.53")
    agent = [(r.template, r.status) for r in sent if r.template in (PING, INTERFACES)]
    first_answer = agent.index((PING, 200))
    assert all(template == PING for template, _status in agent[:first_answer])
    assert [s for t, s in agent[first_answer + 1 :] if t == PING] == []
    assert (INTERFACES, 200) in agent[first_answer:]


def test_a_schedule_looks_at_the_expected_end_then_geometrically_later() -> None:
    timing = PollTiming(initial_s=0.1, ratio=0.1, max_s=2.0)
    schedule = Schedule(2.0, timing)
    looks = [schedule.next_at()]
    for _ in range(4):
        schedule.saw_running(looks[-1])
        looks.append(schedule.next_at())
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(looks)]
    assert looks[0] == 2.0 and gaps == [0.02, 0.04, 0.08, 0.16]


def learnt(pacing: Pacing, truth_s: float, operation: str = "start") -> int:
    """One wait that ends at `truth_s`, looked at as its schedule says; its misses."""
    schedule = pacing.schedule(operation, "t", PollTiming())
    while schedule.next_at() < truth_s:
        schedule.saw_running(schedule.next_at())
    pacing.learn(operation, "t", schedule, schedule.next_at())
    return schedule.looks


def test_pacing_learns_per_operation_and_key_and_aims_earlier_when_it_was_early() -> None:
    pacing = Pacing({"clone": 5.0})
    timing = PollTiming()
    assert pacing.expected_s("clone", "t@linked") == 5.0  # the configured seed
    assert pacing.expected_s("start", "t") is None  # unknown: fast polling
    blind = pacing.schedule("start", "t", timing)
    blind.saw_running(0.9)
    pacing.learn("start", "t", blind, 1.0)
    assert pacing.expected_s("start", "t") == pytest.approx(0.95)  # between the looks
    # Another key (a new template): the backend's typical, its quickest known.
    assert pacing.expected_s("start", "other") == pytest.approx(0.95)
    # The truth is at most 0.05 s above: the look after the first is at the bound.
    assert pacing.schedule("start", "t", timing).next_at() == pytest.approx(0.95)
    assert learnt(pacing, 0.99) == 1
    assert pacing.expected_s("start", "t") == pytest.approx(1.0)
    early = pacing.schedule("start", "t", timing)  # done at its first look: maybe sooner
    pacing.learn("start", "t", early, 1.0)
    estimate = pacing.expected_s("start", "t")
    assert estimate is not None and 0.99 < estimate < 1.0


def test_an_estimate_far_too_long_comes_down_in_a_few_waits() -> None:
    """Each wait over at its first look takes off twice the share the last one did."""
    pacing = Pacing({"start": 2.0})
    estimates = []
    for _ in range(8):
        assert learnt(pacing, 1.0) == 0
        estimates.append(pacing.expected_s("start", "t"))
    assert estimates[0] == pytest.approx(2.0 * 0.9975)
    assert estimates[-1] is not None and estimates[-1] < 1.6


def test_a_wait_seen_running_raises_the_estimate_and_the_cut_starts_small_again() -> None:
    pacing = Pacing({"start": 2.0})
    for _ in range(6):
        learnt(pacing, 1.0)  # cutting 0.25%, 0.5%, ... 8%: down to ~1.7 s
    before = pacing.expected_s("start", "t")
    assert before is not None and 1.6 < before < 1.8
    assert learnt(pacing, before * 1.02) == 2  # looks at +0%, +1%, +3%: 2 missed
    raised = pacing.expected_s("start", "t")  # where it was seen over
    assert raised is not None and raised == pytest.approx(before * (1 + 0.01 + 0.02))
    assert learnt(pacing, before * 1.02) == 0
    assert pacing.expected_s("start", "t") == pytest.approx(raised * 0.9975)  # cut small


def test_in_a_steady_state_one_wait_in_several_costs_a_look_and_none_is_late() -> None:
    """A deploy's waits, again and again: after the first few, the first look comes
    within ~1% of the end, and a look is missed at most every other wait."""
    pacing = Pacing({"boot": 3.3})
    for _ in range(10):
        learnt(pacing, 3.0, "boot")
    misses = [learnt(pacing, 3.0, "boot") for _ in range(40)]
    estimate = pacing.expected_s("boot", "t")
    assert estimate is not None and 2.97 < estimate < 3.04
    assert sum(misses) <= 20, misses


def test_fifty_waits_from_one_estimate_move_it_once() -> None:
    """Their looks all say the same: fifty over at their first look cut once, not
    fifty times; a few not over raise it to the highest bound they saw."""
    pacing = Pacing({"clone": 2.0})
    over = [pacing.schedule("clone", "t", PollTiming()) for _ in range(50)]
    for schedule in over:
        pacing.learn("clone", "t", schedule, 2.0)
    assert pacing.expected_s("clone", "t") == pytest.approx(2.0 * 0.9975)
    late = [pacing.schedule("clone", "t", PollTiming()) for _ in range(50)]
    for i, schedule in enumerate(late):
        if i in (10, 20):
            schedule.saw_running(schedule.next_at())
            pacing.learn("clone", "t", schedule, schedule.next_at() + 0.01 * i)
        else:
            pacing.learn("clone", "t", schedule, schedule.next_at())
    assert pacing.expected_s("clone", "t") == pytest.approx(2.0 * 0.9975 * 1.01 + 0.2)


def test_a_look_for_another_wait_does_not_move_this_ones_schedule() -> None:
    """Fifty waits share one task list: looks before a wait's own time leave it be."""
    schedule = Schedule(1.0, PollTiming())
    for age in (0.2, 0.5, 0.9):
        schedule.saw_running(age)
    assert (schedule.next_at(), schedule.looks) == (1.0, 0)
    schedule.saw_running(1.0)
    assert schedule.looks == 1 and schedule.next_at() == 1.01


async def test_a_fresh_process_starts_from_the_durations_the_history_recorded(
    fake: FakePVE, tmp_path: Path
) -> None:
    """`deploybot deploy` is a new process each time: what it knows of the durations
    comes from the store (one database for both deploys here), not from memory."""
    first = await deploy(fake, tmp_path, Pacing(), "web01 127.0.10.54")
    second = await deploy(fake, tmp_path, Pacing(), "web02 127.0.10.55")  # a new process
    routes = Counter(f"{r.method} {r.template}" for r in second)
    assert len(second) <= FIRST_ASK_GOAL, routes
    assert polls(second) < polls(first), (polls(first), polls(second))
    store = await Store.open(pve_settings(tmp_path, fake).database)
    try:
        recorded = await store.jobs.step_durations("pve", PACED_STEPS, 100)
    finally:
        await store.close()
    assert {step for step, *_rest in recorded} == {"clone", "identity", "power_on", "address"}
    assert {(template, storage) for _step, template, storage, _s in recorded} == {
        ("ubuntu-24.04", None)
    }
    assert recorded[0][0] == "address"  # newest first


async def test_a_request_reads_the_config_of_the_template_it_names_only(
    fake: FakePVE, tmp_path: Path
) -> None:
    sent = await deploy(fake, tmp_path, Pacing(), "web01 127.0.10.56 template=debian-12")
    templates = {vmid for vmid, vm in fake.cluster.vms.items() if vm.template}
    read = {
        int(r.path_params["vmid"])
        for r in sent
        if r.method == "GET" and r.template == "/nodes/{node}/qemu/{vmid}/config"
    }
    assert read & templates == {9001}  # debian-12; not the five others


async def test_a_requests_lookups_share_one_vm_listing_until_this_process_changes_one(
    fake: FakePVE, tmp_path: Path
) -> None:
    """The template lookup and the address check of one request list the VMs once; the
    name check before the clone asks again; a clone by this process makes a kept
    listing stale (the new VM must be in the next address check)."""
    backend = create(Config.model_validate(config_data(fake)), environ(fake), pacing=Pacing())

    def listings() -> int:
        return sum(1 for r in fake.requests if r.template == "/cluster/resources")

    try:
        before = listings()
        await backend.inventory.template("ubuntu-24.04")
        await backend.addresses_in_use("someone-else")
        assert listings() == before + 1
        assert await backend.find_by_name("web01") == []
        assert listings() == before + 2
        kept = await backend.inventory.vms(LISTING_REUSE_S)
        assert listings() == before + 2
        spec = CloneSpec("jlist01", "web-list", "ubuntu-24.04")
        ref = await backend.prepare_clone(spec)
        await backend.clone(spec, ref)
        after = await backend.inventory.vms(LISTING_REUSE_S)
        assert listings() == before + 3
        assert {str(i["vmid"]) for i in after} - {str(i["vmid"]) for i in kept} == {ref.vm_id}
    finally:
        await backend.close()


def test_recorded_steps_seed_the_operations_they_wait_for(fake: FakePVE) -> None:
    backend = create(Config.model_validate(config_data(fake)), environ(fake), pacing=Pacing())
    backend.remember_steps(
        [
            StepTime("address", "t", None, 3.2),
            StepTime("clone", "t", "fast", 2.5),
            StepTime("clone", "t", None, 2.1),
            StepTime("clone", "t", None, 1.9),  # the quickest recent one: the least overhead
            StepTime("check_free", "t", None, 0.3),  # not a wait of ours
        ]
    )
    pacing = backend.pacing
    assert pacing.expected_s("boot", "t") == 3.2
    assert pacing.expected_s("clone", clone_key("t", None)) == 1.9
    assert pacing.expected_s("clone", clone_key("t", "fast")) == 2.5
    assert pacing.expected_s("config", "t") is None
    own = pacing.schedule("clone", clone_key("t", None), PollTiming())
    own.saw_running(1.9)
    pacing.learn("clone", clone_key("t", None), own, 2.0)
    assert pacing.expected_s("clone", clone_key("t", None)) == 2.0  # its own wait outranks


async def test_a_rollback_paces_its_stop_and_destroy_waits(fake: FakePVE) -> None:
    backend = create(Config.model_validate(config_data(fake)), environ(fake), pacing=Pacing())
    try:
        for job in ("jpace01", "jpace02"):
            spec = CloneSpec(job, f"web-{job}", "ubuntu-24.04")
            ref = await backend.prepare_clone(spec)
            await backend.clone(spec, ref)
            await backend.power_on(ref)
            await backend.power_off(ref)
            await backend.destroy(ref)
    finally:
        await backend.close()
    assert backend.pacing.expected_s("stop", "ubuntu-24.04") is not None
    assert backend.pacing.expected_s("destroy", "ubuntu-24.04") is not None


async def test_a_damaged_job_row_teaches_nothing_and_stops_nothing(
    fake: FakePVE, tmp_path: Path
) -> None:
    """Durations are an economy: a request that is not JSON (another tool wrote it)
    is left out of them, and the next process still starts and deploys."""
    await deploy(fake, tmp_path, Pacing(), "web01 127.0.10.57")
    database = pve_settings(tmp_path, fake).database
    with sqlite3.connect(database) as db:
        db.execute("UPDATE jobs SET request = '{\"name\": '")
    store = await Store.open(database)
    try:
        assert await store.jobs.step_durations("pve", PACED_STEPS, 100) == []
    finally:
        await store.close()
    await deploy(fake, tmp_path, Pacing(), "web02 127.0.10.58")


def test_a_tasks_end_is_its_start_plus_its_usual_time_unless_seen_over_sooner() -> None:
    """The boot clock starts there: a look that found the start task over late (fifty
    deploys share one poll of the task list) must not make the agent's first ask late."""
    pace = Pace(Pacing({"start": 1.0}), "start", "t")
    assert pace.ended_at() is None  # nothing known yet
    pace.began_at, pace.seen_over_at = 100.0, 101.08  # seen 80 ms after its usual end
    assert pace.ended_at() == 101.0
    pace.seen_over_at = 100.9  # over sooner than usual: the look says so
    assert pace.ended_at() == 100.9
    unknown = Pace(Pacing(), "start", "t", seen_over_at=5.0, began_at=4.0)
    assert unknown.ended_at() == 5.0  # no usual time: the look is all there is


def test_one_slow_task_moves_the_estimate_halfway_and_a_lasting_change_all_the_way() -> None:
    """A clone that took five times as long (a backup held the storage) must not make
    the next deploys wait that long; clones that stay slower are followed in two waits."""
    pacing = Pacing({"clone": 2.0})
    assert learnt(pacing, 10.0, "clone") > 0
    after_outlier = pacing.expected_s("clone", "t")
    assert after_outlier is not None and 5.9 < after_outlier < 6.5  # halfway, not 10
    waits = 0
    while (pacing.expected_s("clone", "t") or 0) > 2.1 and waits < 20:
        learnt(pacing, 2.0, "clone")
        waits += 1
    assert waits < 20  # back near 2 s in a few waits: the cut doubles up to 25%
    shifted = Pacing({"clone": 2.0})
    learnt(shifted, 4.0, "clone")
    learnt(shifted, 4.0, "clone")
    estimate = shifted.expected_s("clone", "t")
    assert estimate is not None and 4.0 <= estimate < 4.6  # its last look: a step over
