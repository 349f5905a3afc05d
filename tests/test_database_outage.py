"""PostgreSQL stopped under a running `deploybot serve --http` (`pg_ctl stop -m fast`,
then started again, for less than `[ownership] lease_s`).

A deploy whose write the database refused (AdminShutdown) used to be dropped by its
task and stay `running` for as long as anyone watched: its runner kept renewing every
job it held, whether a task ran it or not. Now the renewal names only what runs here,
and a job held with no task is handed back and rolled back (or resumed) by its runner.
And a /deploy that came during the outage used to get no acknowledgement (Slack's
"unhandled request" after 3 s) and then be carried out once the database was back; now
it is refused plainly within the 3 s and never carried out. /readyz says not ready
meanwhile, /healthz stays live, /metrics says the store is down.

The cluster here is this module's own, so stopping it disturbs no other test.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from handlers.messages.slack import STORE_NOT_ANSWERING
from handlers.messages.text import escape
from tests.support.fakepve.process import FakePVE, config_env, fake_pve
from tests.support.postgres import PASSWORD, PASSWORD_ENV, start_again, stop_fast
from tests.support.replicas import (
    SLACK,
    Proc,
    SlackThread,
    _reap,
    check_vms,
    command,
    get,
    rows,
    serve,
    slack,
    until,
    until_or_none,
)

__all__ = ["_reap", "fake_pve", "slack"]  # fixtures, used by name
DEPLOYS = 12
OUTAGE_S = 4.0  # the scenario: shorter than the lease, longer than a tick and Slack's 3 s
LEASE = "\n[ownership]\nlease_s = 20\ntick_s = 0.5\n"
FINAL = ("succeeded", "failed")


def replica(tmp: Path, fake: FakePVE, slack: SlackThread, url: str) -> Proc:
    env = {**config_env(tmp, fake), PASSWORD_ENV: PASSWORD}
    config = Path(env["DEPLOYBOT_CONFIG"])
    text = config.read_text().replace(f'"{tmp}/jobs.db"', f'"{url}"')
    config.write_text(text + LEASE + SLACK.format(url=slack.fake.url))
    return serve(env, tmp, "replica")


def states(url: str) -> dict[str, tuple[str, str]]:
    return {
        str(n): (str(s), str(e or ""))
        for n, s, e in rows(url, "SELECT name, state, error FROM jobs")
    }


def test_deploys_running_through_a_database_outage_all_end(
    tmp_path: Path, fake_pve: FakePVE, slack: SlackThread, stoppable_pg: tuple[str, Path]
) -> None:
    url, workdir = stoppable_pg
    server = replica(tmp_path, fake_pve, slack, url)
    for n in range(DEPLOYS):
        status, _body, _s = command(server, slack, f"o{n:02d} 127.0.10.{100 + n}")
        assert status == 200
    running = "SELECT count(*) FROM jobs WHERE state = 'running'"
    until(lambda: int(rows(url, running)[0][0]) >= 2, slack, "deploys running")
    stop_fast(workdir)
    time.sleep(OUTAGE_S)  # the outage's length: the scenario, not a synchronisation
    start_again(workdir)

    def settled() -> bool:
        found = states(url)
        return len(found) == DEPLOYS and all(s in FINAL for s, _e in found.values())

    if not until_or_none(settled, slack, within_s=90):
        pytest.fail(f"jobs not final a minute after the outage: {states(url)}")
    found = states(url)
    failed = {name: error for name, (state, error) in found.items() if state == "failed"}
    # A deploy the outage broke says so: the database, not a restart or a mystery.
    assert all("database" in error for error in failed.values()), failed
    runs = {
        str(n): (str(s), str(v or ""))
        for n, s, v in rows(url, "SELECT name, state, vm_id FROM jobs")
    }
    check_vms(runs, fake_pve)  # no VM left behind by a failed one, none lost
    print(
        f"\noutage {OUTAGE_S:g} s under {DEPLOYS} deploys: {len(failed)} failed ({failed}), "
        f"{DEPLOYS - len(failed)} succeeded"
    )


def test_a_command_during_an_outage_is_refused_at_once_and_never_run(
    tmp_path: Path, fake_pve: FakePVE, slack: SlackThread, stoppable_pg: tuple[str, Path]
) -> None:
    url, workdir = stoppable_pg
    server = replica(tmp_path, fake_pve, slack, url)
    assert get(server, "/readyz")[0] == 200
    stop_fast(workdir)
    try:
        until(lambda: get(server, "/readyz")[0] == 503, slack, "/readyz not ready")
        assert get(server, "/healthz")[0] == 200
        metrics = get(server, "/metrics")
        assert metrics[0] == 200 and "deploybot_store_up 0.0" in metrics[1], metrics
        status, body, took_s = command(server, slack, "late01 127.0.10.200")
    finally:
        start_again(workdir)
    assert status == 200 and took_s < 3, (status, body, took_s)
    assert body.get("text") == escape(STORE_NOT_ANSWERING), body
    until(lambda: get(server, "/readyz")[0] == 200, slack, "/readyz ready again")
    assert "deploybot_store_up 1.0" in get(server, "/metrics")[1]
    # Once the database is back the command is not carried out: a deploy asked now is,
    # and by the time it is final the refused one would have been made into a job.
    assert command(server, slack, "after01 127.0.10.201")[0] == 200
    final = "SELECT count(*) FROM jobs WHERE name = 'after01' AND state IN ('succeeded', 'failed')"
    until(lambda: int(rows(url, final)[0][0]) == 1, slack, "the later deploy final")
    assert not rows(url, "SELECT id FROM jobs WHERE name = 'late01'")
    undone = rows(url, "SELECT key FROM inbox WHERE done_at IS NULL")
    assert not undone, undone
