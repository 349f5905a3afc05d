"""A deployer on vcsim: settings, a guest's SSH server, one deploy, a cloned VM."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import asyncssh

from backends.base import CloneSpec, Identity, VMRef
from backends.vsphere import VSphereBackend
from bot.app.runtime import make_backend, running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import Job
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder, make_settings
from tests.support.vsphere.simulator import (
    PASSWORD,
    PASSWORD_ENV,
    TEMPLATE,
    GuestAgent,
    Simulated,
)


async def cloned(
    backend: VSphereBackend,
    name: str = "web01",
    job: str = "jvs0001",
    identity: Identity | None = None,
    template: str = TEMPLATE,
) -> VMRef:
    spec = CloneSpec(job, name, template, identity=identity)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    return ref


SUBNET = {
    "cidr": "127.0.20.0/24",
    "gateway": "127.0.20.1",
    "dns": ["127.0.20.2"],
    "search_domain": "lab.test",
}


# Generous: 20 deploys share one simulator. Failing tests shorten the step they fail.
TIMEOUTS = {
    **dict.fromkeys(
        ("check_free_s", "clone_s", "identity_s", "resize_s", "power_on_s", "address_s"), 30.0
    ),
    **dict.fromkeys(("ssh_s", "power_off_s", "destroy_s"), 30.0),
    "retry_initial_s": 0.05,
    "retry_max_s": 0.2,
}


class Sshd:
    """The guests' SSH servers: listeners on their loopback addresses, one shared port.
    A guest that booted with a host key in its cloud-config (deploybot's chosen key,
    read from guestinfo by the guest agent, `guests`) answers with a real SSH key
    exchange presenting that key, as its sshd would; others only send a banner. An
    address in `impostors` answers with that private key instead, whatever booted there
    (another host on the address: a stale VM, a wrong VLAN, an interceptor)."""

    def __init__(self) -> None:
        self.accepted: Counter[str] = Counter()
        self.impostors: dict[str, str] = {}  # address -> the OpenSSH private key it presents
        self.listeners: list[socket.socket] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.guests: GuestAgent | None = None  # set by vsphere_settings

    async def listen(self, *addresses: str) -> None:
        for address in addresses:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, self.port))
            sock.listen(64)
            sock.setblocking(False)
            self.port = self.port or sock.getsockname()[1]
            self.listeners.append(sock)
            self._spawn(self._accept(sock, address))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _accept(self, sock: socket.socket, address: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _peer = await loop.sock_accept(sock)
            self.accepted[address] += 1
            self._spawn(self._answer(conn, address))

    async def _answer(self, conn: socket.socket, address: str) -> None:
        key = self._chosen_key(address)
        if key is None:
            with contextlib.suppress(OSError):
                await asyncio.get_running_loop().sock_sendall(
                    conn, b"SSH-2.0-OpenSSH_9.6 vcsim-guest\r\n"
                )
            conn.close()
            return
        with contextlib.suppress(Exception):  # the check leaves after the key exchange
            server = await asyncssh.run_server(
                conn, server_host_keys=[asyncssh.import_private_key(key)]
            )
            await server.wait_closed()

    def _chosen_key(self, address: str) -> str | None:
        if address in self.impostors:
            return self.impostors[address]
        if self.guests is None:
            return None
        for booted in list(self.guests.booted.values()):
            if booted.address == address:
                key = (booted.userdata.get("ssh_keys") or {}).get("ed25519_private")
                return str(key) if key else None
        return None

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sock in self.listeners:
            sock.close()


def vsphere_settings(tmp_path: Path, sim: Simulated, sshd: Sshd, **overrides: Any) -> Settings:
    entry = sim.sim.config()
    sshd.guests = sim.guests  # guests answer with the host key they booted with
    data: dict[str, Any] = {
        "backends": [entry],
        "subnets": [SUBNET],
        "defaults": {"backend": entry["name"], "template": TEMPLATE, "ssh_port": sshd.port},
        "timeouts": TIMEOUTS,
        "limits": {"max_running": 20, "max_running_per_backend": 20},
    }
    return make_settings(tmp_path, **{**data, **overrides})


@contextlib.asynccontextmanager
async def deployer_for(
    settings: Settings, recorder: Recorder | None = None
) -> AsyncIterator[tuple[Deployer, VSphereBackend]]:
    """The real wiring: the backend from its module's `create`, the password from the
    environment it is given."""
    (config,) = settings.backends
    backend = make_backend(config, {PASSWORD_ENV: PASSWORD})
    assert isinstance(backend, VSphereBackend)
    async with running_deployer(
        settings, recorder or Recorder(), backends={config.name: backend}, grace_s=30
    ) as deployer:
        yield deployer, backend


async def deploy(deployer: Deployer, text: str) -> Job:
    args = parse(text)
    assert isinstance(args, DeployArgs)
    job = await deployer.request_deploy(args, "alice")
    await deployer.drain()
    final = (await deployer.status(job.id)).job
    assert final.state.final
    return final
