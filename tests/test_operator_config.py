"""What an operator gets wrong is refused at start, with the key and the fix; the
environment wins over the file; the log file is private (issue 13, items 3-5)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimBackend
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models.errors import ConfigError
from tests.support.deployer import TEST_KEY, make_settings

ROOT = Path(__file__).resolve().parent.parent


def refused(tmp_path: Path, **overrides: Any) -> str:
    with pytest.raises(ConfigError) as error:
        make_settings(tmp_path, **overrides)
    return error.value.message


@pytest.mark.parametrize(
    ("subnets", "said"),
    [
        ([{"cidr": "10.0.0.0/24", "gateway": "10.0.0.1"}] * 2, "10.0.0.0/24 is listed twice"),
        (
            [
                {"cidr": "10.0.0.0/24", "gateway": "10.0.0.1"},
                {"cidr": "10.0.0.128/25", "gateway": "10.0.0.129"},
            ],
            "10.0.0.0/24 overlaps 10.0.0.128/25",
        ),
        ([{"cidr": "10.0.0.0/24", "gateway": "10.0.0.0"}], "is the network address"),
        ([{"cidr": "10.0.0.0/24", "gateway": "10.0.0.255"}], "is the broadcast address"),
    ],
)
def test_subnets_that_cannot_work_are_refused(
    tmp_path: Path, subnets: list[dict[str, str]], said: str
) -> None:
    message = refused(tmp_path, subnets=subnets)
    assert "subnets" in message and said in message


def test_a_default_key_that_is_not_a_public_key_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, defaults={"ssh_keys": [TEST_KEY, "ssh-rsa not-a-key"]})
    assert "defaults.ssh_keys" in message and "key 2" in message


def test_a_log_folder_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, log_file=str(tmp_path / "no" / "such" / "bot.log"))
    assert "log_file" in message and "does not exist" in message


def test_a_missing_ca_bundle_is_refused(tmp_path: Path) -> None:
    backend = {
        "kind": "proxmox",
        "name": "pve",
        "host": "127.0.0.1",
        "user": "root@pam",
        "token_id": "deploybot",
        "ca_bundle": str(tmp_path / "missing.pem"),
    }
    message = refused(tmp_path, backends=[backend])
    assert "backends.0.ca_bundle" in message and "missing.pem does not exist" in message


def test_the_environment_wins_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEPLOYBOT_LIMITS__MAX_RUNNING", "3")
    monkeypatch.setenv("DEPLOYBOT_SLACK__API_BASE_URL", "http://127.0.0.1:9/api/")
    settings = make_settings(
        tmp_path, limits={"max_running": 8}, slack={"api_base_url": "http://127.0.0.1:1/"}
    )
    assert settings.limits.max_running == 3
    assert settings.slack.api_base_url == "http://127.0.0.1:9/api/"
    assert settings.limits.max_running_per_backend == 4  # the rest of the section stays


def test_the_log_file_is_private_and_serve_writes_it(tmp_path: Path) -> None:
    config = tmp_path / "deploybot.toml"
    text = BUNDLED_CONFIG.read_text().replace('"deploybot.db"', f'"{tmp_path}/jobs.db"')
    config.write_text(text.replace('"deploybot.log"', f'"{tmp_path}/bot.log"'))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env["DEPLOYBOT_CONFIG"] = str(config)
    result = subprocess.run(
        [sys.executable, "-m", "handlers.entry", "history"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((tmp_path / "bot.log").stat().st_mode) == 0o600
    assert load_settings(config).log_file == tmp_path / "bot.log"


async def test_json_log_lines_carry_the_job_backend_step_and_runner(
    tmp_path: Path, sim: SimBackend
) -> None:
    import json
    import logging

    from bot.app.cli import configure_logging
    from bot.app.runtime import running_deployer
    from tests.support.deployer import deploy

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    settings = make_settings(tmp_path, log_format="json")
    try:
        configure_logging(settings.log_file, json_lines=True)
        sim.inject("power_on", "error")
        async with running_deployer(settings, backends={"sim": sim}) as deployer:
            job = await deploy(deployer)
            runner = deployer.runner.id
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = [json.loads(line) for line in settings.log_file.read_text().splitlines()]
    about = [line for line in lines if line.get("job") == job.id]
    assert about, lines
    failed = [line for line in about if line.get("step") == "power_on"]
    assert failed and all(line["backend"] == "sim" and line["runner"] == runner for line in failed)
    assert stat.S_IMODE(settings.log_file.stat().st_mode) == 0o600


def test_bolt_never_logs_a_request_body(tmp_path: Path) -> None:
    import logging

    from slack_bolt.logger.messages import warning_unhandled_by_global_middleware
    from slack_bolt.request.async_request import AsyncBoltRequest

    from bot.app.cli import configure_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    body = "token=x&user_id=UALICE001&text=web01+secret-words&trigger_id=T123"
    try:
        configure_logging(tmp_path / "bot.log")
        request = AsyncBoltRequest(body=body, headers={})
        logging.getLogger("slack_bolt.AsyncApp").warning(
            warning_unhandled_by_global_middleware("verify", request)
        )
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    text = (tmp_path / "bot.log").read_text()
    assert "for the request (body withheld)" in text
    assert "secret-words" not in text and "UALICE001" not in text


# --- refused at start, not at the first deploy (issue 25, item 7) -------------------

PVE_AND_VSPHERE = """
[[backends]]
kind = "proxmox"
name = "pve"
host = "127.0.0.1"
user = "root@pam"
token_id = "deploybot"
token_secret_env = "DEPLOYBOT_TEST_NO_PVE_SECRET"
password_env = "DEPLOYBOT_TEST_NO_PVE_PASSWORD"

