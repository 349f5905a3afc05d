"""What the next free address and the conflict check cost.

1. Picking (built-in IPAM, simulator, SQLite): the time of one `/deploy NAME` without an
   address, from the request to the recorded job (every request waits for approval,
   so nothing runs), as the subnet fills: at 0, 500 and 1,000 addresses held by jobs,
   with 1,000 VMs built by hand on the hypervisor. Goal: at most 50 ms per pick at
   1,000 held (it reads the held addresses and the backends' lists once per pick).
2. The Proxmox sweep behind the conflict check (the fake API, in this process):
   requests for one `addresses_in_use` with VMs built by hand and VMs this
   installation built. Goal: our own VMs cost no request (their jobs hold their
   addresses); each VM built by hand costs its config read (and an agent read when it
   runs one). Measured (2 cores, while other work ran):

       held  ms/pick         by hand  ours  requests
          0     21.9               0     0         2   (the listing; VM 100's config)
        500     24.5             100     0       102
       1000     29.9               0   400         2
                                 100   400       102

    .venv/bin/python -m benchmarks.bench_ipam          # from the checkout: uses tests/

The sweep runs the fake Proxmox API, which checks every request against the schema in
../shared/reference/pve-api-subset.json: without that folder beside the checkout the
benchmark says so and stops before it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import statistics
import tempfile
import time
from pathlib import Path

from backends.sim import SimBackend
from benchmarks import needs
from benchmarks.keys import BENCH_KEY
from bot.app.runtime import running_deployer
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import make_tls
from tests.support.fakepve.testing import make_backend, start_fake
from tests.support.reference import reference_json

PICK_GOAL_MS = 50.0
HELD = (0, 500, 1000)
BY_HAND = 1000
SWEEP_HAND, SWEEP_OURS = 100, 400


async def picks(
    folder: Path, held: tuple[int, ...] = HELD, by_hand: int = BY_HAND, count: int = 20
) -> list[tuple[int, float]]:
    """(held, median ms per pick over the next `count` picks) at each level of `held`."""
    settings = load_settings(
        BUNDLED_CONFIG,
        database=str(folder / "jobs.db"),
        log_file=str(folder / "bot.log"),
        backends=[{"kind": "sim", "name": "sim"}],
        subnets=[{"name": "big", "cidr": "10.8.0.0/20", "gateway": "10.8.0.1"}],
        approval={"approvers": ["bob"], "always": True},
        defaults={"ssh_keys": [BENCH_KEY]},
    )
    sim = SimBackend("sim")
    for n in range(by_hand):  # built by hand, from the top of the subnet down
        sim.add_vm(f"hand{n}", address=ipaddress.IPv4Address("10.8.15.254") - n)
    rows = []
    async with running_deployer(settings, backends={"sim": sim}) as deployer:
        made = 0
        for level in held:
            while made < level:
                await ask(deployer, f"fill{made}")
                made += 1
            times = []
            for _ in range(count):
                began = time.perf_counter()
                await ask(deployer, f"vm{made}")
                times.append((time.perf_counter() - began) * 1000)
                made += 1
            rows.append((level, statistics.median(times)))
    return rows


async def ask(deployer: object, text: str) -> None:
    from bot.app.service import Deployer

    assert isinstance(deployer, Deployer)
    args = parse(text)
    assert isinstance(args, DeployArgs)
    await deployer.request_deploy(args, "alice")


async def sweeps(
    folder: Path, by_hand: int = SWEEP_HAND, of_ours: int = SWEEP_OURS
) -> list[tuple[int, int, int]]:
    """(VMs built by hand, VMs of ours, requests of one sweep)."""
    schema = ApiSchema(reference_json("pve-api-subset.json"))
    rows = []
    (folder / "tls").mkdir()
    tls = make_tls(folder / "tls")
    for hand, ours in ((0, 0), (by_hand, 0), (0, of_ours), (by_hand, of_ours)):
        async with start_fake(schema, tls) as fake:
            for n in range(hand):
                fake.cluster.add_vm(1000 + n, f"hand{n}", ipconfig0=f"ip={_nth(9, n)}/16")
            for n in range(ours):
                vmid = 5000 + n
                fake.cluster.add_vm(vmid, f"ours{n}", ipconfig0=f"ip={_nth(10, n)}/16")
                fake.cluster.vms[vmid].config["tags"] = f"deploybot-benchinst0-jbench{n:04d}"
            backend = make_backend(fake)
            try:
                await backend.inventory.vms()  # (logged in: only the sweep is counted)
                before = len(fake.requests)
                await backend.addresses_in_use("benchinst0")
                rows.append((hand, ours, len(fake.requests) - before))
            finally:
                await backend.close()
    return rows


def _nth(second: int, n: int) -> str:
    return f"10.{second}.{n // 250}.{n % 250 + 2}"


async def main(args: argparse.Namespace) -> None:
    needs.reference("pve-api-subset.json")  # before anything runs, not after part 1
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        picked = await picks(folder, tuple(args.held), args.by_hand, args.picks)
        swept = await sweeps(folder, args.sweep_hand, args.sweep_ours)
    print(f"next free address (builtin IPAM, {args.by_hand:,} VMs built by hand on the simulator)")
    print(f"{'held':>6}  {'ms/pick':>8}  goal")
    for held, ms in picked:
        print(f"{held:>6}  {ms:>8.1f}  <= {PICK_GOAL_MS:g}")
    print("\nProxmox addresses_in_use (fake API): requests per sweep")
    print(f"{'by hand':>8}  {'ours':>5}  {'requests':>8}  goal (ours cost none)")
    without_ours = {hand: requests for hand, ours, requests in swept if ours == 0}
    for hand, ours, requests in swept:
        print(f"{hand:>8}  {ours:>5}  {requests:>8}  <= {without_ours[hand]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", default=list(HELD))
    parser.add_argument("--by-hand", type=int, default=BY_HAND, help="VMs on the simulator")
    parser.add_argument("--picks", type=int, default=20, help="picks timed at each level")
    parser.add_argument("--sweep-hand", type=int, default=SWEEP_HAND)
    parser.add_argument("--sweep-ours", type=int, default=SWEEP_OURS)
    arguments = parser.parse_args()
    needs.run(lambda: asyncio.run(main(arguments)))
