"""The PostgreSQL store beyond the shared contract (tests/test_store.py runs that on both):
the same schema as SQLite's, migrations that replicas starting together run once, a
newer schema refused, claims by several processes at once, and the password kept out
of the configuration."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from bot.app.runtime import open_store
from bot.config.settings import Settings
from bot.models import HostKeySource, Job, JobState
from bot.models.errors import StoreUnavailable
from store.db import Store
from store.jobrows import job_row
from store.migrations import SCHEMA_VERSION
from store.postgres import schema
from tests.support.deployer import make_settings
from tests.support.postgres import PASSWORD, PASSWORD_ENV, Cluster
from tests.support.store import make_job

ROOT = Path(__file__).resolve().parent.parent


def pg_connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url, password=PASSWORD, autocommit=True)


def workers(*argv: str, count: int) -> list[str]:
    """Start `count` processes at once and wait for all; their outputs."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.workers.postgres", *argv, str(i)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    if argv[0] == "claim":  # a start line once every one is ready
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    outputs = []
    for proc in procs:
        out, err = proc.communicate("go\n", timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs


async def test_postgres_schema_matches_sqlite(pg_url: str, tmp_path: Path) -> None:
    await (await Store.open(tmp_path / "jobs.db")).close()
    lite = sqlite3.connect(tmp_path / "jobs.db")
    tables = [r[0] for r in lite.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    expected = {t: {r[1] for r in lite.execute(f"PRAGMA table_info({t})")} for t in tables}
    expected["jobs"].add("rowid")  # implicit in SQLite, a column on PostgreSQL
    await (await Store.open(pg_url, password=PASSWORD)).close()
    with pg_connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public'"
        ).fetchall()
    found: dict[str, set[str]] = {}
    for table, column in rows:
        found.setdefault(str(table), set()).add(str(column))
    assert found == expected


def test_postgres_replicas_starting_together_migrate_once(pg_url: str) -> None:
    outputs = workers("open", pg_url, count=4)
    assert sorted(int(out) for out in outputs) == [0, 0, 0, len(schema.STEPS)]
    with pg_connect(pg_url) as conn:
        rows = conn.execute("SELECT key, value FROM meta").fetchall()
    meta = {str(key): str(value) for key, value in rows}
    assert meta["schema_version"] == str(SCHEMA_VERSION)
    assert len(meta["installation_id"]) > 0


async def test_postgres_refuses_a_newer_schema(pg_url: str) -> None:
    await (await Store.open(pg_url, password=PASSWORD)).close()
    with pg_connect(pg_url) as conn:
        conn.execute(
            "UPDATE meta SET value = %s WHERE key = 'schema_version'", [str(SCHEMA_VERSION + 1)]
        )
        before = conn.execute("SELECT count(*) FROM information_schema.tables").fetchone()
    with pytest.raises(RuntimeError, match="newer than this deploybot"):
        await Store.open(pg_url, password=PASSWORD)
    with pg_connect(pg_url) as conn:
        after = conn.execute("SELECT count(*) FROM information_schema.tables").fetchone()
    assert before == after


async def test_postgres_claimers_in_several_processes_take_each_job_once(
    pg_url: str, settings: Settings
) -> None:
    store = await Store.open(pg_url, password=PASSWORD)
    try:
        jobs: list[Job] = []
        for i in range(60):
            job = make_job(settings, f"web{i:02d}", f"10.0.0.{i + 100}", state=JobState.QUEUED)
            jobs.append(await store.jobs.insert(job))
    finally:
        await store.close()
    outputs = workers("claim", pg_url, count=4)
    claimed = [line for out in outputs for line in out.split()]
    assert sorted(claimed) == sorted(j.id for j in jobs)  # every job, and each once


async def test_postgres_password_comes_from_the_environment(
    pg_cluster: Cluster, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(tmp_path, database=pg_url)
    store = await open_store(settings)  # pg_url's fixture put it in the environment
    assert PASSWORD not in store.label and str(pg_cluster.port) in store.label
    await store.close()
    monkeypatch.setenv(PASSWORD_ENV, "wrong")
    with pytest.raises(StoreUnavailable) as refused:
        await open_store(settings)
    text = refused.value.message
    assert "password authentication failed" in text and PASSWORD_ENV in text
    assert "wrong" not in text and "try again" not in text.lower()


def test_a_password_in_the_database_url_is_refused(tmp_path: Path) -> None:
    from bot.models.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        make_settings(tmp_path, database="postgresql://bot:s3cret@127.0.0.1:5432/deploybot")
    assert "DEPLOYBOT_DATABASE_PASSWORD" in refused.value.message
    assert "s3cret" not in refused.value.message
    assert os.environ.get("DEPLOYBOT_DATABASE_PASSWORD") != "s3cret"


async def test_postgres_v16_adds_how_the_host_key_was_confirmed(
    pg_url: str, settings: Settings
) -> None:
    """A database at v15 gains `host_key_source`: its rows (a fingerprint in host_key)
    read back without one; new rows keep the public key line and its source."""
    with pg_connect(pg_url) as conn:
        for step in range(6, 16):
            for statement in schema.STEPS[step]:
                conn.execute(schema._ddl(statement).encode())
        conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '15')")
        conn.execute("INSERT INTO meta (key, value) VALUES ('installation_id', 'i0')")
    old = make_job(settings, "web01", "10.0.0.50", state=JobState.SUCCEEDED)
    old = old.model_copy(update={"host_key": "SHA256:abc"})
    new = make_job(settings, "web02", "10.0.0.51", state=JobState.SUCCEEDED)
    new = new.model_copy(update={"host_key": "ssh-ed25519 AAAAC3", "host_key_source": "agent"})
    store = await Store.open(pg_url, password=PASSWORD)
    try:
        await store.jobs.insert(old)
        await store.jobs.insert(new)
        got_old, got_new = await store.jobs.get(old.id), await store.jobs.get(new.id)
    finally:
        await store.close()
    assert got_old is not None and got_old.host_key_source is None
    assert got_old.known_hosts_line is None  # a fingerprint only: shown as before
    assert got_new is not None and got_new.host_key_source is HostKeySource.AGENT
    assert got_new.known_hosts_line == "web02,10.0.0.51 ssh-ed25519 AAAAC3"
    with pg_connect(pg_url) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )


