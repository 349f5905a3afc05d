"""Slack delivery under load: how soon a requester sees the SSH line.

Starts N deploys together in one channel (all asked by one person, the worst case for
their direct messages) against the fake Slack Web API, which enforces Slack's one post
per second per channel and counts every post that comes too soon. For each deploy it
measures the time from the job becoming ready (the store's transition, seen by a
progress listener) to the first Slack message that shows its SSH line, in the thread
or by direct message, and prints p50, p99 and the worst with the goal beside them.
The channel's own backlog (a parent and replies per deploy at one post per second)
takes minutes to drain; the measurement ends when every SSH line has been seen.

    .venv/bin/python -m benchmarks.bench_slack_delivery [--deploys 200]

The fake Slack checks calls against ../shared/reference/slack-methods.json: without
that folder beside the checkout the benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from backends.sim import SimBackend
from benchmarks import needs
from benchmarks.keys import BENCH_KEY
from bot.models import Job, JobState, RollbackReport
from bot.runtime import running_deployer
from bot.settings import BUNDLED_CONFIG, load_settings
from handlers.slack.app import SlackBot, make_client
from handlers.slack.threads import SlackThreads
from tests.fake_slack import FakeSlack
from tests.slack_support import ALICE, BOT_TOKEN, CHANNEL, SIGNING_SECRET, Harness, new_fake

GOAL_P99_S = 10.0


class ReadyTimes:
    """A progress listener that notes when each job became ready (monotonic clock, as
    the fake Slack records its calls)."""

    def __init__(self) -> None:
        self.ready: dict[str, tuple[float, str]] = {}  # job id -> (when, its SSH line)

    async def job_updated(self, job: Job, note: str = "") -> None:
        pass

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        pass

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        pass

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        if job.state is JobState.SUCCEEDED and job.ssh_line:
            self.ready[job.id] = (time.monotonic(), job.ssh_line)

    async def job_note(self, job: Job, text: str) -> None:
        pass


def first_seen(fake: FakeSlack, lines: set[str]) -> dict[str, float]:
    """When each SSH line first reached Slack, in a thread reply or a direct message."""
    seen: dict[str, float] = {}
    for call in fake.calls:
        if call.method != "chat.postMessage" or call.status != 200:
            continue
        for line in lines - seen.keys():
            if line + "`" in call.text or line + "\n" in call.text + "\n":
                seen[line] = call.at
    return seen


async def run(count: int, tmp: Path) -> dict[str, float]:
    fake = await new_fake()
    fake.post_interval_s = 1.0
    settings = load_settings(
        BUNDLED_CONFIG,
        database=str(tmp / "bench.db"),
        log_file=str(tmp / "bench.log"),
        backends=[{"kind": "sim", "name": "sim", "time_scale": 0.05}],
        subnets=[{"cidr": "10.0.0.0/23", "gateway": "10.0.0.1"}],
        limits={"max_running": count, "max_running_per_backend": count},
        approval={},
        defaults={"backend": "sim", "ssh_keys": [BENCH_KEY]},
        slack={"api_base_url": fake.url, "posts_per_second": 1.0},
    )
    timer = ReadyTimes()
    client = make_client(BOT_TOKEN, fake.url)
    threads = SlackThreads(client, settings.slack)
    sim = SimBackend("sim", time_scale=0.05)
    try:
        async with running_deployer(settings, timer, backends={"sim": sim}, grace_s=1) as d:
            bot = SlackBot(d, threads, client, signing_secret=SIGNING_SECRET)
            harness = Harness(fake, bot, d, threads)
            started = time.monotonic()
            for n in range(count):
                await harness.command(f"b{n:03d} 10.0.{n // 200}.{n % 200 + 10}", ALICE, CHANNEL)
            seen = await watch(fake, timer, count)
            elapsed = time.monotonic() - started
            await bot.settle()
            await threads.close(grace_s=0.1)
    finally:
        await fake.close()
    waits = [seen[line] - at for at, line in timer.ready.values() if line in seen]
    waits.sort()
    return {
        "deploys": count,
        "ready": len(timer.ready),
        "seen": len(waits),
        "p50_s": statistics.median(waits) if waits else float("nan"),
        "p99_s": waits[max(0, int(len(waits) * 0.99) - 1)] if waits else float("nan"),
        "worst_s": waits[-1] if waits else float("nan"),
        "violations": fake.violations,
        "elapsed_s": elapsed,
    }


async def watch(fake: FakeSlack, timer: ReadyTimes, count: int) -> dict[str, float]:
    """Until every deploy's SSH line reached Slack (bounded: 10 minutes)."""
    deadline = time.monotonic() + 600
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        lines = {line for _at, line in timer.ready.values()}
        seen = first_seen(fake, lines)
        if len(timer.ready) == count and len(seen) == count:
            break
        await fake.next_call(within=1.0)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deploys", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args.deploys, Path(tmp)))
    print(f"{'deploys':>8} {'seen':>5} {'p50 s':>7} {'p99 s':>7} {'goal':>6} {'worst s':>8} "
          f"{'429s':>5} {'goal':>5} {'run s':>6}")  # fmt: skip
    r = result
    print(
        f"{r['deploys']:>8.0f} {r['seen']:>5.0f} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f} "
        f"{'<=' + format(GOAL_P99_S, 'g'):>6} {r['worst_s']:>8.2f} {r['violations']:>5.0f} "
        f"{'0':>5} {r['elapsed_s']:>6.1f}"
    )


if __name__ == "__main__":
    needs.run(main)
