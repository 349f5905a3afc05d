"""The crash harness against the fake Proxmox API, running in its own process.

The hypervisor here is a separate server that goes on while the bot is killed, as a
real Proxmox node does: tasks started before the kill finish without the bot. Each
round deploys one VM, SIGKILLs `deploybot shell` at a chosen line of the thread,
restarts it, and checks: every job final, the non-template VMs on the server are
exactly the succeeded jobs' VMs, no name twice, and the store is sound.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.crash import ROLLBACK_LINES, SEED, STEP_LINES, KillPoint, restart, run_round
from tests.support.fakepve.process import FakePVE, check_against, config_env, fake_pve

__all__ = ["fake_pve"]  # the fixture, used by name


def test_kill_at_random_moments_against_the_fake_proxmox_server(
    tmp_path: Path, fake_pve: FakePVE, capsys: pytest.CaptureFixture[str]
) -> None:
    points = [KillPoint(None, line) for line in STEP_LINES]
    points += [KillPoint("start", line) for line in ROLLBACK_LINES]
    random.Random(SEED).shuffle(points)
    env = config_env(tmp_path, fake_pve)
    kills = 0
    for number, point in enumerate(points):
        if point.fault:
            fake_pve.call("POST", "/_fake/inject", {"endpoint": point.fault, "kind": "task_error"})
        kills += run_round(tmp_path, env, point, f"p{number:02d}", f"127.0.10.{number + 10}")
        restart(tmp_path, env)
        check_against(tmp_path, fake_pve)
    with capsys.disabled():
        print(f"\ncrash harness (fake Proxmox): {kills} kills at {len(points)} kill points")
    assert kills >= len(points) - 2
