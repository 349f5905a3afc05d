"""A real NetBox (PyPI's `netbox`, the pinned version in tests/support/netbox/install.py) for the
tests, started once per run: the `netbox` fixture.

deploybot asks NetBox for addresses; a stand-in would answer what we think NetBox answers,
so these tests run the application itself: gunicorn serving NetBox, a Redis of its own, and
a database in the tests' PostgreSQL cluster, all on 127.0.0.1 (tests/support/netbox/server.py).
`make netbox` installs it (network needed); without it the tests skip, except under
DEPLOYBOT_REQUIRE_NETBOX=1 (CI), where that is a failure.

The objects tests make live in NetBox's database only: nothing connects to those addresses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pynetbox
import pytest
import requests

from tests.support.netbox import install
from tests.support.netbox.server import Server, log_tail
from tests.support.postgres import Cluster

# What reset_ipam() empties, in an order NetBox's protections allow (an address before
# its VRF, a prefix before its VLAN, everything before the tags on it); the custom
# fields too (a VLAN field one test makes is one another test must not find).
IPAM_ENDPOINTS = (
    "ipam/ip-addresses",
    "extras/custom-fields",
    "ipam/ip-ranges",
    "ipam/prefixes",
    "ipam/vrfs",
    "ipam/vlans",
    "extras/tags",
)


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("DEPLOYBOT_REQUIRE_NETBOX") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_NETBOX=1 forbids skipping these tests")
    pytest.skip(reason)


@dataclass
class NetBox:
    """A running NetBox, as a test sees it.

    `token` belongs to a superuser and may write; `read_only_token` to a user who may only
    view IPAM objects, and the token itself cannot write (a create is refused: 403);
    `invalid_token` is well formed (v2, "nbt_<key>.<secret>") but unknown (403 on any call).
    """

    url: str
    token: str
    read_only_token: str
    invalid_token: str
    log_path: Path
    _server: Server = field(repr=False)

    def api(self, token: str | None = None) -> Any:
        """A pynetbox client (pynetbox has no type hints, hence Any)."""
        return pynetbox.api(self.url, token=self.token if token is None else token)

    def headers(self, token: str | None = None) -> dict[str, str]:
        """What pynetbox sends for a v2 token, for tests that use plain HTTP."""
        return {
            "Authorization": f"Bearer {self.token if token is None else token}",
            "Accept": "application/json",
        }

    def stop(self) -> None:
        """Take NetBox away (gunicorn ends; connections to the port are refused). The
        database and Redis stay, so start() brings back the same data."""
        self._server.stop()

    def start(self) -> None:
        """Serve again on the same port; returns once the API answers (no migration)."""
        self._server.start()

    @property
    def running(self) -> bool:
        return self._server.running()

    def pids(self) -> list[int]:
        """The processes (gunicorn master and workers, Redis), for measurements."""
        return self._server.pids()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def reset_ipam(self) -> None:
        """Delete every IP address, custom field, IP range, prefix, VRF, VLAN and tag,
        through the API with bulk deletes, so that a test does not see what an earlier one
        made."""
        with requests.Session() as http:
            http.headers.update(self.headers())
            for endpoint in IPAM_ENDPOINTS:
                while True:
                    url = f"{self.url}/api/{endpoint}/"
                    listed = http.get(url, params={"brief": 1, "limit": 1000}, timeout=60)
                    listed.raise_for_status()
                    ids = [{"id": item["id"]} for item in listed.json()["results"]]
                    if not ids:
                        break
                    http.delete(url, json=ids, timeout=60).raise_for_status()


@pytest.fixture(scope="session")
def netbox(request: pytest.FixtureRequest) -> Iterator[NetBox]:
    """A running NetBox for the whole run; see NetBox for what a test gets."""
    if not install.installed():
        unavailable(f"NetBox {install.VERSION} is not installed (make netbox)")
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not installed (apt-get install redis-server)")
    try:
        cluster: Cluster = request.getfixturevalue("pg_cluster")
    except pytest.skip.Exception as exc:
        unavailable(f"NetBox needs PostgreSQL: {exc}")
    workdir = Path(tempfile.mkdtemp(prefix="deploybot-netbox-"))
    server = Server(workdir, cluster)
    try:
        try:
            tokens = server.prepare()
            server.start()
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            unavailable(f"NetBox did not start: {exc}\n{log_tail(server.log)}")
        yield NetBox(
            url=server.url,
            token=tokens["write"],
            read_only_token=tokens["read"],
            # Well formed (v2), but NetBox has no such key.
            invalid_token="nbt_" + "x" * 12 + "." + "y" * 40,
            log_path=server.log,
            _server=server,
        )
    finally:
        server.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def clean_netbox(netbox: NetBox) -> NetBox:
    """The session's NetBox, running (an earlier test may have stopped it) and with no
    IPAM objects left from earlier tests."""
    if not netbox.running:
        netbox.start()
    netbox.reset_ipam()
    return netbox
