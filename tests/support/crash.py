"""deploybot's shell as a real process on the simulator, killed with SIGKILL and restarted:
the configuration, the shell, and what the database says afterwards."""

from __future__ import annotations

import json
import os
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

from backends.sim.vm import DEFAULT_TEMPLATES
from backends.tags import job_marks

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

# The VM the destroy and lease crash tests deploy (tests/test_crash_destroy.py, _lease.py).
NAME = "web01"
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


def job_row(tmp: Path) -> tuple[str, str, str]:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        row = db.execute("SELECT id, state, vm_id FROM jobs WHERE name = ?", [NAME]).fetchone()
    finally:
        db.close()
    return str(row[0]), str(row[1]), str(row[2])


def sim_vms(tmp: Path) -> dict[str, dict[str, object]]:
    state = json.loads((tmp / "sim.json").read_text())
    return {str(vm["vm_id"]): vm for vm in state["vms"]}