[[backends]]
kind = "vsphere"
name = "vc"
host = "127.0.0.1"
user = "deploybot@vsphere.local"
datacenter = "DC0"
password_env = "DEPLOYBOT_TEST_NO_VC_PASSWORD"
"""


def run_cli(
    tmp_path: Path, config: str, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """`deploybot ARGS` with `config` (the CLI tests' sim configuration, changed)."""
    from tests.support.cli import CONFIG

    path = tmp_path / "deploybot.toml"
    path.write_text(CONFIG.format(tmp=tmp_path) + config)
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    return subprocess.run(
        [sys.executable, "-m", "handlers.entry", "--config", str(path), *args],
        cwd=tmp_path, env={**base, **env}, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.parametrize("command", [["check-config"], ["shell"], ["serve"]])
def test_missing_backend_secrets_are_all_named_at_start(tmp_path: Path, command: list[str]) -> None:
    result = run_cli(
        tmp_path, PVE_AND_VSPHERE, *command, SLACK_BOT_TOKEN="xoxb-1234567890-abcdefghij"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    said = result.stderr
    assert "backend pve: no Proxmox credentials" in said
    assert "$DEPLOYBOT_TEST_NO_PVE_SECRET or $DEPLOYBOT_TEST_NO_PVE_PASSWORD" in said
    assert "backend vc:" in said and "DEPLOYBOT_TEST_NO_VC_PASSWORD, which is not set" in said
    assert "The configuration is valid" not in result.stdout
    assert "Traceback" not in said


def test_serve_names_slacks_token_and_the_backends_secrets_together(tmp_path: Path) -> None:
    result = run_cli(tmp_path, PVE_AND_VSPHERE, "serve", SLACK_BOT_TOKEN="")
    assert result.returncode == 2
    assert "SLACK_BOT_TOKEN is not set" in result.stderr
    assert "DEPLOYBOT_TEST_NO_PVE_SECRET" in result.stderr
    assert "DEPLOYBOT_TEST_NO_VC_PASSWORD" in result.stderr


def test_check_config_passes_when_the_secrets_are_there(tmp_path: Path) -> None:
    secrets = {
        "DEPLOYBOT_TEST_NO_PVE_SECRET": "s3cret-token-value",
        "DEPLOYBOT_TEST_NO_VC_PASSWORD": "s3cret-password-value",
    }
    result = run_cli(tmp_path, PVE_AND_VSPHERE, "check-config", **secrets)
    assert result.returncode == 0, result.stderr
    assert "The configuration is valid." in result.stdout
    log = (tmp_path / "bot.log").read_text()
    for secret in secrets.values():
        assert secret not in result.stdout + result.stderr + log


@pytest.mark.parametrize(
    ("defaults", "key", "said"),
    [
        ('user = "Root User"', "defaults.user", "'Root User' is not a valid login name"),
        ("memory_mib = 131072", "defaults.memory_mib (131072 MiB) is over", "65536 MiB"),
        ("cores = 32", "defaults.cores (32) is over limits.max_cores (16)", "lower one"),
    ],
)
def test_defaults_no_deploy_could_use_stop_the_start(
    tmp_path: Path, defaults: str, key: str, said: str
) -> None:
    from tests.support.cli import CONFIG

    config = CONFIG.replace("[defaults]\n", f"[defaults]\n{defaults}\n")
    path = tmp_path / "deploybot.toml"
    path.write_text(config.format(tmp=tmp_path))
    for command in ("check-config", "shell", "serve"):
        result = subprocess.run(
            [sys.executable, "-m", "handlers.entry", "--config", str(path), command],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")},
        )  # fmt: skip
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert key in result.stderr and said in result.stderr, result.stderr
        assert "(top level)" not in result.stderr


def test_a_bad_value_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    """Issue 25, item 17: the file says 4; the variable is at fault, and is named."""
    result = run_cli(
        tmp_path, "\n[limits]\nmax_running = 4\n", "check-config",
        DEPLOYBOT_LIMITS__MAX_RUNNING="abc",
    )  # fmt: skip
    assert result.returncode == 2
    said = result.stderr
    assert "the environment variable DEPLOYBOT_LIMITS__MAX_RUNNING" in said, said
    assert "limits.max_running" in said and "and the environment:" in said


def test_a_bad_value_in_the_file_is_still_the_files(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "\n[limits]\nmax_running = 0\n", "check-config")
    assert result.returncode == 2
    assert "the environment" not in result.stderr
    assert "deploybot.toml: the configuration has 1 problem(s):" in result.stderr
    assert "  limits.max_running: Input should be greater than or equal to 1" in result.stderr
