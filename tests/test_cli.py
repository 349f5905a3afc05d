"""The `deploybot` command as a user runs it: a real process, real files, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import CONFIG, KEPT, deploybot, no_traceback


def test_demo_runs_both_threads_to_the_end(tmp_path: Path) -> None:
    result = deploybot(tmp_path, "demo", "--time-scale", "0.01", config=None)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "bob> approve j" in out
    assert "    ssh ubuntu@10.0.0.50" in out
    assert "web02 10.0.20.100 (next free in lab20) needs approval" in out
    assert "NIC on vmbr0)" in out and "NIC on vmbr1 VLAN 20)" in out  # each subnet's segment
    assert "certified by deploybot's host CA" in out  # a CA made for the demo
    assert "bot:     @cert-authority *.lab.example ssh-ed25519 AAAA" in out
    assert "failed at power on" in out
    assert "Rolled back: stop VM 102; destroy VM 102." in out
    assert "VMs on the simulator now: web01" in out
    no_traceback(result)
    assert not list(tmp_path.iterdir()), "the demo leaves no files behind"


def test_deploy_prints_the_ssh_line_and_history_remembers(tmp_path: Path) -> None:
    result = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", "mem=4G", "--user", "alice")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ssh ubuntu@10.0.0.50" in result.stdout
    history = deploybot(tmp_path, "history")
    assert history.returncode == 0
    assert "web01" in history.stdout and "ready" in history.stdout and "alice" in history.stdout
    only_failed = deploybot(tmp_path, "history", "--state", "failed")
    assert "No deploys match" in only_failed.stdout
    bad_state = deploybot(tmp_path, "history", "--state", "sideways")
    assert bad_state.returncode == 2 and "use one of awaiting_approval" in bad_state.stderr


def test_key_value_words_may_follow_an_option(tmp_path: Path) -> None:
    result = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", "--backend", "sim", "cpu=3")
    assert result.returncode == 0, result.stderr
    assert "3 cores" in result.stdout
    wrong = deploybot(tmp_path, "deploy", "web02", "10.0.0.51", "--colour", "red")
    assert wrong.returncode == 2 and "unrecognized arguments: --colour" in wrong.stderr


def test_a_bad_request_says_why_and_records_nothing(tmp_path: Path) -> None:
    result = deploybot(tmp_path, "deploy", "web_01", "10.0.0.500")
    assert result.returncode == 2
    assert "not a valid host name" in result.stderr or "not an IPv4 address" in result.stderr
    no_traceback(result)
    usage = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", "memory=4G")
    assert usage.returncode == 2 and "Did you mean `mem`?" in usage.stderr
    assert "No deploys yet" in deploybot(tmp_path, "history").stdout


def test_a_request_needing_approval_is_refused_by_the_one_shot_cli(tmp_path: Path) -> None:
    result = deploybot(tmp_path, "deploy", "big", "10.0.0.60", "cpu=12")
    assert result.returncode == 2
    assert "needs approval (cores over 8 needs approval)" in result.stderr
    assert "No deploys yet" in deploybot(tmp_path, "history").stdout


def test_a_failed_deploy_exits_1(tmp_path: Path) -> None:
    # The guest never reports an address (a fault, not a race against a tiny timeout).
    faults = 'time_scale = 0.001\nfaults = [{{op = "wait_for_address", kind = "hang"}}]'
    config = CONFIG.replace("time_scale = 0.001", faults).replace(
        "[timeouts]", "[timeouts]\naddress_s = 0.2"
    )
    result = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", config=config)
    assert result.returncode == 1
    assert "failed at wait for address" in result.stdout
    no_traceback(result)


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ("[[backends]]\nkind='sim'\nname='sim'\n", ["subnets: Field required"]),
        ("database = [1, 2\n", ["not valid TOML"]),
        (
            CONFIG.replace('gateway = "10.0.0.1"', 'gateway = "10.9.0.1"'),
            ["subnets.0: gateway 10.9.0.1 is outside 10.0.0.0/24"],
        ),
        (
            CONFIG.replace("time_scale = 0.001", "time_scale = 0.001\ncolour = 'red'"),
            ["backends.0.colour"],
        ),
    ],
)
def test_a_bad_config_names_file_key_and_reason(
    tmp_path: Path, config: str, fragments: list[str]
) -> None:
    result = deploybot(tmp_path, "check-config", config=config)
    assert result.returncode == 2
    assert str(tmp_path / "deploybot.toml") in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr
    no_traceback(result)


def test_a_missing_config_file_says_what_to_do(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env["DEPLOYBOT_CONFIG"] = str(tmp_path / "nope.toml")
    result = subprocess.run(
        [sys.executable, "-m", "handlers.entry", "check-config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no such file" in result.stderr


def test_the_bundled_config_works_with_no_file(tmp_path: Path) -> None:
    result = deploybot(tmp_path, "check-config", config=None)
    assert result.returncode == 0 and "backends: sim (sim)" in result.stdout


def test_an_internal_error_points_at_the_log_not_a_traceback(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = CONFIG.replace('database = "{tmp}/jobs.db"', 'database = "{tmp}/file/jobs.db"')
    result = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", config=config)
    assert result.returncode == 1
    assert f"the details are in {tmp_path}/bot.log" in result.stderr
    no_traceback(result)
    assert "Traceback" in (tmp_path / "bot.log").read_text()


def test_shell_session_deploys_and_waits_before_leaving(tmp_path: Path) -> None:
    lines = "help\n/deploy help\n/deploy web01 10.0.0.50\nwhat\nquit\n"
    result = deploybot(tmp_path, "shell", "--user", "alice", stdin=lines)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "as NAME" in out
    assert "bot:   /deploy status JOB" in out
    assert "I only understand /deploy" in out
    assert "ssh ubuntu@10.0.0.50" in out
    no_traceback(result)


def test_serve_without_a_token_says_which_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    result = deploybot(tmp_path, "serve")
    assert result.returncode == 2 and "SLACK_BOT_TOKEN is not set" in result.stderr


def test_list_and_destroy_from_the_cli(tmp_path: Path) -> None:
    for name, address in (("web01", "10.0.0.50"), ("web02", "10.0.0.51")):
        made = deploybot(tmp_path, "deploy", name, address, "--user", "alice", config=KEPT)
        assert made.returncode == 0, made.stdout + made.stderr
    listed = deploybot(tmp_path, "list", "--user", "alice", config=KEPT)
    assert listed.returncode == 0, listed.stderr
    rows = listed.stdout.splitlines()
    assert rows[0] == "VMs of alice: 2 (page 1 of 1)"
    assert rows[1].split() == ["name", "address", "backend", "age", "lease", "end", "state", "job"]
    assert rows[2].split()[:4] == ["web02", "10.0.0.51", "sim", "0m"]
    assert "UTC" in rows[2] and "ready" in rows[2]  # the lease end, 14 days by default
    stranger = deploybot(tmp_path, "destroy", "web01", "--user", "mallory", config=KEPT)
    assert stranger.returncode == 2 and "Only alice (who deployed it)" in stranger.stderr
    no_traceback(stranger)
    unknown = deploybot(tmp_path, "destroy", "web99", "--user", "alice", config=KEPT)
    assert unknown.returncode == 2 and "holds no VM called web99" in unknown.stderr
    gone = deploybot(tmp_path, "destroy", "web01", "--user", "alice", config=KEPT)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert "✓ stop the VM" in gone.stdout and "✓ destroy the VM" in gone.stdout
    assert "web01 and 10.0.0.50 are free again" in gone.stdout
    everyone = deploybot(tmp_path, "list", "--all", config=KEPT)
    assert "web01" not in everyone.stdout and "web02" in everyone.stdout
    again = deploybot(tmp_path, "destroy", "web01", "--user", "alice", config=KEPT)
    assert again.returncode == 2 and "holds no VM called web01" in again.stderr
    history = deploybot(tmp_path, "history", "--state", "destroyed", config=KEPT)
    assert "web01" in history.stdout and "destroyed" in history.stdout


def test_a_destroy_needing_approval_is_refused_by_the_one_shot_cli(tmp_path: Path) -> None:
    config = KEPT.replace("cores_over = 8", 'cores_over = 8\ndestroy = "always"')
    made = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", "--user", "alice", config=config)
    assert made.returncode == 0, made.stdout + made.stderr
    refused = deploybot(tmp_path, "destroy", "web01", "--user", "alice", config=config)
    assert refused.returncode == 2 and "Destroys need approval here" in refused.stderr
    assert "ready" in deploybot(tmp_path, "list", "--user", "alice", config=config).stdout


def test_template_build_on_the_simulator(tmp_path: Path) -> None:
    # A non-approver's build would wait for an approver: the one-shot CLI refuses it.
    waits = deploybot(
        tmp_path, "template", "build", "debian-12", "--backend", "sim", "--user", "alice"
    )
    assert waits.returncode == 2 and "This build needs approval" in waits.stderr
    no_traceback(waits)
    result = deploybot(
        tmp_path, "template", "build", "debian-12", "--backend", "sim", "--name", "golden",
        "--user", "bob",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke test passed" in result.stdout
    assert "Published: golden is version 1 (golden-v1)" in result.stdout
    listing = deploybot(tmp_path, "template", "list")
    assert "golden-v1" in listing.stdout and "published" in listing.stdout
    refused = deploybot(tmp_path, "template", "build", "nope", "--backend", "sim", "--user", "bob")
    assert refused.returncode == 2 and "no build profile 'nope'" in refused.stderr
    no_traceback(refused)
    profiles = deploybot(tmp_path, "template", "profiles")
    assert "rocky-10" in profiles.stdout and "x86-64-v3" in profiles.stdout