async def test_postgres_v17_adds_the_host_certificate(pg_url: str, settings: Settings) -> None:
    """A database at v16 gains `host_certificate`: its rows read back without one; a new
    row keeps its certificate line."""
    with pg_connect(pg_url) as conn:
        for step in range(6, 17):
            for statement in schema.STEPS[step]:
                conn.execute(schema._ddl(statement).encode())
        conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '16')")
        conn.execute("INSERT INTO meta (key, value) VALUES ('installation_id', 'i0')")
        old = make_job(settings, "web01", "10.0.0.50", state=JobState.SUCCEEDED)
        row = {k: v for k, v in job_row(old).items() if k != "host_certificate"}
        columns = ", ".join(row)
        marks = ", ".join(["%s"] * len(row))
        conn.execute(f"INSERT INTO jobs ({columns}) VALUES ({marks})", list(row.values()))
    cert = "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQ"
    new = make_job(settings, "web02", "10.0.0.51", state=JobState.SUCCEEDED)
    new = new.model_copy(update={"host_key": "ssh-ed25519 AAAAC3", "host_certificate": cert})
    store = await Store.open(pg_url, password=PASSWORD)
    try:
        await store.jobs.insert(new)
        got_old, got_new = await store.jobs.get(old.id), await store.jobs.get(new.id)
    finally:
        await store.close()
    assert got_old is not None and got_old.host_certificate is None
    assert got_new is not None and got_new.host_certificate == cert
