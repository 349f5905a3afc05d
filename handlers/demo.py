"""`deploybot demo`: a scripted chat on the simulator, start to finish.

Alice asks for web01 and is told to save her SSH key first; she does and asks again,
Bob approves, the thread shows every step and ends with the SSH line, the host key and
its certificate (a host CA made for the demo and thrown away after it), and `/deploy
ssh-ca` prints the known_hosts line that trusts it. Then the simulator is told to fail
the next power-on: Alice's second deploy, into a second subnet (asked without an
address, it gets the next free one of `lab20`, whose VMs go on another segment: bridge
vmbr1, VLAN 20), fails, is rolled back, and the thread says what was removed. It uses
the bundled configuration with an approval rule, whatever deploybot.toml says, so it
runs the same everywhere.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TextIO

import asyncssh

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models import JobState
from bot.sshca.authority import HostCA, default_patterns
from handlers.terminal import Shell, TerminalThread

# The bundled subnet and a second one on another segment of the simulator: each
# subnet says where its VMs' NICs go (docs/networks.md).
DEMO_SUBNETS = [
    {
        "name": "lab",
        "cidr": "10.0.0.0/24",
        "gateway": "10.0.0.1",
        "dns": ["10.0.0.2", "10.0.0.3"],
        "search_domain": "lab.example",
        "pool": "10.0.0.100-10.0.0.199",
        "segments": {"sim": {"bridge": "vmbr0"}},
    },
    {
        "name": "lab20",
        "cidr": "10.0.20.0/24",
        "gateway": "10.0.20.1",
        "dns": ["10.0.0.2", "10.0.0.3"],
        "search_domain": "lab.example",
        "pool": "10.0.20.100-10.0.20.199",
        "segments": {"sim": {"bridge": "vmbr1", "vlan": 20}},
    },
]

# Alice's public key (a public key is no secret; nobody holds its private half).
DEMO_KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 alice@laptop"
)


async def run_demo(time_scale: float = 1.0, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="deploybot-demo-") as tmp:
        settings = load_settings(
            BUNDLED_CONFIG,
            database=str(Path(tmp) / "demo.db"),
            log_file=str(Path(tmp) / "demo.log"),
            approval={"approvers": ["bob"], "always": True},
            subnets=DEMO_SUBNETS,
        )
        sim = SimBackend("sim", time_scale=time_scale)
        thread = TerminalThread(out)
        # A host CA of its own, in memory only: never the configured one.
        key = asyncssh.generate_private_key("ssh-ed25519")
        ca = HostCA(key, default_patterns(settings), 365, "a key made for this demo")
        async with running_deployer(
            settings, thread, backends={"sim": sim}, host_ca=ca
        ) as deployer:
            shell = Shell(deployer, "alice", out)

            async def say(user: str, text: str) -> None:
                out.write(f"{user}> {text}\n")
                shell.user = user
                await shell.handle(text)

            async def latest_job_id() -> str:
                return (await deployer.history(1))[0].id

            await say("alice", "/deploy web01 10.0.0.50")  # refused: no key to log in with
            await say("alice", f"/deploy key {DEMO_KEY}")
            await say("alice", "/deploy web01 10.0.0.50")
            first = await latest_job_id()
            await say("bob", f"approve {first}")
            await deployer.drain()
            await say("alice", "/deploy ssh-ca")

            out.write("\n# The simulator is told to fail the next power-on.\n\n")
            sim.inject("power_on", "error")
            # No address: the next free one of lab20's pool, on its own segment.
            await say("alice", "/deploy web02 subnet=lab20 mem=4G disk=+10G")
            second = await latest_job_id()
            await say("bob", f"approve {second}")
            await deployer.drain()
            await say("alice", "/deploy history")

            ok = (await deployer.status(first)).job.state is JobState.SUCCEEDED
            rolled_back = (await deployer.status(second)).job.state is JobState.FAILED
            left = [vm.name for vm in sim.vms.values()]
        out.write(f"\nVMs on the simulator now: {', '.join(left) or 'none'}\n")
        return 0 if ok and rolled_back and left == ["web01"] else 1
