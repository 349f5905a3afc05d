"""The processes behind the `netbox` fixture: a Redis, NetBox's database, and gunicorn.

Everything listens on 127.0.0.1 and lives in one temporary folder (NETBOX_ROOT: NetBox's
configuration, its media and static folders, the logs). The database is a database in the
tests' own PostgreSQL cluster (tests/support/postgres.py), so the run starts no second
PostgreSQL.

`netbox migrate` takes minutes (7 on a busy 2-core machine), so it runs at most once: its
result is kept as a pg_dump file next to the venv, keyed by NetBox's version and
PostgreSQL's major version, and later runs restore that in about a second. Users and tokens
are made after the restore, in each run, with secrets of that run.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.netbox import install
from tests.support.postgres import PASSWORD, USER, Cluster, _bindir

DATABASE = "netbox"
START_DEADLINE_S = 240.0  # importing NetBox takes 15-30 s on a loaded 2-core machine
STOP_GRACE_S = 1.0

# Made through Django's ORM (`netbox shell -c`), as NetBox's own UI would: a superuser with
# a write token, and a user who may only view IPAM objects, with a token that cannot write.
MAKE_USERS = """
import json
from core.models import ObjectType
from users.models import ObjectPermission, Token, User
admin = User.objects.create_superuser('admin', 'admin@example.invalid', {password!r})
write = Token(user=admin, write_enabled=True, description='deploybot tests')
write.save()
reader = User.objects.create_user('reader', 'reader@example.invalid', {password!r})
view = ObjectPermission.objects.create(name='view ipam', actions=['view'])
view.object_types.set(ObjectType.objects.filter(app_label='ipam'))
view.users.add(reader)
read = Token(user=reader, write_enabled=False, description='deploybot tests, read-only')
read.save()
print(json.dumps({{'write': f'nbt_{{write.key}}.{{write.token}}',
                  'read': f'nbt_{{read.key}}.{{read.token}}'}}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


def wait_until(ready: Callable[[], bool], alive: Callable[[], bool], deadline_s: float) -> bool:
    """Poll `ready` until it holds; False once the process is dead or time is up."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if ready():
            return True
        if not alive():
            return False
        time.sleep(0.1)  # polling a readiness condition, not synchronising a test
    return False


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the process group (gunicorn's quick shutdown: it closes its socket and its
    workers exit at once; Redis saves nothing here), then SIGKILL to whatever is left.
    gunicorn's master lingers 3-5 s after its workers are gone; nothing is lost by not
    waiting for it, and a test that stops NetBox should not pay for it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A Redis for this run only: no persistence, on a free 127.0.0.1 port."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / "redis.log")]
    proc = subprocess.Popen(argv, start_new_session=True)

    def pong() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    if not wait_until(pong, lambda: proc.poll() is None, 30):
        stop_process(proc)
        raise RuntimeError(f"redis-server did not start:\n{log_tail(workdir / 'redis.log')}")
    return proc, port


def write_configuration(root: Path, cluster: Cluster, redis_port: int) -> None:
    """NETBOX_ROOT/conf/configuration.py, where a pip-installed NetBox looks for it."""
    redis = {"HOST": "127.0.0.1", "PORT": redis_port, "SSL": False}
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE,
        "USER": USER,
        "PASSWORD": PASSWORD,
        "HOST": "127.0.0.1",
        "PORT": cluster.port,
        "CONN_MAX_AGE": 300,
    }
    # Errors (a 500's traceback among them) go to stderr, which is the log file.
    logging = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"stderr": {"class": "logging.StreamHandler"}},
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }
    settings = {
        "ALLOWED_HOSTS": ["127.0.0.1", "localhost"],
        "DATABASES": {"default": database},
        "REDIS": {"tasks": {**redis, "DATABASE": 0}, "caching": {**redis, "DATABASE": 1}},
        "SECRET_KEY": secrets.token_urlsafe(48),
        "API_TOKEN_PEPPERS": {1: secrets.token_urlsafe(48)},
        # Nothing may leave loopback: no census report, no release check.
        "CENSUS_REPORTING_ENABLED": False,
        "RELEASE_CHECK_URL": None,
        "LOGGING": logging,
    }
    conf = root / "conf"
    conf.mkdir(parents=True)
    (conf / "__init__.py").write_text("")
    text = (
        "# Written by tests/support/netbox/server.py for one test run: its secrets are test-only.\n"
    )
    text += "".join(f"{name} = {value!r}\n" for name, value in settings.items())
    (conf / "configuration.py").write_text(text)


class Server:
    """NetBox's processes and files for one test run; gunicorn can stop and start again."""

    def __init__(self, workdir: Path, cluster: Cluster) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.root = workdir / "root"
        self.log = workdir / "netbox.log"
        self.venv = install.venv_dir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis: subprocess.Popen[bytes] | None = None
        self.gunicorn: subprocess.Popen[bytes] | None = None
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        self.env["NETBOX_ROOT"] = str(self.root)

    def run(self, *args: str, log_output: bool = True) -> str:
        """A NetBox management command (the `netbox` console script is manage.py); its
        output goes to the log too unless it holds secrets."""
        argv = [str(self.venv / "bin" / "netbox"), *args]
        with self.log.open("ab") as log:
            done = subprocess.run(argv, env=self.env, stdout=subprocess.PIPE, stderr=log)
            if log_output:
                log.write(done.stdout)
        if done.returncode != 0:
            raise RuntimeError(f"netbox {args[0]} failed:\n{log_tail(self.log)}")
        return done.stdout.decode()

    def prepare(self) -> dict[str, str]:
        """Redis, configuration, migrated database, users: the tokens by name."""
        self.redis, redis_port = start_redis(self.workdir)
        write_configuration(self.root, self.cluster, redis_port)
        self._database()
        password = secrets.token_urlsafe(24)
        make_users = MAKE_USERS.format(password=password)
        out = self.run("shell", "--no-imports", "-c", make_users, log_output=False)
        tokens: dict[str, str] = json.loads(out.strip().splitlines()[-1])
        return tokens

    def dump_path(self) -> Path:
        bindir = _bindir()
        assert bindir is not None
        return install.cache_dir() / f"db-pg{bindir.parent.name}.dump"

    def _database(self) -> None:
        bindir = _bindir()
        assert bindir is not None
        conn = ["-h", str(self.cluster.socket_dir), "-p", str(self.cluster.port), "-U", USER]
        with self.cluster.admin() as admin:
            admin.execute(f"CREATE DATABASE {DATABASE}".encode())
        dump = self.dump_path()
        if dump.exists():
            restore = [str(bindir / "pg_restore"), *conn, "-d", DATABASE, "--no-owner"]
            restore += ["--exit-on-error", "-j", "2", str(dump)]
            with self.log.open("ab") as log:
                done = subprocess.run(restore, stdout=log, stderr=log)
            if done.returncode == 0:
                return
            # A dump this PostgreSQL cannot read is not worth failing for: migrate again.
            dump.unlink(missing_ok=True)
            with self.cluster.admin() as admin:
                admin.execute(f"DROP DATABASE {DATABASE}".encode())
                admin.execute(f"CREATE DATABASE {DATABASE}".encode())
        self.run("migrate", "--no-input")
        partial = dump.with_suffix(f".{os.getpid()}.partial")
        subprocess.run(
            [str(bindir / "pg_dump"), *conn, "-Fc", "-Z1", "-f", str(partial), DATABASE],
            check=True,
        )
        os.replace(partial, dump)  # whole or not at all, should two runs race

    def start(self) -> None:
        """gunicorn on the same port every time; returns once /api/status/ answers."""
        if self.gunicorn is not None and self.gunicorn.poll() is None:
            return
        argv = [str(self.venv / "bin" / "gunicorn"), "netbox.wsgi", "--preload"]
        argv += ["--bind", f"127.0.0.1:{self.port}", "--workers", "2", "--threads", "2"]
        argv += ["--chdir", str(self.workdir), "--no-control-socket", "--timeout", "120"]
        argv += ["--access-logfile", "-", "--error-logfile", "-"]
        with self.log.open("ab") as log:
            log.write(f"--- starting gunicorn on {self.url}\n".encode())
            self.gunicorn = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = self.gunicorn
        if not wait_until(self._answers, lambda: proc.poll() is None, START_DEADLINE_S):
            self.stop()
            raise RuntimeError(f"NetBox did not answer on {self.url}:\n{log_tail(self.log)}")

    def _answers(self) -> bool:
        # Without a token NetBox answers 403: the server is up, which is all this asks.
        try:
            urllib.request.urlopen(f"{self.url}/api/status/", timeout=5).close()
            return True
        except urllib.error.HTTPError as exc:
            return exc.code == 403
        except OSError:
            return False

    def running(self) -> bool:
        return self.gunicorn is not None and self.gunicorn.poll() is None

    def pids(self) -> list[int]:
        """gunicorn's master, its workers and Redis (for measuring their memory)."""
        found = [p.pid for p in (self.gunicorn, self.redis) if p is not None and p.poll() is None]
        for pid in list(found):
            children = Path(f"/proc/{pid}/task/{pid}/children")
            if children.exists():
                found += [int(c) for c in children.read_text().split()]
        return found

    def stop(self) -> None:
        if self.gunicorn is not None:
            stop_process(self.gunicorn)
            with self.log.open("ab") as log:
                log.write(b"--- gunicorn stopped\n")

    def close(self) -> None:
        self.stop()
        if self.redis is not None:
            stop_process(self.redis)
