"""Several real `deploybot` processes on one database and one hypervisor, killed at random.

The hypervisor is the fake Proxmox server in its own process (it outlives every bot).
Each round starts two `deploybot shell` processes at the same moment and a one-shot
`deploybot deploy` next to them, each asking for its own VM; one of the three is
SIGKILLed when its job reaches a chosen line of its thread, the others finish and
leave, and a fresh shell comes back to pick up what the dead one left. Then, after
every round:

* every job is final, and the server's VMs are exactly the succeeded jobs' VMs;
* every job was cloned at most once (no two processes ran it);
* no job has a step event after its rollback began (a second process rolling back a
  job that its owner was still building would leave exactly that trace);
* every job that a live process ran was finished by that process: only the killed
  process's job may end "interrupted by a restart of the bot".
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_crash import SEED, STEP_LINES, restart
from tests.test_crash_proxmox import FakePVE, check_against, config_env, fake_pve

__all__ = ["fake_pve"]  # the fixture, used by name below
OWNERSHIP = "\n[ownership]\nlease_s = 3\ntick_s = 0.5\n"


@dataclass
class Proc:
    """A bot process whose output is read by a thread, so several run side by side."""

    name: str  # the VM it deploys
    popen: subprocess.Popen[str]
    trigger: str | None = None
    lines: list[str] = field(default_factory=list)
    hit: threading.Event = field(default_factory=threading.Event)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line)
            if self.trigger and f"[{self.name} " in line and self.trigger in line:
                self.hit.set()
        self.hit.set()  # ended before its kill point: nothing to wait for


def spawn(args: list[str], env: dict[str, str], cwd: Path, name: str) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "-m", "handlers.entry", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
    )
    proc = Proc(name, popen)
    threading.Thread(target=proc.pump, daemon=True).start()
    return proc


def one_round(tmp: Path, env: dict[str, str], number: int, rng: random.Random) -> str:
    """Three processes, one killed; returns the name of the killed one's VM."""
    names = [f"m{number:02d}{suffix}" for suffix in "abc"]
    addresses = [f"127.0.10.{10 + number * 3 + i}" for i in range(3)]
    shells = [spawn(["shell", "--user", "alice"], env, tmp, n) for n in names[:2]]
    for shell, name, address in zip(shells, names, addresses, strict=False):
        assert shell.popen.stdin is not None
        shell.popen.stdin.write(f"/deploy {name} {address}\n")
        shell.popen.stdin.flush()
    one_shot = spawn(["deploy", names[2], addresses[2], "--backend", "pve"], env, tmp, names[2])
    procs = [*shells, one_shot]
    victim = rng.choice(procs)
    victim.trigger = rng.choice(STEP_LINES)
    assert victim.hit.wait(90), f"{victim.name} never reached {victim.trigger!r}"
    os.kill(victim.popen.pid, signal.SIGKILL)
    for proc in procs:
        if proc is not victim and proc.popen.stdin is not None:
            proc.popen.stdin.close()  # end of input: the shell drains and leaves
    for proc in procs:
        assert proc.popen.wait(timeout=120) in (0, 1, -signal.SIGKILL), "".join(proc.lines)
        assert "Traceback" not in "".join(proc.lines)
    return victim.name


def check_ownership(tmp: Path, killed: set[str]) -> None:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        jobs = db.execute("SELECT id, name, state, error FROM jobs").fetchall()
        for job_id, name, state, error in jobs:
            events = db.execute(
                "SELECT step, phase FROM job_events WHERE job_id = ? ORDER BY id", [job_id]
            ).fetchall()
            clones = [e for e in events if e == ("clone", "started")]
            assert len(clones) <= 1, f"{name} was cloned {len(clones)} times"
            rollback = next((i for i, e in enumerate(events) if e[0] == "rollback"), None)
            if rollback is not None:
                after = [e for e in events[rollback:] if e[1] in ("started", "finished")]
                assert not after, f"{name}: steps ran after its rollback began: {after}"
            if error == "interrupted by a restart of the bot":
                assert name in killed, f"{name}'s live process lost its job to another"
            assert state in ("succeeded", "failed"), (name, state)
    finally:
        db.close()


def test_processes_share_one_database_and_survive_kills(
    tmp_path: Path, fake_pve: FakePVE, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(SEED)
    env = config_env(tmp_path, fake_pve)
    config = Path(env["DEPLOYBOT_CONFIG"])
    config.write_text(config.read_text() + OWNERSHIP)
    killed: set[str] = set()
    rounds = 5
    for number in range(rounds):  # the first round also races two migrations
        killed.add(one_round(tmp_path, env, number, rng))
        restart(tmp_path, env)  # a fresh runner picks up what the dead one held
        check_against(tmp_path, fake_pve)
        check_ownership(tmp_path, killed)
    with capsys.disabled():
        print(f"\nmulti-process harness: {rounds} rounds, 3 processes each, {len(killed)} kills")
