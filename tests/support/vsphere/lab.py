"""A vcsim lab for trying deploybot by hand: `python -m tests.support.vsphere.lab [DIR]`.

Builds vcsim, starts a vCenter and a standalone ESXi simulator on 127.0.0.1 (each with
an `ubuntu-24.04` template), plays the guests (they report the address their cloud-init
metadata gives them) and their SSH servers (127.0.20.50-59, port 2222), and writes
DIR/deploybot.toml. Then, in another terminal:

    export DEPLOYBOT_CONFIG=DIR/deploybot.toml VCSIM_PASSWORD=anything
    deploybot deploy web01 127.0.20.50 --backend vcenter
    deploybot deploy web02 127.0.20.51 --backend esxi

Everything stays on 127.0.0.0/8. Ctrl-C stops the lab.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.deployer import TEST_KEY as LOGIN_KEY
from tests.support.vsphere.simulator import (
    PASSWORD_ENV,
    TEMPLATE,
    Simulated,
    build_vcsim,
    make_tls,
    simulator,
)

GUESTS = [f"127.0.20.{50 + i}" for i in range(10)]
SSH_PORT = 2222


def backend_toml(lab: Simulated, ca: Path) -> str:
    entry = lab.sim.config(ca_bundle=str(ca))
    lines = ["[[backends]]"]
    for key in ("kind", "name", "host", "port", "user", "password_env", "ca_bundle", "network"):
        if key in entry:
            value = entry[key]
            lines.append(f"{key} = {value}" if isinstance(value, int) else f'{key} = "{value}"')
    return "\n".join(lines)


def write_config(where: Path, vcenter: Simulated, esxi: Simulated, ca: Path) -> Path:
    path = where / "deploybot.toml"
    path.write_text(
        f'database = "{where / "deploybot.db"}"\n'
        f'log_file = "{where / "deploybot.log"}"\n\n'
        f"{backend_toml(vcenter, ca)}\n\n{backend_toml(esxi, ca)}\n\n"
        "[[subnets]]\n"
        'cidr = "127.0.20.0/24"\ngateway = "127.0.20.1"\ndns = ["127.0.20.2"]\n'
        'search_domain = "lab.test"\n\n'
        f'[defaults]\nbackend = "vcenter"\ntemplate = "{TEMPLATE}"\nssh_port = {SSH_PORT}\n'
        f'ssh_keys = ["{LOGIN_KEY}"]\n\n'
        '[approval]\napprovers = ["bob"]\n',
        encoding="utf-8",
    )
    return path


async def serve_sshd() -> None:
    """The guests' sshd: accept, send a banner, close (reachability is the question)."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6 vcsim-lab-guest\r\n")
        writer.close()

    servers = [await asyncio.start_server(greet, address, SSH_PORT) for address in GUESTS]
    try:
        await asyncio.Event().wait()
    finally:
        for server in servers:
            server.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that SIGTERM, too, stops the simulators on the way out


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    where = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="vcsim-lab-"))
    where.mkdir(parents=True, exist_ok=True)
    try:
        binary = build_vcsim(where)
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:
        sys.exit(f"vcsim-lab: {exc}")
    tls = make_tls(where)
    with (
        simulator(binary, tls, where, esx=False) as vcenter,
        simulator(binary, tls, where, esx=True) as esxi,
    ):
        config = write_config(where, vcenter, esxi, tls.ca)
        print(f"vCenter (vcsim) on 127.0.0.1:{vcenter.sim.port}, ESXi on 127.0.0.1:{esxi.sim.port}")
        print(f"guests' sshd on {GUESTS[0]}-{GUESTS[-1].rsplit('.', 1)[1]}:{SSH_PORT}")
        print(f"\n  export DEPLOYBOT_CONFIG={config} {PASSWORD_ENV}=anything")
        print("  deploybot deploy web01 127.0.20.50 --backend vcenter")
        print("  deploybot deploy web02 127.0.20.51 --backend esxi\n\nCtrl-C stops the lab.")
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_sshd())


if __name__ == "__main__":
    main()
