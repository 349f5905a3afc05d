"""Crash harness: SIGKILL the real `deploybot shell` at many points, restart it, check.

The hypervisor is the simulator with a state file, so it outlives the bot as a real
one does (tasks running at the kill have finished when the bot comes back). Each round
asks for one new VM and reuses a name from an earlier round, kills the process when a
chosen line of the thread appears, restarts it (which recovers and drains), and then
checks what must always hold:

* every job is in a final state (none stuck running, rolling back or queued);
* every VM on the hypervisor belongs to a succeeded job, and every succeeded job's
  VM is still there;
* no VM name and no address is used twice;
* every VM's disk grew by what its job asked, once (a growth asked again after a
  restart finds its size reached);
* the store passes PRAGMA integrity_check.

The kill points are drawn from a seeded RNG (DEPLOYBOT_CRASH_SEED) so a failure can be
replayed; the count of kills and distinct kill points is printed.
"""

from __future__ import annotations

import random
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from tests.support.crash import (
    ROLLBACK_LINES,
    SEED,
    STEP_LINES,
    KillPoint,
    check_invariants,
    job_state,
    restart,
    run_round,
    write_config,
)

FAULTS: dict[str | None, int] = {  # op that fails -> index of its step in STEP_LINES
    None: len(STEP_LINES),
    "grow_disk": 6,
    "power_on": 8,
    "wait_for_address": 10,
    "probe_ssh": 12,
}


def kill_points() -> list[KillPoint]:
    points = []
    for fault, fails_at in FAULTS.items():
        for trigger in STEP_LINES[: fails_at + 1]:
            points.append(KillPoint(fault, trigger))
        if fault is not None:
            points.extend(KillPoint(fault, line) for line in ROLLBACK_LINES)
    return points


# Outages: the hypervisor stops answering in the middle of a deploy or of a rollback;
# the bot must wait (and say so) rather than fail, and survive being killed meanwhile.
# The simulator goes down at a chosen call, so the outage meets the bot there whenever
# the test process gets to read the thread.
WAITING = "waiting for sim (unreachable since"
OUTAGES = [
    KillPoint(None, WAITING, outage="clone"),  # refused before the VM exists
    KillPoint(None, WAITING, outage="apply_identity"),
    KillPoint(None, WAITING, outage="power_on"),
    KillPoint(None, WAITING, outage="wait_for_address"),
    KillPoint("power_on", WAITING, outage="destroy"),  # the VM never ran: no stop
    KillPoint("probe_ssh", WAITING, outage="power_off"),
]

# With recovery.interrupted = "resume", a job killed once its clone had finished carries
# on after the restart and succeeds (every later step is safe to repeat: a disk growth
# under way at the kill is asked again and finds its size reached); a job killed before
# that is rolled back. Which of the two a kill met is read from the store after it: the
# process runs on between printing the trigger line and receiving the signal.
RESUMES = [
    KillPoint(None, trigger, resume=True)
    for trigger in (
        "… copy template",
        "✓ copy template",
        "✓ set identity",
        "… grow disk",
        "✓ grow disk",
        "✓ power on",
        "… wait for address",
        "… check SSH",
    )
]


def recorded(tmp: Path, name: str, phase: str, step: str = "%", detail: str = "%") -> bool:
    """Whether the store holds an event of the job called `name` in `phase` (`step` and
    `detail` as LIKE patterns)."""
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        row = db.execute(
            "SELECT 1 FROM job_events WHERE phase = ? AND step LIKE ? "
            "AND coalesce(detail, '') LIKE ? "
            "AND job_id IN (SELECT id FROM jobs WHERE name = ?)",
            [phase, step, detail, name],
        ).fetchone()
        return row is not None
    finally:
        db.close()


def clone_finished(tmp: Path, name: str) -> bool:
    return recorded(tmp, name, "finished", step="clone")


def resumed(tmp: Path, name: str) -> bool:
    """Whether the job carried on after a restart (its note says so)."""
    return recorded(tmp, name, "note", detail="resuming after%")


def test_kill_at_random_moments_and_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(SEED)
    points = kill_points()
    rng.shuffle(points)
    plan = points + OUTAGES + RESUMES  # one round per kill point: about a second each
    kills: Counter[KillPoint] = Counter()
    outcomes: Counter[bool] = Counter()  # resume rounds killed after / before the clone
    carried_on = 0  # resume rounds whose job carried on (not done before the kill landed)
    waits_seen = 0
    names: list[str] = []
    for number, point in enumerate(plan):
        name = f"r{number:02d}"
        address = f"10.20.{number // 200 + 1}.{number % 200 + 10}"
        reuse = rng.choice(names) if names and rng.random() < 0.5 else None
        outage = [(point.outage, "outage")] if point.outage else []
        env = write_config(tmp_path, point.fault, more=outage)
        if run_round(tmp_path, env, point, name, address, reuse):
            kills[point] += 1
            waits_seen += point.outage is not None
        names.append(name)
        cloned = clone_finished(tmp_path, name)
        restart(tmp_path, write_config(tmp_path, None, point.resume))
        check_invariants(tmp_path)
        if point.resume:
            outcomes[cloned] += 1
            carried_on += resumed(tmp_path, name)
            assert job_state(tmp_path, name) == ("succeeded" if cloned else "failed"), point
    with capsys.disabled():
        print(
            f"\ncrash harness: {sum(kills.values())} kills at {len(kills)} distinct kill points "
            f"in {len(plan)} rounds, {waits_seen} of them during an outage, "
            f"resume rounds: {outcomes[True]} past the clone ({carried_on} carried on after "
            f"the restart), {outcomes[False]} rolled back (seed {SEED})"
        )
    assert len(kills) >= 50, f"only {len(kills)} distinct kill points were reached"
    assert waits_seen == len(OUTAGES), "every outage must make the bot wait and say so"
    assert carried_on > 0, "no job resumed after a restart"
