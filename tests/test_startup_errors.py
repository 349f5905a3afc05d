"""Start-up errors as an operator meets them: the real `deploybot` command against a
database that is not there (a closed port on 127.0.0.1) or that refuses it (the tests'
PostgreSQL with a wrong database, user or password). The message keeps libpq's whole
reason and names the setting to check; no traceback and no password reach the terminal."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import CONFIG
from tests.support.postgres import PASSWORD, PASSWORD_ENV, USER, Cluster
from tests.support.slack.bot import BOT_TOKEN, SIGNING_SECRET

# serve in HTTP mode opens the store before it talks to Slack: fake tokens do.
COMMANDS = [("shell",), ("history",), ("serve", "--http", "127.0.0.1:0")]


def closed_port() -> int:
    """A port on 127.0.0.1 nobody listens on: bound, then let go."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deploybot(tmp_path: Path, database: str, *args: str, password: str) -> tuple[int, str]:
    config = tmp_path / "deploybot.toml"
    config.write_text(CONFIG.format(tmp=tmp_path).replace(f'"{tmp_path}/jobs.db"', f'"{database}"'))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEPLOYBOT_", "SLACK_"))}
    env |= {"DEPLOYBOT_CONFIG": str(config), PASSWORD_ENV: password}
    env |= {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_SIGNING_SECRET": SIGNING_SECRET}
    result = subprocess.run(
        [sys.executable, "-m", "handlers.entry", *args],
        cwd=tmp_path, env=env, input="", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert "Traceback" not in output and password not in output
    return result.returncode, output


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_closed_port_says_connection_refused_and_names_the_setting(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    url = f"postgresql://{USER}@127.0.0.1:{closed_port()}/deploybot"
    code, output = deploybot(tmp_path, url, *command, password="not-the-point-7q")
    assert code == 2, output
    assert "Connection refused" in output  # libpq's reason, not only its last hint
    assert "Is the server running on that host" in output
    assert "setting `database`" in output and url in output
    assert "try again" not in output.lower()


def test_check_config_shows_the_database_without_connecting(tmp_path: Path) -> None:
    url = f"postgresql://{USER}@127.0.0.1:{closed_port()}/deploybot"
    code, output = deploybot(tmp_path, url, "check-config", password="not-the-point-7q")
    assert code == 0 and f"database: {url}" in output


@pytest.mark.parametrize(
    ("dbname", "user", "password", "reason", "setting"),
    [
        ("nosuchdb", USER, PASSWORD, 'database "nosuchdb" does not exist', "`database`"),
        ("postgres", "nosuchrole", PASSWORD, "nosuchrole", "`database`"),
        ("postgres", USER, "wrong-pass-4f", "password authentication failed", PASSWORD_ENV),
    ],
    ids=["database", "user", "password"],
)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_postgresql_refusing_says_why_and_which_setting(
    pg_cluster: Cluster,
    tmp_path: Path,
    command: tuple[str, ...],
    dbname: str,
    user: str,
    password: str,
    reason: str,
    setting: str,
) -> None:
    url = f"postgresql://{user}@127.0.0.1:{pg_cluster.port}/{dbname}"
    code, output = deploybot(tmp_path, url, *command, password=password)
    assert code == 2, output
    assert reason in output and setting in output and url in output
    if setting == PASSWORD_ENV:
        assert "`database_password_env`" in output
    assert "try again" not in output.lower()
