"""A template build survives a SIGKILL: the real `deploybot template build`, killed while
its smoke deploy runs, leaves a build and a smoke job owned by a dead process; the next
process that starts (`deploybot shell`) rolls both back: the smoke VM and the template
are gone, the build is `failed` saying it was interrupted. Then a new build of the same
name publishes version 2.

The hypervisor is the simulator with a state file, which outlives the bot as a real one
does (its built templates included).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.crash import restart, write_config


def build_row(tmp: Path) -> tuple[str, str, str | None, str | None, str | None]:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        row = db.execute(
            "SELECT id, state, vm_id, smoke_job, error FROM builds ORDER BY created_at"
        ).fetchone()
    finally:
        db.close()
    return row  # type: ignore[no-any-return]


def sim_state(tmp: Path) -> dict[str, list[dict[str, object]]]:
    return json.loads((tmp / "sim.json").read_text())  # type: ignore[no-any-return]


def build_cli(env: dict[str, str], tmp: Path) -> subprocess.Popen[str]:
    argv = ["template", "build", "debian-12", "--backend", "sim", "--name", "golden"]
    return subprocess.Popen(
        [sys.executable, "-m", "handlers.entry", *argv, "--user", "alice"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp,
        env=env,
    )


def test_a_build_killed_during_its_smoke_deploy_is_rolled_back_by_the_next_process(
    tmp_path: Path,
) -> None:
    # The smoke VM's address never comes in the first life: however late the kill lands
    # after the start's line, the build is still in its smoke deploy.
    proc = build_cli(write_config(tmp_path, None, more=[("wait_for_address", "hang")]), tmp_path)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "[smoke-" in line and "power on" in line and "✓" in line:
                os.kill(proc.pid, signal.SIGKILL)  # the smoke VM exists and runs
                break
        proc.wait()
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    _, state, vm_id, smoke_job, _ = build_row(tmp_path)
    assert state == "running" and vm_id is not None and smoke_job is not None
    state_before = sim_state(tmp_path)
    assert [b["vm_id"] for b in state_before["built"]] == [vm_id]
    assert any(str(vm["name"]).startswith("smoke-") for vm in state_before["vms"])

    env = write_config(tmp_path, None)
    after = restart(tmp_path, env)
    _, state, _, _, error = build_row(tmp_path)
    assert state == "failed" and "interrupted" in (error or ""), after
    state_after = sim_state(tmp_path)
    assert state_after["built"] == [] and state_after["vms"] == []

    again = build_cli(env, tmp_path)
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0, out
    assert "Published: golden is version 2 (golden-v2)" in out
