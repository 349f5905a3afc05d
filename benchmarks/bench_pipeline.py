"""Bot overhead on the simulator: wall time against the hypervisor's own time.

Runs 1, 10 and 50 concurrent deploys on the simulator (real SQLite file, real queue and
pipeline), and prints per run: wall time, the simulated hypervisor time on one deploy's
critical path, their ratio (1.00 = the bot adds nothing), the worst event-loop stall
seen by a 5 ms ticker, store writes per deploy, and peak Python memory.

    .venv/bin/python -m benchmarks.bench_pipeline [--time-scale 0.2] [--counts 1 10 50 200]

`make bench` runs it. It needs nothing beyond the checkout (no ../shared/reference).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import tracemalloc
from pathlib import Path

from backends.sim import SimBackend
from backends.sim.vm import SimTiming
from benchmarks.keys import BENCH_KEY
from benchmarks.stall import ticker
from bot.app.runtime import running_deployer
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models import JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs

GOALS = {50: "<=1.05", 200: "<=1.05"}  # the ratio wanted at these sizes (issue 10)


def critical_path_s(timing: SimTiming, scale: float) -> float:
    t = timing
    return (t.clone_linked_s + t.config_s + t.start_s + t.boot_s + t.sshd_s) * scale


async def run(count: int, scale: float, tmp: Path) -> tuple[float, float, float, int, int]:
    settings = load_settings(
        BUNDLED_CONFIG,
        database=str(tmp / f"bench-{count}.db"),
        log_file=str(tmp / "bench.log"),
        limits={"max_running": count, "max_running_per_backend": count},
        approval={},
        defaults={"backend": "sim", "ssh_keys": [BENCH_KEY]},
    )
    timing = SimTiming()
    sim = SimBackend("sim", time_scale=scale, timing=timing)
    worst = [0.0]
    stop = asyncio.Event()
    async with running_deployer(settings, backends={"sim": sim}) as deployer:
        tick = asyncio.create_task(ticker(worst, stop))
        started = time.perf_counter()
        jobs = []
        for i in range(count):
            args = parse(f"bench{i} 10.0.0.{10 + i}")
            assert isinstance(args, DeployArgs)
            jobs.append(await deployer.request_deploy(args, "bench"))
        await deployer.drain()
        wall = time.perf_counter() - started
        stop.set()
        await tick
        infos = [await deployer.status(j.id) for j in jobs]
        states = {info.job.state for info in infos}
        assert states == {JobState.SUCCEEDED}, states
        events = sum(len(info.events) for info in infos)
    return wall, critical_path_s(timing, scale), worst[0], events // count, len(sim.vms)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 10, 50, 200])
    args = parser.parse_args()
    print(f"simulator time scale {args.time_scale} (1.0 = realistic durations)")
    print("wall and ratio from a run without tracemalloc; peak memory from a second run")
    print(
        f"{'deploys':>8} {'wall s':>8} {'hv s':>7} {'ratio':>6} {'worst stall ms':>15} "
        f"{'goal':>6} {'events/deploy':>14} {'peak MiB':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for sub in ("t", "m"):  # the settings check that the log's folder exists
            (Path(tmp) / sub).mkdir()
        for count in args.counts:
            # tracemalloc slows every allocation (at 50 deploys it made the ratio 1.39
            # instead of 1.12), so time and memory are measured in separate runs.
            wall, hv, stall, events, vms = await run(count, args.time_scale, Path(tmp) / "t")
            assert vms == count
            tracemalloc.start()
            await run(count, args.time_scale, Path(tmp) / "m")
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            print(
                f"{count:>8} {wall:>8.2f} {hv:>7.2f} {wall / hv:>6.2f} {stall * 1000:>15.1f} "
                f"{GOALS.get(count, ''):>6} {events:>14} {peak:>9.1f}"
            )


if __name__ == "__main__":
    asyncio.run(main())
