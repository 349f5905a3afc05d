"""`lease=7d` in the grammar, `lease extend NAME 7d` in chat, and `deploybot lease extend
NAME 7d` on the command line (a real process on the simulator with a state file)."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from bot.leases.terms import parse_length, show_length
from bot.models.errors import ConfigError, UsageError
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs, ExtendLease
from tests.support.cli import KEPT, deploybot, no_traceback
from tests.support.deployer import make_settings


def test_lease_in_the_deploy_grammar() -> None:
    week = parse("web01 10.0.0.50 lease=7d")
    assert isinstance(week, DeployArgs) and week.lease_s == 7 * 86400 and not week.lease_never
    forever = parse("web01 LEASE=Never")
    assert isinstance(forever, DeployArgs) and forever.lease_never and forever.lease_s is None
    plain = parse("web01")
    assert isinstance(plain, DeployArgs) and plain.lease_s is None and not plain.lease_never
    for bad in ("lease=7x", "lease=7", "lease=-1d", "lease=\uff17d"):
        with pytest.raises(UsageError) as refused:
            parse(f"web01 {bad}")
        assert bad in refused.value.message and "like 7d" in refused.value.message
    with pytest.raises(UsageError, match="given twice"):
        parse("web01 lease=1d lease=2d")


def test_lease_extend_in_the_grammar() -> None:
    assert parse("lease extend web01 7d") == ExtendLease("web01", 7 * 86400)
    assert parse("LEASE Extend web01 12h") == ExtendLease("web01", 12 * 3600)
    assert parse("lease extend web01") == ExtendLease("web01", None)  # the button's step
    for bad in ("lease", "lease web01 7d", "lease extend", "lease extend web01 7d x"):
        with pytest.raises(UsageError, match="/deploy lease extend NAME"):
            parse(bad)
    with pytest.raises(UsageError, match="extend by a length"):
        parse("lease extend web01 never")


def test_lengths_read_and_written_back() -> None:
    assert [parse_length(t) for t in ("30m", "12h", "14d", "2w", "never")] == [
        1800,
        43200,
        1209600,
        1209600,
        None,
    ]
    assert [show_length(s) for s in (1800, 86400 * 14, 90, None)] == ["30m", "14d", "90s", "never"]


def test_the_leases_section_is_checked(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, leases={"default": "7d", "templates": {"big": "1d"}, "backends": {"sim": "2d"}}
    )
    assert settings.leases.default_for("big", "sim") == 86400
    assert settings.leases.default_for("ubuntu-24.04", "sim") == 2 * 86400
    assert settings.leases.default_for("ubuntu-24.04", "other") == 7 * 86400
    with pytest.raises(ConfigError, match=r"leases: .*default \(100d\) is longer than max"):
        make_settings(tmp_path, leases={"default": "100d"})
    with pytest.raises(ConfigError, match=r"leases\.grace"):
        make_settings(tmp_path, leases={"grace": "never"})


def lease_end(tmp: Path) -> datetime:
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        row = db.execute("SELECT expires_at, finished_at, lease_s FROM jobs").fetchone()
    finally:
        db.close()
    if row[0]:
        return datetime.fromisoformat(row[0])
    return datetime.fromisoformat(row[1]) + timedelta(seconds=row[2])


def test_lease_extend_from_the_cli(tmp_path: Path) -> None:
    made = deploybot(tmp_path, "deploy", "web01", "10.0.0.50", "lease=2d", "--user", "alice",
                     config=KEPT)  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    before = lease_end(tmp_path)
    extended = deploybot(tmp_path, "lease", "extend", "web01", "7d", "--user", "alice",
                         config=KEPT)  # fmt: skip
    assert extended.returncode == 0, extended.stdout + extended.stderr
    assert "The lease of web01" in extended.stdout and "now ends" in extended.stdout
    assert lease_end(tmp_path) == before + timedelta(days=7)
    stranger = deploybot(tmp_path, "lease", "extend", "web01", "--user", "mallory", config=KEPT)
    assert stranger.returncode == 2 and "Only alice (who deployed it)" in stranger.stderr
    too_far = deploybot(tmp_path, "lease", "extend", "web01", "100d", "--user", "alice",
                        config=KEPT)  # fmt: skip
    assert too_far.returncode == 2 and "would pass the maximum lease of 90d" in too_far.stderr
    assert "try again" not in too_far.stderr
    bad = deploybot(tmp_path, "lease", "extend", "web01", "7x", config=KEPT)
    assert bad.returncode == 2 and "not a lease length" in bad.stderr
    for result in (extended, stranger, too_far, bad):
        no_traceback(result)
    assert lease_end(tmp_path) == before + timedelta(days=7)
