"""What the real-guest deploy tests share: the real `deploybot` CLI run against the fake
Proxmox with real guests (`tests/support/fakepve/realvm.py`), a login through the fake's jump
host with the deploy's key, and the checks that a rolled-back VM left nothing behind.

Nothing here leaves loopback: 10.0.0.x exist only inside QEMU's restricted user-mode
networks and are reached only through the jump host on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from tests.support.fakepve.realvm import RealMachines
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import config_text, run_deploybot

TEMPLATE, LOGIN = "debian-12", "deploy"
DEADLINE_S = 480.0  # per step that waits for a guest (TCG on 2 busy cores)


@dataclass
class Deploy:
    name: str
    address: str
    returncode: int
    output: str
    seconds: float
    state: Path  # its config, database and log

    @property
    def vmid(self) -> int:
        found = re.search(r"VM (\d+) on pve1", self.output)
        assert found, self.output
        return int(found.group(1))

    @property
    def host_key(self) -> str:
        found = re.search(r"host key (SHA256:[A-Za-z0-9+/=]+)", self.output)
        assert found, self.output
        return found.group(1)


def write_config(
    fake: FakePVE,
    state: Path,
    public_key: str,
    timeouts: dict[str, float] | None = None,
    extra_toml: str = "",
    segments: bool = False,
) -> Path:
    """The config the fake writes for its demo, with the test's key and roomy timeouts
    (or `timeouts`, for the steps named there), and `extra_toml` (more tables) at its end;
    with `segments`, each subnet's segment on pve and the second lab subnet, lab20."""
    text = config_text(fake, state, None, segments=segments)
    text = re.sub(r"(?m)^ssh_keys = .*$", f'ssh_keys = ["{public_key}"]', text)
    steps = {"power_on_s": DEADLINE_S, "address_s": DEADLINE_S, "ssh_s": DEADLINE_S}
    steps |= timeouts or {}
    text += "\n[timeouts]\n" + "".join(f"{k} = {v}\n" for k, v in steps.items())
    text += extra_toml
    path = state / "deploybot.toml"
    path.write_text(text, encoding="utf-8")
    return path


async def deploy(
    fake: FakePVE,
    root: Path,
    public: str,
    name: str,
    address: str,
    *options: str,
    timeouts: dict[str, float] | None = None,
    extra_toml: str = "",
    segments: bool = False,
) -> Deploy:
    """`deploybot deploy NAME ADDRESS template=debian-12 user=deploy OPTIONS...`."""
    state = root / name
    state.mkdir()
    began = time.monotonic()
    returncode, output = await run_deploybot(
        fake, write_config(fake, state, public, timeouts, extra_toml, segments), state,
        "deploy", name, address, f"template={TEMPLATE}", f"user={LOGIN}", *options,
        "--backend", "pve", "--user", "alice",
    )  # fmt: skip
    return Deploy(name, address, returncode, output, time.monotonic() - began, state)


async def login(
    fake: FakePVE, key: asyncssh.SSHKey, address: str
) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientConnection]:
    """Through the jump host (as `ssh -J` would) to ADDRESS:22 with the deploy's key.
    The deploy ends once sshd shows its host key; the key to log in with is there
    before sshd starts (cloud-init's init stage), so this polls only against a
    transient refusal, within the deadline."""
    assert fake.jump is not None
    jump = fake.jump
    deadline = time.monotonic() + DEADLINE_S
    while True:
        bastion = await asyncssh.connect(
            jump.host,
            jump.port,
            username=jump.user,
            client_keys=[str(jump.key_file)],
            known_hosts=str(jump.known_hosts),
        )
        try:
            guest = await asyncssh.connect(
                address,
                22,
                tunnel=bastion,
                username=LOGIN,
                client_keys=[key],
                known_hosts=None,  # compared with the printed fingerprint by the caller
                server_host_key_algs=["ssh-ed25519"],  # what `ssh` shows first
                connect_timeout=30,
            )
            return bastion, guest
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            bastion.close()
            if time.monotonic() > deadline:
                raise AssertionError(f"no SSH login to {address}: {exc!r}") from exc
        await asyncio.sleep(2.0)  # between polls of a condition bound by `deadline`


async def out(conn: asyncssh.SSHClientConnection, command: str) -> str:
    result = await conn.run(command, check=True, timeout=DEADLINE_S)
    return str(result.stdout).strip()


async def known_hosts_line(fake: FakePVE, deploy: Deploy) -> str:
    """The known_hosts line the deploy's job recorded, as `deploybot known-hosts NAME`
    prints it (with the deploy's own config and database)."""
    returncode, output = await run_deploybot(
        fake, deploy.state / "deploybot.toml", deploy.state, "known-hosts", deploy.name
    )
    assert returncode == 0, output
    lines = [line for line in output.splitlines() if line.startswith(f"{deploy.name},")]
    assert len(lines) == 1, output
    return lines[0]


def assert_gone(fake: FakePVE, machines: RealMachines, vmid: int) -> None:
    """No VM, no QEMU process, no disk or seed left."""
    assert vmid not in fake.cluster.vms
    assert vmid not in machines.machines
    assert process_ended(machines.pids[vmid])  # it did boot
    assert not machines.folder(vmid).exists()


def process_ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (QEMU daemonized: init's child)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ")[1].startswith(("Z", "X"))
