"""A real `deploybot serve --http` on SQLite whose file another process holds locked
(tests/support/workers/sqlite_holder.py: BEGIN IMMEDIATE), on the simulator, behind the fake Slack.

Idle, a lock used to leave /readyz ready (its probe, SELECT 1, reads no page) while no
command could be recorded. Now /readyz says not ready, a /deploy is refused within
Slack's 3 s and never carried out, and deploys running under a lock shorter than
`[store] write_retry_s` wait and land once it is released. One server for the module.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from handlers.messages.slack import STORE_NOT_ANSWERING
from handlers.messages.text import escape
from tests.support.crash import write_config
from tests.support.replicas import SLACK, Proc, SlackThread, command, get, serve, until
from tests.support.store import held

SETTINGS = "\n[store]\nwrite_retry_s = 6\n[ownership]\nlease_s = 20\ntick_s = 0.5\n"
DEPLOYS = 4
SHORT_S = 2.0  # the scenario: a lock shorter than write_retry_s, not a synchronisation
LONG_S = 9.0  # and one longer than write_retry_s (6 s)
Served = tuple[Proc, Path, SlackThread]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    slack = SlackThread()
    tmp = tmp_path_factory.mktemp("sqlite-outage")
    env = write_config(tmp, None)
    config = Path(env["DEPLOYBOT_CONFIG"])
    text = config.read_text().replace("time_scale = 0.01", "time_scale = 0.1")
    config.write_text(text + SETTINGS + SLACK.format(url=slack.fake.url))
    try:
        proc = serve(env, tmp, "serve")
        try:
            yield proc, tmp / "jobs.db", slack
        finally:
            proc.popen.kill()
            proc.popen.wait()
    finally:
        slack.close()


def jobs(path: Path) -> dict[str, tuple[str, str]]:
    conn = sqlite3.connect(path, timeout=30)
    try:
        found = conn.execute("SELECT name, state, error FROM jobs").fetchall()
    finally:
        conn.close()
    return {str(n): (str(s), str(e or "")) for n, s, e in found}


def test_a_locked_file_is_not_ready_and_a_command_is_refused_and_never_run(
    served: Served,
) -> None:
    server, path, slack = served
    until(lambda: get(server, "/readyz")[0] == 200, slack, "/readyz ready at start")
    with held(path):
        until(lambda: get(server, "/readyz")[0] == 503, slack, "/readyz not ready", 20)
        assert get(server, "/healthz")[0] == 200
        status, body, took_s = command(server, slack, "late01 10.20.1.200")
    assert status == 200 and took_s < 3, (status, body, took_s)
    assert body.get("text") == escape(STORE_NOT_ANSWERING), body
    until(lambda: get(server, "/readyz")[0] == 200, slack, "/readyz ready again", 20)
    # A deploy asked now is carried out; by its end the refused one would be a job.
    assert command(server, slack, "after01 10.20.1.201")[0] == 200
    until(lambda: jobs(path).get("after01", ("",))[0] == "succeeded", slack, "after01")
    assert "late01" not in jobs(path)


def test_deploys_under_a_lock_shorter_than_the_window_wait_and_land(served: Served) -> None:
    server, path, slack = served
    names = [f"s{n:02d}" for n in range(DEPLOYS)]
    for n, name in enumerate(names):
        assert command(server, slack, f"{name} 10.20.2.{100 + n}")[0] == 200
    until(lambda: any(jobs(path).get(n, ("",))[0] == "running" for n in names), slack, "running")
    with held(path):
        time.sleep(SHORT_S)  # the lock's length: the scenario
    settled = ("succeeded", "failed")
    until(lambda: all(jobs(path).get(n, ("",))[0] in settled for n in names), slack, "final", 60)
    found = {n: jobs(path)[n] for n in names}
    assert all(state == "succeeded" for state, _e in found.values()), found


def test_deploys_under_a_lock_longer_than_the_window_pause_and_land(served: Served) -> None:
    """Past `write_retry_s` a deploy's progress write is not lost and the deploy is not
    rolled back: its runner cannot renew either, so the deploy pauses (bot/ownership/claims.py
    `hold`) and carries on once the file is free. Before fencing, each ended `failed`
    ("interrupted: the database stopped answering")."""
    server, path, slack = served
    names = [f"l{n:02d}" for n in range(DEPLOYS)]
    for n, name in enumerate(names):
        assert command(server, slack, f"{name} 10.20.3.{100 + n}")[0] == 200
    until(lambda: any(jobs(path).get(n, ("",))[0] == "running" for n in names), slack, "running")
    with held(path):
        time.sleep(LONG_S)  # the lock's length: the scenario
    settled = ("succeeded", "failed")
    until(lambda: all(jobs(path).get(n, ("",))[0] in settled for n in names), slack, "final", 90)
    found = {n: jobs(path)[n] for n in names}
    assert all(state == "succeeded" for state, _e in found.values()), found
