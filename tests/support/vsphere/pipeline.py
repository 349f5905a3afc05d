"""A deployer on vcsim: settings, a guest's SSH server, one deploy, a cloned VM."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from backends.base import CloneSpec, Identity, VMRef
from backends.vsphere import VSphereBackend
from bot.app.runtime import make_backend, running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import Job
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder, make_settings
from tests.support.vsphere.simulator import PASSWORD, PASSWORD_ENV, TEMPLATE, Simulated


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
    """The guests' SSH servers: listeners on their loopback addresses, one shared port."""

    def __init__(self) -> None:
        self.accepted: Counter[str] = Counter()
        self.servers: list[asyncio.Server] = []
        self.port = 0

    async def listen(self, *addresses: str) -> None:
        for address in addresses:
            server = await asyncio.start_server(self._greet(address), address, self.port)
            self.port = self.port or server.sockets[0].getsockname()[1]
            self.servers.append(server)

    def _greet(self, address: str) -> Any:
        async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted[address] += 1
            writer.write(b"SSH-2.0-OpenSSH_9.6 vcsim-guest\r\n")
            writer.close()

        return greet

    async def close(self) -> None:
        for server in self.servers:
            server.close()
            await server.wait_closed()


def vsphere_settings(tmp_path: Path, sim: Simulated, sshd: Sshd, **overrides: Any) -> Settings:
    entry = sim.sim.config()
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
