"""A real PostgreSQL (Debian's `postgresql` package) for the tests, started once per run.

The cluster lives in a temporary directory and listens on 127.0.0.1 and a socket there;
fsync is off (a test cluster need not survive a power cut). initdb and the server refuse
to run as root, so as root (CI) they run as the `postgres` user the package creates.
Connections over TCP need the password, which the tests pass the way deploybot is told
it: through the environment (`DEPLOYBOT_DATABASE_PASSWORD`). Each test gets a database
of its own.

Without the server the tests skip, except under DEPLOYBOT_REQUIRE_POSTGRES=1 (CI), where
that is a failure.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

USER = "deploybot"
PASSWORD = "test-only-" + uuid.uuid4().hex[:12]
PASSWORD_ENV = "DEPLOYBOT_DATABASE_PASSWORD"


@dataclass(frozen=True)
class Cluster:
    port: int
    socket_dir: Path

    def url(self, dbname: str) -> str:
        """What a deploybot.toml says: no password in it."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host=str(self.socket_dir),
            port=self.port,
            user=USER,
            dbname="postgres",
            autocommit=True,
        )

    def new_database(self) -> str:
        name = "t_" + uuid.uuid4().hex[:16]
        with self.admin() as conn:
            conn.execute(f"CREATE DATABASE {name}".encode())
        return self.url(name)


def unavailable(reason: str) -> None:
    if os.environ.get("DEPLOYBOT_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_POSTGRES=1 forbids skipping these tests")
    pytest.skip(reason)


def _bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if found:
        return Path(found[0]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


def start_cluster(workdir: Path) -> Cluster:
    bindir = _bindir()
    if bindir is None:
        unavailable("PostgreSQL is not installed (apt-get install postgresql)")
    assert bindir is not None
    workdir.chmod(0o755)
    data, sock = workdir / "data", workdir / "sock"
    sock.mkdir()
    pwfile = workdir / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if os.geteuid() == 0:
        shutil.chown(workdir, "postgres")
        shutil.chown(sock, "postgres")
        shutil.chown(pwfile, "postgres")
    init = [str(bindir / "initdb"), "-D", str(data), "-U", USER, "--pwfile", str(pwfile)]
    init += ["--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync"]
    subprocess.run(_as_server_user(init), check=True, capture_output=True, text=True)
    port = _free_port()
    options = (
        f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
    )
    (workdir / "options").write_text(options)
    start_again(workdir)
    return Cluster(port, sock)


def start_again(workdir: Path) -> None:
    """Start the cluster in `workdir` (made by `start_cluster`), waiting until it serves."""
    bindir = _bindir()
    assert bindir is not None
    options = (workdir / "options").read_text()
    data = workdir / "data"
    start = [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(workdir / "log"), "-w"]
    subprocess.run(
        _as_server_user([*start, "-o", options, "start"]), check=True, capture_output=True
    )


def stop_fast(workdir: Path) -> None:
    """`pg_ctl stop -m fast`: clients' sessions are ended (AdminShutdown), as an operator's
    restart or a failover does."""
    bindir = _bindir()
    assert bindir is not None
    stop = [str(bindir / "pg_ctl"), "-D", str(workdir / "data"), "-m", "fast", "-w", "stop"]
    subprocess.run(_as_server_user(stop), check=True, capture_output=True)


def stop_cluster(workdir: Path) -> None:
    bindir = _bindir()
    if bindir is not None and (workdir / "data").exists():
        stop = [str(bindir / "pg_ctl"), "-D", str(workdir / "data"), "-m", "immediate", "stop"]
        subprocess.run(_as_server_user(stop), capture_output=True)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Cluster]:
    workdir = Path(tempfile.mkdtemp(prefix="deploybot-pg-"))
    try:
        try:
            cluster = start_cluster(workdir)
        except subprocess.CalledProcessError as exc:
            unavailable(f"PostgreSQL did not start: {exc.stderr or exc.stdout}")
        yield cluster
    finally:
        stop_cluster(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def pg_url(pg_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new database's URL, with its password in the environment as deploybot reads it."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    return pg_cluster.new_database()


@pytest.fixture(scope="session")
def stoppable_cluster() -> Iterator[tuple[Cluster, Path]]:
    """A second cluster, once per run, for the tests that stop the database (outages):
    stopping it disturbs none of the tests on `pg_cluster`."""
    workdir = Path(tempfile.mkdtemp(prefix="deploybot-pg-stoppable-"))
    try:
        try:
            cluster = start_cluster(workdir)
        except subprocess.CalledProcessError as exc:
            unavailable(f"PostgreSQL did not start: {exc.stderr or exc.stdout}")
        yield cluster, workdir
    finally:
        stop_cluster(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def stoppable_pg(stoppable_cluster: tuple[Cluster, Path]) -> Iterator[tuple[str, Path]]:
    """A new database's URL on the stoppable cluster, and that cluster's folder (for
    `stop_fast` and `start_again`); a test that failed mid-outage leaves it running."""
    cluster, workdir = stoppable_cluster
    yield cluster.new_database(), workdir
    if not (workdir / "data" / "postmaster.pid").exists():
        start_again(workdir)
