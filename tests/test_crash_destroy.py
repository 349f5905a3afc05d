"""A destroy survives a SIGKILL: the real `deploybot shell`, killed between the stop
and the destroy of a VM, is started again; it takes the job over and finishes the same
destroy once (the VM gone, the job `destroyed`, one "destroyed" line).

The hypervisor is the simulator with a state file, which outlives the bot as a real one
does (a task running at the kill has finished when the bot comes back).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tests.support.crash import job_row, restart, sim_vms, start_shell, write_config

NAME, ADDRESS = "web01", "10.20.0.10"


def first_life(tmp: Path, env: dict[str, str]) -> list[str]:
    """Deploy, ask for the destroy, and SIGKILL the bot once the VM has stopped."""
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
            if f"└ {NAME} " in line and "ready" in line:
                proc.stdin.write(f"/deploy destroy {NAME}\n")
                proc.stdin.flush()
            if f"[{NAME} " in line and "✓ stop the VM" in line:
                os.kill(proc.pid, signal.SIGKILL)  # between the stop and the destroy
                break
        proc.wait()
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return seen


def test_a_destroy_killed_between_stop_and_destroy_is_finished_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The destroy's answer never comes in the first life (the hypervisor does the work):
    # however late the kill lands after the stop's line, the job is still destroying.
    before = first_life(tmp_path, write_config(tmp_path, None, more=[("destroy", "hang")]))
    job_id, state, vm_id = job_row(tmp_path)
    assert state == "destroying", "".join(before)
    left = sim_vms(tmp_path).get(vm_id)
    # The kill came after the stop; the destroy had not begun, or its task was cut off
    # (the simulator then finishes it, as a hypervisor would).
    assert left is None or not left["running"]
    after = restart(tmp_path, write_config(tmp_path, None))
    job_id_after, state, _ = job_row(tmp_path)
    assert (job_id_after, state) == (job_id, "destroyed"), after
    assert vm_id not in sim_vms(tmp_path)
    told = "".join(before) + after
    assert told.count(f"destroyed (asked by alice): VM {vm_id} is gone") == 1, told
    with capsys.disabled():
        print(f"\ncrash destroy: VM {vm_id} {'still there' if left else 'gone'} at the kill")
