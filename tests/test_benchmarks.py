"""Every benchmark, run as `make bench` would run it but at a tiny scale: it must start,
finish and print its table with the goals, so none of them rots between measurements.

Nothing here measures (speed and memory belong to the benchmarks themselves). A
benchmark that needs a part which is not here (../shared/reference, PostgreSQL, vcsim)
says so and exits with `benchmarks.needs.MISSING`: the test skips with its words, or
fails under the DEPLOYBOT_REQUIRE_<PART>=1 that CI sets (.ci/run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.needs import MISSING

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Smoke:
    module: str
    args: tuple[str, ...]
    goal: str  # what the goal row or column shows
    requires: tuple[str, ...] = ()  # the DEPLOYBOT_REQUIRE_<PART> variables that apply


SMOKES = [
    Smoke("bench_pipeline", ("--counts", "1", "2", "--time-scale", "0.01"), "goal"),
    Smoke("bench_history", ("--jobs", "1200", "--large", "1100"), "goal <="),
    Smoke(
        "bench_ipam",
        (
            "--held",
            "0",
            "2",
            "--by-hand",
            "10",
            "--picks",
            "2",
            "--sweep-hand",
            "2",
            "--sweep-ours",
            "3",
        ),
        "<= 50",
        ("DEPLOYBOT_REQUIRE_REFERENCE",),
    ),
    Smoke(
        "bench_proxmox",
        ("--runs", "1", "--concurrent", "2", "--time-scale", "0.05"),
        "goal <=",
        ("DEPLOYBOT_REQUIRE_REFERENCE",),
    ),
    Smoke(
        "bench_replicas",
        ("--deploys", "2", "--time-scale", "0.05"),
        "goal",
        ("DEPLOYBOT_REQUIRE_POSTGRES", "DEPLOYBOT_REQUIRE_REFERENCE"),
    ),
    Smoke("bench_slack_delivery", ("--deploys", "2"), "<=10", ("DEPLOYBOT_REQUIRE_REFERENCE",)),
    Smoke(
        "bench_vsphere",
        ("--deploys", "2", "--boots", "0", "--extra-vms", "0", "--scale-deploys", "1"),
        "<=34",
        ("DEPLOYBOT_REQUIRE_VCSIM",),
    ),
]


def test_every_benchmark_has_a_smoke_run() -> None:
    found = {path.stem for path in (ROOT / "benchmarks").glob("bench_*.py")}
    assert found == {smoke.module for smoke in SMOKES}


@pytest.mark.parametrize("smoke", SMOKES, ids=[s.module for s in SMOKES])
def test_benchmark_runs_at_a_tiny_scale(smoke: Smoke) -> None:
    # The benchmark reads its parts' REQUIRE variables itself (the tests' support
    # modules): without them it says what is missing and exits with MISSING.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_REQUIRE_")}
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{smoke.module}", *smoke.args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == MISSING:
        reason = done.stderr.strip().splitlines()[-1]
        required = [name for name in smoke.requires if os.environ.get(name) == "1"]
        if required:
            pytest.fail(f"{reason}; {', '.join(required)}=1 forbids skipping")
        pytest.skip(reason)
    assert done.returncode == 0, done.stdout + done.stderr
    assert smoke.goal in done.stdout, done.stdout
