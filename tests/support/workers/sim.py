"""A separate process on a shared simulator state file, for tests/test_sim_shared.py.

python -m tests.support.workers.sim churn STATE WORKER COUNT
    after a line on stdin (so all start together): COUNT times, deploy a VM
    (prepare, clone, identity, power on) and print "made ID NAME"; every other one
    is then stopped and destroyed ("destroyed ID"), the rest kept ("kept ID")
python -m tests.support.workers.sim hold STATE
    take the state file's lock, print "holding", and keep it until killed
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from backends.base import CloneSpec
from backends.sim import SimBackend
from backends.sim.state import SharedState, new_owner
from tests.support.contract import IDENTITY


def say(*words: object) -> None:
    print(*words, flush=True)


async def churn(state: Path, worker: str, count: int) -> None:
    sim = SimBackend(time_scale=0.0001, state_file=state)
    sys.stdin.readline()
    try:
        for i in range(count):
            name = f"{worker}-{i:03d}"
            spec = CloneSpec(f"j{worker}{i:03d}", name, "ubuntu-24.04")
            ref = await sim.prepare_clone(spec)
            await sim.clone(spec, ref)
            say("made", ref.vm_id, name)
            await sim.apply_identity(ref, IDENTITY)
            await sim.power_on(ref)
            if i % 2:
                await sim.power_off(ref)
                await sim.destroy(ref)
                say("destroyed", ref.vm_id)
            else:
                say("kept", ref.vm_id)
    finally:
        await sim.close()


def hold(state: Path) -> None:
    with SharedState(state, new_owner()).locked():
        say("holding")
        sys.stdin.readline()  # until killed (or told)


def main(argv: list[str]) -> None:
    if argv[0] == "churn":
        asyncio.run(churn(Path(argv[1]), argv[2], int(argv[3])))
    elif argv[0] == "hold":
        hold(Path(argv[1]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
