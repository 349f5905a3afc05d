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

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backends.base import job_marks
from backends.sim.vm import DEFAULT_TEMPLATES

SEED = int(os.environ.get("DEPLOYBOT_CRASH_SEED", "20261130"))
STEP_LINES = [
    f"{mark} {label}"
    for label in (
        "check name and address",
        "copy template",
        "set identity",
        "grow disk",
        "power on",
        "wait for address",
        "check SSH",
    )
    for mark in ("…", "✓")
][:-1]  # the last "✓ check SSH" is followed only by the final write
ROLLBACK_LINES = ["something failed; removing", "Rolled back"]
FAULTS: dict[str | None, int] = {  # op that fails -> index of its step in STEP_LINES
    None: len(STEP_LINES),
    "grow_disk": 6,
    "power_on": 8,
    "wait_for_address": 10,
    "probe_ssh": 12,
}
CONFIG = """
database = "{tmp}/jobs.db"
log_file = "{tmp}/bot.log"

[[backends]]
kind = "sim"
name = "sim"
time_scale = 0.01
state_file = "{tmp}/sim.json"
{faults}

[defaults]
ssh_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"]

[[subnets]]
cidr = "10.20.0.0/16"
gateway = "10.20.0.1"

[recovery]
interrupted = "{recovery}"

[timeouts]
retry_initial_s = 0.01
retry_max_s = 0.05
power_off_s = 20
destroy_s = 20
"""


@dataclass(frozen=True)
class KillPoint:
    fault: str | None
    trigger: str
    # The call at which the hypervisor goes down (the simulator's `outage` fault); the
    # kill comes once the bot says it waits, and the hypervisor is back for the restart.
    outage: str | None = None
    resume: bool = False  # restart with recovery.interrupted = "resume"


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


def write_config(
    tmp: Path, fault: str | None, resume: bool = False, more: Sequence[tuple[str, str]] = ()
) -> dict[str, str]:
    """The bot's config: `fault` (an op) fails with an error; `more`: (op, kind) faults."""
    planned = [(fault, "error")] if fault else []
    listed = ", ".join(f'{{op = "{op}", kind = "{kind}"}}' for op, kind in [*planned, *more])
    faults = f"faults = [{listed}]" if listed else ""
    path = tmp / "deploybot.toml"
    recovery = "resume" if resume else "roll_back"
    path.write_text(CONFIG.format(tmp=tmp, faults=faults, recovery=recovery))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env["DEPLOYBOT_CONFIG"] = str(path)
    return env


def start_shell(env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "handlers.entry", "shell", "--user", "alice"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
    )


def run_round(
    tmp: Path,
    env: dict[str, str],
    point: KillPoint,
    name: str,
    address: str,
    reuse: str | None = None,
) -> bool:
    """One life of the bot, ended by SIGKILL at the kill point; True if it was killed."""
    proc = start_shell(env, tmp)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    killed = False
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"/deploy {name} {address} disk=+1G\n")
        if reuse:
            proc.stdin.write(f"/deploy {reuse} {address.rsplit('.', 1)[0]}.250\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if f"[{name} " in line and point.trigger in line:
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
                break
            if f"└ {name} " in line:  # the job ended before the kill point came
                break
        if not killed:
            proc.stdin.close()
        proc.wait()
    finally:
        watchdog.cancel()
        (tmp / "sim.down").unlink(missing_ok=True)  # the hypervisor is back for the restart
    return killed


def restart(tmp: Path, env: dict[str, str]) -> str:
    """A new life with nothing to do: it recovers, drains and leaves at end of input."""
    result = subprocess.run(
        [sys.executable, "-m", "handlers.entry", "shell", "--user", "alice"],
        input="",
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return result.stdout


def job_state(tmp: Path, name: str) -> str:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        return str(db.execute("SELECT state FROM jobs WHERE name = ?", [name]).fetchone()[0])
    finally:
        db.close()


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


def settled_jobs(tmp: Path) -> dict[str, tuple[str, str, str, str]]:
    """Every job as (state, name, address, vm_id), after checking the store is sound and
    no job is left unfinished."""
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        jobs = {
            row[0]: (row[1], row[2], row[3], row[4])
            for row in db.execute("SELECT id, state, name, address, vm_id FROM jobs")
        }
    finally:
        db.close()
    states = Counter(state for state, *_ in jobs.values())
    unfinished = {s for s in states if s not in ("succeeded", "failed", "cancelled")}
    assert not unfinished, f"jobs left in {unfinished}: {states}"
    return jobs


def check_invariants(tmp: Path) -> None:
    jobs = settled_jobs(tmp)
    state = tmp / "sim.json"  # written at the simulator's first change
    inventory = json.loads(state.read_text())["vms"] if state.exists() else []
    names = Counter(vm["name"] for vm in inventory)
    assert all(n == 1 for n in names.values()), f"a name is used twice: {names}"
    for vm in inventory:
        owners = [m.job_id for m in job_marks(set(vm["tags"]))]
        assert any(jobs.get(o, ("",))[0] == "succeeded" for o in owners), (
            f"VM {vm['vm_id']} ({vm['name']}) belongs to no succeeded job: "
            f"{[(o, jobs.get(o)) for o in owners]}"
        )
    live = {vm["vm_id"] for vm in inventory}
    succeeded = [
        (name, addr, vm_id) for state, name, addr, vm_id in jobs.values() if state == "succeeded"
    ]
    assert all(vm_id in live for _n, _a, vm_id in succeeded), "a succeeded job lost its VM"
    addresses = Counter(addr for _n, addr, _v in succeeded)
    assert all(n == 1 for n in addresses.values()), f"an address is used twice: {addresses}"
    grown_once(tmp, inventory)


def grown_once(tmp: Path, inventory: list[dict[str, Any]]) -> None:
    template_gib = {t.name: t.disk_gib for t in DEFAULT_TEMPLATES}
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        rows = db.execute("SELECT vm_id, request FROM jobs WHERE state = 'succeeded'")
        asked = {vm_id: json.loads(request)["disk_grow_gib"] for vm_id, request in rows}
    finally:
        db.close()
    for vm in inventory:
        want = template_gib[vm["template"]] + asked[vm["vm_id"]]
        assert vm["disk_gib"] == want, f"VM {vm['vm_id']} has {vm['disk_gib']} GiB, not {want}"


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
