"""/metrics (bot/operations/metrics.py): a deploy's steps, a rollback and the queue, as Prometheus
parses them (prometheus_client.parser), in process and over serve's HTTP server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from backends.sim import SimBackend
from bot.app.service import Deployer
from bot.models import Job, JobState
from handlers.slack.serve import run_http, serve_metrics
from tests.support.deployer import Recorder, deploy
from tests.support.slack.bot import is_reply, slack_bot


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, keyed by name and sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def scrape(deployer: Deployer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples((await deployer.metrics.render()).decode())


async def test_metrics_show_a_deploy_and_a_rollback(
    deployer: Deployer, sim: SimBackend, recorder: Recorder
) -> None:
    release = asyncio.Event()
    reached = asyncio.Event()

    async def hold(_job: Job, step: str) -> None:
        if step == "power_on" and not release.is_set():
            reached.set()
            await release.wait()

    recorder.on_step = hold
    running = asyncio.create_task(deploy(deployer))
    await reached.wait()
    during = await scrape(deployer)  # while the deploy is held at power on
    assert during[("deploybot_running", (("backend", "sim"),))] == 1
    assert during[("deploybot_jobs", (("state", "running"),))] == 1
    release.set()
    assert (await running).state is JobState.SUCCEEDED
    sim.inject("power_on", "error")
    failed = await deploy(deployer, "web02 10.0.0.51")
    assert failed.state is JobState.FAILED
    after = await scrape(deployer)
    clone = ("backend", "sim"), ("outcome", "ok"), ("step", "clone")
    assert after[("deploybot_step_duration_seconds_count", clone)] == 2
    power = ("backend", "sim"), ("outcome", "failed"), ("step", "power_on")
    assert after[("deploybot_step_duration_seconds_count", power)] == 1
    for state in ("succeeded", "failed"):
        finished = ("deploybot_jobs_finished_total", (("backend", "sim"), ("state", state)))
        assert after[finished] == 1
        assert after[("deploybot_jobs", (("state", state),))] == 1
    assert after[("deploybot_rollbacks_total", (("backend", "sim"), ("complete", "true")))] == 1
    assert after[("deploybot_running", (("backend", "sim"),))] == 0
    assert after[("deploybot_jobs_with_wreckage", ())] == 0
    assert after[("deploybot_backend_up", (("backend", "sim"),))] == 1


async def test_a_backend_that_does_not_answer_is_down(deployer: Deployer, sim: SimBackend) -> None:
    sim.inject("templates", "error")
    found = await scrape(deployer)
    assert found[("deploybot_backend_up", (("backend", "sim"),))] == 0


async def test_serve_answers_a_scrape_over_http(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        stop, ready, urls = asyncio.Event(), asyncio.Event(), []

        def on_ready(text: str) -> None:
            urls.append(text.split(" on ")[1].split("/slack/events")[0])
            ready.set()

        server = asyncio.create_task(run_http(h.bot, ("127.0.0.1", 0), on_ready, stop))
        await ready.wait()
        await h.command("web01 10.0.0.50")
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        async with aiohttp.ClientSession() as http, http.get(f"{urls[0]}/metrics") as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            found = samples(await answer.text())
        ok = ("backend", "sim"), ("outcome", "ok"), ("step", "ssh")
        assert found[("deploybot_step_duration_seconds_count", ok)] == 1
        assert found[("deploybot_chat_backlog", ())] >= 0
        stop.set()
        await server


async def test_socket_mode_serves_metrics_on_its_own_listener(deployer: Deployer) -> None:
    runner = await serve_metrics(deployer, "127.0.0.1:0")
    try:
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as answer:
            assert answer.status == 200
            found = samples(await answer.text())
        assert ("deploybot_running", (("backend", "sim"),)) in found
    finally:
        await runner.cleanup()
