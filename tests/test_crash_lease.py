"""An expired lease survives a SIGKILL: the real `deploybot shell`, killed between the
power-off at the end of a VM's lease and its destroy after the grace period, is started
again; it finishes the same step once (the VM gone, the job `destroyed`, one "powered
off" and one "destroyed" line, one audit row of each step).

Real time, short lengths: the lease is 1 s and the timer looks every 0.2 s. The first
life has an hour of grace, so the kill surely falls between the two steps; the second
is started with the grace over (`DEPLOYBOT_LEASES__GRACE=0s`, as an operator may
shorten it), so it must do the destroy, and only that.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
from pathlib import Path

from tests.support.crash import job_row, restart, sim_vms, start_shell, write_config

NAME, ADDRESS = "web01", "10.20.0.10"
LEASES = """
[leases]
default = "1s"
grace = "1h"
reminders = []
check_every_s = 0.2
"""
POWERED_OFF = "VM powered off, not destroyed"


def first_life(tmp: Path, env: dict[str, str]) -> list[str]:
    """Deploy with a 1 s lease; SIGKILL the bot once it said the VM is powered off."""
    proc = start_shell(env, tmp)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    seen: list[str] = []
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"/deploy {NAME} {ADDRESS}\n")
        proc.stdin.flush()
        for line in proc.stdout:
            seen.append(line)
            if f"[{NAME} " in line and POWERED_OFF in line:
                os.kill(proc.pid, signal.SIGKILL)  # between the power-off and the destroy
                break
        proc.wait()
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return seen


def audit_outcomes(tmp: Path, job_id: str) -> list[str]:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        rows = db.execute(
            "SELECT outcome FROM audit WHERE action IN (?, ?) ORDER BY id",
            [f"lease {job_id}", f"destroy {job_id}"],
        ).fetchall()
    finally:
        db.close()
    return [str(r[0]) for r in rows]


def test_an_expired_lease_killed_before_its_destroy_is_finished_once(tmp_path: Path) -> None:
    env = write_config(tmp_path, None)
    config = tmp_path / "deploybot.toml"
    config.write_text(config.read_text() + LEASES)
    before = first_life(tmp_path, env)
    job_id, state, vm_id = job_row(tmp_path)
    assert state == "expired_off", "".join(before)
    assert not sim_vms(tmp_path)[vm_id]["running"]  # off, not destroyed
    after = restart(tmp_path, {**env, "DEPLOYBOT_LEASES__GRACE": "0s"})
    job_id_after, state, _ = job_row(tmp_path)
    assert (job_id_after, state) == (job_id, "destroyed"), after
    assert vm_id not in sim_vms(tmp_path)
    told = "".join(before) + after
    assert told.count(POWERED_OFF) == 1, told
    assert told.count(f"VM {vm_id} is gone") == 1, told
    assert "grace period is over" in after
    assert audit_outcomes(tmp_path, job_id) == ["expired", "destroying", "destroyed"]
