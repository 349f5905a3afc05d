"""Several real `deploybot` processes on one database and one hypervisor, killed at random.

The hypervisor is the fake Proxmox server in its own process (it outlives every bot),
and Slack is the fake Web API (in a thread of this test). Each round starts two
`deploybot shell` processes at the same moment, a one-shot `deploybot deploy` and a
`deploybot serve --http` that gets a signed `/deploy`, each asking for its own VM; one
of the four (each kind in turn) is SIGKILLed when its job reaches a randomly chosen
step, the others finish (the
server is stopped once its thread has ended), and a fresh shell comes back to pick up
what the dead one left; if the server was the one killed, a fresh server delivers
what its thread still had to say. Then, after every round:

* every job is final, and the server's VMs are exactly the succeeded jobs' VMs;
* every job was cloned at most once (no two processes ran it);
* no job has a step event after its rollback began (a second process rolling back a
  job that its owner was still building would leave exactly that trace);
* every job that a live process ran was finished by that process: only the killed
  process's job may end "interrupted by a restart of the bot";
* every Slack thread the fake saw ends with its job's final message.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from tests.support.crash import SEED, STEP_LINES, restart
from tests.support.fakepve.process import FakePVE, check_against, config_env, fake_pve
from tests.support.replicas import (
    OWNERSHIP,
    SLACK,
    SLACK_STEPS,
    SlackThread,
    _reap,
    ask_in_slack,
    mentions,
    serve,
    slack,
    spawn,
)
from tests.support.slack.bot import CHANNEL
from tests.support.slack.fake_api import FakeSlack

__all__ = ["_reap", "fake_pve", "slack"]  # fixtures, used by name


def one_round(
    tmp: Path, env: dict[str, str], number: int, rng: random.Random, slack: SlackThread
) -> tuple[str, str]:
    """Four processes, one killed; returns the killed one's command and VM name."""
    names = [f"m{number:02d}{suffix}" for suffix in "abcd"]
    addresses = [f"127.0.10.{10 + number * 4 + i}" for i in range(4)]
    server = serve(env, tmp, names[3])
    shells = [spawn(["shell", "--user", "alice"], env, tmp, n) for n in names[:2]]
    for shell, name, address in zip(shells, names, addresses, strict=False):
        assert shell.popen.stdin is not None
        shell.popen.stdin.write(f"/deploy {name} {address}\n")
        shell.popen.stdin.flush()
    one_shot = spawn(["deploy", names[2], addresses[2], "--backend", "pve"], env, tmp, names[2])
    ask_in_slack(server, slack, f"{names[3]} {addresses[3]}")
    procs = [*shells, one_shot, server]
    victim = [server, one_shot, *shells][number % 4]  # every kind is killed at least once
    if victim is server:
        label = rng.choice(SLACK_STEPS)
        slack.run(slack.fake.wait_for(mentions(slack.fake, server.name, label), within=90))
    else:
        victim.watch(rng.choice(STEP_LINES))
        assert victim.hit.wait(90), f"{victim.name} never reached {victim.trigger!r}"
    os.kill(victim.popen.pid, signal.SIGKILL)
    for proc in procs:
        if proc is not victim and proc.popen.stdin is not None:
            proc.popen.stdin.close()  # end of input: the shell drains and leaves
    for proc in [*shells, one_shot]:
        assert proc.popen.wait(timeout=120) in (0, 1, -signal.SIGKILL), "".join(proc.lines)
    restart(tmp, env)  # a fresh runner picks up what the dead one held
    if victim is server:
        server = serve(env, tmp, names[3])  # it delivers what the dead one had to say
    wait_for_threads(tmp, slack)
    server.popen.send_signal(signal.SIGTERM)
    assert server.popen.wait(timeout=60) == 0, "".join(server.lines)
    for proc in procs:
        assert "Traceback" not in "".join(proc.lines)
    return str(victim.popen.args[3]), victim.name  # type: ignore[index]


def final_states(tmp: Path) -> dict[str, str]:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        return dict(db.execute("SELECT name, state FROM jobs").fetchall())
    finally:
        db.close()


def unended_threads(tmp: Path, fake: FakeSlack) -> list[str]:
    """The Slack threads that do not (yet) end with their job's final message."""
    states = final_states(tmp)
    missing = []
    for call in fake.called("chat.postMessage", channel=CHANNEL):
        if "thread_ts" in call.args:
            continue
        name = call.text.split()[0]
        ts = str(call.answer["ts"])  # a parent posted once its job ended carries the end
        text = "\n".join([fake.messages[(CHANNEL, ts)]["text"], *fake.thread(CHANNEL, ts)])
        state = states.get(name)
        ended = {"succeeded": "ready in", "failed": "failed at"}.get(state or "", "\0")
        if ended not in text:
            missing.append(f"{name} ({state})")
    return missing


def wait_for_threads(tmp: Path, slack: SlackThread) -> None:
    for _wait in range(120):  # each a second at most without a call to Slack
        if not unended_threads(tmp, slack.fake):
            return
        slack.run(slack.fake.next_call(within=1.0))
    pytest.fail(f"threads not ended: {unended_threads(tmp, slack.fake)}")


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
    tmp_path: Path, fake_pve: FakePVE, slack: SlackThread, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(SEED)
    env = config_env(tmp_path, fake_pve)
    config = Path(env["DEPLOYBOT_CONFIG"])
    config.write_text(config.read_text() + OWNERSHIP + SLACK.format(url=slack.fake.url))
    killed: set[str] = set()
    kinds: Counter[str] = Counter()
    rounds = 6
    for number in range(rounds):  # the first round also races two migrations
        kind, name = one_round(tmp_path, env, number, rng, slack)
        killed.add(name)
        kinds[kind] += 1
        check_against(tmp_path, fake_pve)
        check_ownership(tmp_path, killed)
        assert not unended_threads(tmp_path, slack.fake)
    threads = len(
        [
            c
            for c in slack.fake.called("chat.postMessage", channel=CHANNEL)
            if "thread_ts" not in c.args
        ]
    )
    with capsys.disabled():
        print(
            f"\nmulti-process harness: {rounds} rounds, 4 processes each (serve among them), "
            f"kills: {dict(sorted(kinds.items()))}, {threads} Slack threads ended"
        )
