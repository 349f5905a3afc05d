"""deploybot's command line run as a real process: a configuration and the runner."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

CONFIG = """
database = "{tmp}/jobs.db"
log_file = "{tmp}/bot.log"

[[backends]]
kind = "sim"
name = "sim"
time_scale = 0.001

[defaults]
ssh_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"]

[[subnets]]
cidr = "10.0.0.0/24"
gateway = "10.0.0.1"
dns = ["10.0.0.2"]

[timeouts]
retry_initial_s = 0.001

[approval]
approvers = ["bob"]
cores_over = 8
"""


def deploybot(
    tmp_path: Path, *args: str, config: str | None = CONFIG, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    if config is not None:
        path = tmp_path / "deploybot.toml"
        path.write_text(config.format(tmp=tmp_path))
        env["DEPLOYBOT_CONFIG"] = str(path)
    return subprocess.run(
        [sys.executable, "-m", "handlers.entry", *args],
        cwd=tmp_path,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def run_async(
    config: Path, cwd: Path, secrets: Mapping[str, str], *args: str
) -> tuple[int, str, str]:
    """The real `deploybot` command with `config` and `secrets` in its environment, for
    async tests: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env.update(secrets, DEPLOYBOT_CONFIG=str(config))
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("deploybot")),
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stdout + result.stderr


# The simulator keeps its VMs in a file, so a VM one process made is there for the next.
KEPT = CONFIG.replace("time_scale = 0.001", 'time_scale = 0.001\nstate_file = "{tmp}/sim.json"')
