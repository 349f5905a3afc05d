"""SIGTERM under load: `deploybot serve --http` on PostgreSQL hands its work back and exits
within about twice `[ownership] stop_s`.

One replica gets forty `/deploy` commands (four run at once on the simulator, each
~30 s of hypervisor time; the rest are queued; forty answers wait for Slack's pace of
100 a minute) and is sent SIGTERM while it runs deploys. It used to wait for every
answer to be sent and every running deploy to end (30 s of grace, then the rollback),
so a rolling restart stalled for a minute or more. Now: it exits in seconds, having
handed queued jobs and unanswered commands back and said that it stopped; a second
replica then finishes all forty, each command made into exactly one job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.deployer import TEST_KEY
from tests.support.postgres import PASSWORD, PASSWORD_ENV
from tests.support.replicas import SlackThread, _reap, ask_in_slack, rows, serve, slack, until

__all__ = ["_reap", "slack"]  # fixtures, used by name
COMMANDS = 40
STOP_S = 2.0
CONFIG = """
database = "{database}"
log_file = "{tmp}/bot-{name}.log"
[[backends]]
kind = "sim"
name = "sim"
time_scale = {scale}
[[subnets]]
cidr = "10.0.0.0/24"
gateway = "10.0.0.1"
[defaults]
backend = "sim"
ssh_keys = ["{key}"]
[limits]
max_running = 4
max_running_per_backend = 4
[ownership]
lease_s = 3
tick_s = 0.5
stop_s = {stop_s}
[slack]
api_base_url = "{slack}"
"""


def replica_env(tmp: Path, url: str, slack: SlackThread, name: str, scale: float) -> dict[str, str]:
    path = tmp / f"{name}.toml"
    path.write_text(
        CONFIG.format(
            database=url, tmp=tmp, name=name, scale=scale, key=TEST_KEY, stop_s=STOP_S,
            slack=slack.fake.url,
        )
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    return {**env, "DEPLOYBOT_CONFIG": str(path), PASSWORD_ENV: PASSWORD}


def count(url: str, sql: str, params: tuple[Any, ...] = ()) -> int:
    return int(rows(url, sql, params)[0][0])


def test_sigterm_hands_work_back_and_exits_in_seconds(
    tmp_path: Path, slack: SlackThread, pg_url: str
) -> None:
    # Thirty seconds of hypervisor time per deploy: running deploys outlast the old grace.
    first = serve(replica_env(tmp_path, pg_url, slack, "first", 4.0), tmp_path, "first")
    for n in range(COMMANDS):
        ask_in_slack(first, slack, f"s{n:02d} 10.0.0.{10 + n}")
    until(
        lambda: count(pg_url, "SELECT count(*) FROM jobs WHERE state = 'running'") > 0,
        slack,
        "a deploy running on the first replica",
    )
    runner = str(rows(pg_url, "SELECT id FROM runners WHERE pid = %s", (first.popen.pid,))[0][0])

    began = time.monotonic()
    first.popen.send_signal(signal.SIGTERM)
    try:
        code = first.popen.wait(timeout=2 * STOP_S + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {2 * STOP_S + 10:g} s after SIGTERM:\n{''.join(first.lines)}")
    print(f"\nexited {time.monotonic() - began:.1f} s after SIGTERM (stop_s {STOP_S:g})")
    assert code == 0, "".join(first.lines)

    # Handed back: it says it stopped; no queued job and no unanswered command is its.
    assert rows(pg_url, "SELECT stopped_at FROM runners WHERE id = %s", (runner,))[0][0]
    held = "SELECT count(*) FROM jobs WHERE state = 'queued' AND owner = %s"
    assert count(pg_url, held, (runner,)) == 0
    kept = "SELECT count(*) FROM inbox WHERE holder = %s AND done_at IS NULL AND until <> ''"
    assert count(pg_url, kept, (runner,)) == 0

    # Another replica (a fast hypervisor now) finishes everything: every command made
    # into one job, every job final, every command answered.
    serve(replica_env(tmp_path, pg_url, slack, "second", 0.05), tmp_path, "second")
    final = "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'failed')"
    until(lambda: count(pg_url, final) == COMMANDS, slack, "all jobs final", within_s=180)
    names = rows(pg_url, "SELECT name, count(*) FROM jobs GROUP BY name")
    assert sorted(str(n) for n, _c in names) == [f"s{n:02d}" for n in range(COMMANDS)]
    assert all(int(c) == 1 for _n, c in names), names
    open_commands = "SELECT count(*) FROM inbox WHERE done_at IS NULL"
    until(lambda: count(pg_url, open_commands) == 0, slack, "every command answered")
