"""Slack delivery under load: how soon a requester sees the SSH line, and their answer.

Starts N deploys together in one channel (all asked by one person, the worst case for
their direct messages) against the fake Slack Web API, which enforces Slack's one post
per second per channel and counts every post that comes too soon. For each deploy it
measures the time from the job becoming ready (the store's transition, seen by a
progress listener) to the first Slack message that shows its SSH line, by direct
message and in the channel (the thread, or a parent that carries it), and the time from
each command to its ephemeral answer ("accepted"); it prints p50, p99 and the worst
with the goal beside them. The measurement ends when every SSH line has been seen in
both places.

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
from bot.app.runtime import running_deployer
from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models import Job, JobState, RollbackReport
from handlers.slack.app import SlackBot, make_client
from handlers.slack.threads import SlackThreads
from tests.support.slack.bot import ALICE, BOT_TOKEN, CHANNEL, SIGNING_SECRET, Harness, new_fake
from tests.support.slack.fake_api import FakeSlack

GOAL_P99_S = 10.0  # ready -> SSH line by direct message
# ready -> SSH line in the channel: the channel takes one post a second, so the best
# there is one post per deploy (a parent that carries the outcome), N seconds for N.
THREAD_SLACK_S = 10.0
GOAL_ANSWER_P99_S = 3.0  # command -> its ephemeral answer


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


def first_seen(fake: FakeSlack, lines: set[str], channel: str) -> dict[str, float]:
    """When each SSH line first reached `channel` (a thread reply, a parent, or a direct
    message when `channel` is the requester)."""
    seen: dict[str, float] = {}
    for call in fake.calls:
        if call.method != "chat.postMessage" or call.status != 200 or call.channel != channel:
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
            asked: dict[str, float] = {}
            for n in range(count):
                asked[f"b{n:03d}"] = time.monotonic()
                text, url = (
                    f"b{n:03d} 10.0.{n // 200}.{n % 200 + 10}",
                    fake.response_url(ALICE, CHANNEL),
                )
                await harness.command(text, ALICE, CHANNEL, response_url=url)
            dm, thread = await watch(fake, timer, count)
            elapsed = time.monotonic() - started
            await bot.settle()
            await threads.close(grace_s=0.1)
    finally:
        await fake.close()
    answers = answered(fake, asked)
    return {
        "deploys": count,
        "ready": len(timer.ready),
        "violations": fake.violations,
        "elapsed_s": elapsed,
        **figures("dm", [dm[line] - at for at, line in timer.ready.values() if line in dm]),
        **figures("thread", [thread[ln] - at for at, ln in timer.ready.values() if ln in thread]),
        **figures("answer", [answers[name] - at for name, at in asked.items() if name in answers]),
    }


def figures(what: str, waits: list[float]) -> dict[str, float]:
    waits = sorted(waits)
    nan = float("nan")
    return {
        f"{what}_seen": len(waits),
        f"{what}_p50_s": statistics.median(waits) if waits else nan,
        f"{what}_p99_s": waits[max(0, int(len(waits) * 0.99) - 1)] if waits else nan,
        f"{what}_worst_s": waits[-1] if waits else nan,
    }


def answered(fake: FakeSlack, asked: dict[str, float]) -> dict[str, float]:
    """When each command's ephemeral answer reached its requester (Web API or the
    command's response_url), by the deploy's name in it."""
    seen: dict[str, float] = {}
    for call in fake.calls:
        if call.method not in ("chat.postEphemeral", "response_url") or call.status != 200:
            continue
        for name in asked.keys() - seen.keys():
            if f" {name} " in call.text:
                seen[name] = call.at
    return seen


async def watch(
    fake: FakeSlack, timer: ReadyTimes, count: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Until every deploy's SSH line reached the requester and the channel (bounded:
    15 minutes); when each did, by direct message and in the channel."""
    deadline = time.monotonic() + 900
    dm: dict[str, float] = {}
    thread: dict[str, float] = {}
    while time.monotonic() < deadline:
        lines = {line for _at, line in timer.ready.values()}
        dm, thread = first_seen(fake, lines, ALICE), first_seen(fake, lines, CHANNEL)
        if len(timer.ready) == count and len(dm) == len(thread) == count:
            break
        await fake.next_call(within=1.0)
    return dm, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deploys", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args.deploys, Path(tmp)))
    r = result
    print(f"{r['deploys']:.0f} deploys, {r['violations']:.0f} posts refused as too soon "
          f"(goal 0), {r['elapsed_s']:.1f} s")  # fmt: skip
    print(f"{'what':<34} {'seen':>5} {'p50 s':>7} {'p99 s':>7} {'goal':>6} {'worst s':>8}")
    for what, label, goal in (
        ("dm", "ready -> SSH line, direct message", GOAL_P99_S),
        ("thread", "ready -> SSH line, in the channel", r["deploys"] + THREAD_SLACK_S),
        ("answer", "command -> its answer", GOAL_ANSWER_P99_S),
    ):
        print(
            f"{label:<34} {r[what + '_seen']:>5.0f} {r[what + '_p50_s']:>7.2f} "
            f"{r[what + '_p99_s']:>7.2f} {'<=' + format(goal, 'g'):>6} "
            f"{r[what + '_worst_s']:>8.2f}"
        )


if __name__ == "__main__":
    needs.run(main)
