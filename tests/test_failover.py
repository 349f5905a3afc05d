"""Replicas on PostgreSQL: three `deploybot serve --http` behind the fake Slack, one
database, the fake Proxmox server as the hypervisor; thirty deploys asked of them in
turn, and two of the three SIGKILLed, one after the other, while each runs a deploy.

Commands acknowledged by a replica that dies before making them into jobs are carried
out by another (bot/chat/inbox.py). Then: thirty jobs, every one final and run once (one
clone at most, no step after its rollback began), only the killed replicas' deploys
failed, the server's VMs are exactly the succeeded jobs' VMs, and every Slack thread
ends with its outcome. Printed: the time from each kill to the moment no job is held by
the dead replica any more (its jobs taken over by a live one). The replicas share one
machine here, so a live one sees the dead one's process gone and takes over at once;
on separate machines the takeover waits for the lease (`[ownership] lease_s`).
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest

from tests.support.fakepve.process import FakePVE, config_env, fake_pve
from tests.support.postgres import PASSWORD, PASSWORD_ENV
from tests.support.replicas import (
    OWNERSHIP,
    SLACK,
    SlackThread,
    _reap,
    ask_in_slack,
    check_vms,
    parents,
    rows,
    serve,
    slack,
    until,
    until_or_none,
)
from tests.support.slack.bot import CHANNEL

__all__ = ["_reap", "fake_pve", "slack"]  # fixtures, used by name
DEPLOYS = 30
FINAL = ("succeeded", "failed")


def running_on(url: str, pid: int) -> tuple[str, str] | None:
    """(runner id, job name) of a deploy that the replica with this pid is running."""
    found = rows(
        url,
        "SELECT r.id, j.name FROM jobs j JOIN runners r ON r.id = j.owner "
        "WHERE r.pid = %s AND j.state = 'running' LIMIT 1",
        (pid,),
    )
    return (str(found[0][0]), str(found[0][1])) if found else None


def released(url: str, runner: str) -> bool:
    """No deploy is held by this (dead) runner any more."""
    found = rows(
        url,
        "SELECT count(*) FROM jobs WHERE owner = %s AND state IN ('running', 'rolling_back')",
        (runner,),
    )
    return int(found[0][0]) == 0


def unended(url: str, slack: SlackThread) -> list[str]:
    """Jobs not final, and jobs whose thread does not end with the outcome. A replica
    killed between Slack's answer to a thread's first message and recording that
    thread leaves the message behind: the next deliverer cannot know of it and starts
    the thread again, so it is the newest thread of a job that must end."""
    states = {str(n): str(s) for n, s in rows(url, "SELECT name, state FROM jobs")}
    missing = [f"{name} ({state})" for name, state in states.items() if state not in FINAL]
    for name, threads in parents(slack).items():
        ts = threads[-1]  # a parent posted once its job ended carries the end itself
        text = "\n".join(
            [slack.fake.messages[(CHANNEL, ts)]["text"], *slack.fake.thread(CHANNEL, ts)]
        )
        ended = {"succeeded": "ready in", "failed": "failed at"}.get(states.get(name, ""), "\0")
        if ended not in text:
            missing.append(f"thread of {name}")
    return missing


def check_runs(url: str) -> dict[str, tuple[str, str]]:
    """Each job ran once; returns name -> (state, vm_id)."""
    jobs = rows(url, "SELECT id, name, state, vm_id FROM jobs")
    for job_id, name, state, _vm in jobs:
        events = rows(
            url, "SELECT step, phase FROM job_events WHERE job_id = %s ORDER BY id", (job_id,)
        )
        clones = [e for e in events if tuple(e) == ("clone", "started")]
        assert len(clones) <= 1, f"{name} was cloned {len(clones)} times"
        rollback = next((i for i, e in enumerate(events) if e[0] == "rollback"), None)
        if rollback is not None:
            after = [e for e in events[rollback:] if e[1] in ("started", "finished")]
            assert not after, f"{name}: steps ran after its rollback began: {after}"
        assert state in FINAL, (name, state)
    return {str(name): (str(state), str(vm or "")) for _id, name, state, vm in jobs}


def test_failover_replicas_on_postgres_survive_two_kills(
    tmp_path: Path,
    fake_pve: FakePVE,
    slack: SlackThread,
    pg_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {**config_env(tmp_path, fake_pve), PASSWORD_ENV: PASSWORD}
    config = Path(env["DEPLOYBOT_CONFIG"])
    text = config.read_text().replace(f'"{tmp_path}/jobs.db"', f'"{pg_url}"')
    config.write_text(text + OWNERSHIP + SLACK.format(url=slack.fake.url))
    replicas = [serve(env, tmp_path, f"replica{i}") for i in range(3)]
    live = list(replicas)
    asked = 0
    takeovers: list[float] = []
    for victim in replicas[:2]:
        for _ in range(DEPLOYS // 2):  # half now, half after the first kill
            ask_in_slack(live[asked % len(live)], slack, f"f{asked:02d} 127.0.10.{100 + asked}")
            asked += 1
        runner, name = until(partial(running_on, pg_url, victim.popen.pid), slack, "a deploy")
        os.kill(victim.popen.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.popen.wait(timeout=30)
        live.remove(victim)
        until(partial(released, pg_url, runner), slack, f"{name} taken over")
        takeovers.append(time.monotonic() - killed_at)
    ended = until_or_none(lambda: not unended(pg_url, slack), slack)
    assert ended, f"not ended: {unended(pg_url, slack)}; replicas said: " + "".join(
        line for r in replicas for line in r.lines if "ERROR" in line or "WARNING" in line
    )
    jobs = check_runs(pg_url)
    restarted = sorted(name for name, threads in parents(slack).items() if len(threads) > 1)
    assert len(restarted) <= len(takeovers), restarted  # at most one per kill
    errors = {str(e) for (e,) in rows(pg_url, "SELECT error FROM jobs WHERE state = 'failed'")}
    assert errors <= {"interrupted by a restart of the bot"}, errors  # only the killed ones
    # Commands acknowledged but not yet made into jobs when their replica died were
    # carried out by another (bot/chat/inbox.py): thirty asked, thirty jobs.
    assert len(jobs) == DEPLOYS, sorted({f"f{i:02d}" for i in range(DEPLOYS)} - set(jobs))
    undone = rows(pg_url, "SELECT key FROM inbox WHERE done_at IS NULL")
    assert not undone, undone
    check_vms(jobs, fake_pve)
    survivor = live[0]
    survivor.popen.send_signal(signal.SIGTERM)
    assert survivor.popen.wait(timeout=60) == 0, "".join(survivor.lines)
    for replica in replicas:
        assert "Traceback" not in "".join(replica.lines)
    states = sorted(state for state, _vm in jobs.values())
    with capsys.disabled():
        print(
            f"\nfailover: 3 replicas on PostgreSQL, {DEPLOYS} deploys, 2 killed mid-deploy; "
            f"kill to takeover {', '.join(f'{s:.1f} s' for s in takeovers)}; "
            f"outcomes {dict((s, states.count(s)) for s in set(states))}; "
            f"threads started again after a kill: {restarted or 'none'}"
        )
