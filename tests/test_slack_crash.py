"""`kill -9` of `deploybot serve` with deploys in flight: every thread still ends.

A real `deploybot serve --http` process talks to the fake Slack Web API (in this test's
loop) and deploys on the simulator (with a state file, so the hypervisor outlives it).
Twenty deploys are asked for, four of them needing approval; the process is SIGKILLed
once a few threads are under way, and started again. Then, without anything else being
asked: every deploy's thread in the channel ends with its outcome, its requester got
the outcome by direct message, every pending approval has its card, and no message was
posted twice beyond the one call the kill may have cut between Slack's answer and the
store's write.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.reference import reference_json
from tests.support.slack.bot import (
    ALICE,
    APPROVALS,
    BOB,
    BOT_TOKEN,
    CHANNEL,
    SIGNING_SECRET,
    command_body,
    directory,
    env_without_slack,
    sign,
)
from tests.support.slack.fake_api import FakeSlack

CONFIG = """
database = "{tmp}/jobs.db"
log_file = "{tmp}/bot.log"

[[backends]]
kind = "sim"
name = "sim"
time_scale = 0.1
state_file = "{tmp}/sim.json"

[defaults]
ssh_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"]

[[subnets]]
cidr = "10.0.0.0/24"
gateway = "10.0.0.1"

[limits]
max_running = 6
max_running_per_backend = 6

[approval]
approvers = ["{bob}"]
cores_over = 2

[slack]
api_base_url = "{url}"
approvals_channel = "{approvals}"
posts_per_second = 40
"""
DEPLOYS = 20
NEEDS_APPROVAL = {3, 8, 13, 18}  # these ask for cpu=4: over the policy's 2


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    fake = FakeSlack(
        reference_json("slack-methods.json"), BOT_TOKEN, {CHANNEL, APPROVALS}, directory()
    )
    await fake.start()
    yield fake
    await fake.close()


async def start_serve(tmp: Path, fake: FakeSlack) -> tuple[asyncio.subprocess.Process, str]:
    config = tmp / "deploybot.toml"
    config.write_text(CONFIG.format(tmp=tmp, url=fake.url, approvals=APPROVALS, bob=BOB))
    env = env_without_slack(
        DEPLOYBOT_CONFIG=str(config), SLACK_BOT_TOKEN=BOT_TOKEN, SLACK_SIGNING_SECRET=SIGNING_SECRET
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "handlers.entry", "serve", "--http", "127.0.0.1:0",
        cwd=tmp, env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []
    async with asyncio.timeout(60):
        while not any("listening on" in line for line in seen):
            seen.append((await proc.stderr.readline()).decode())
            assert seen[-1], "".join(seen)
    base = seen[-1].split(" on ")[1].split("/slack/events")[0]
    return proc, base


def name(n: int) -> str:
    return f"k{n:02d}"


def jobs(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (state, id) for every job."""
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        return {row[0]: (row[1], row[2]) for row in db.execute("SELECT name, state, id FROM jobs")}
    finally:
        db.close()


def parents(fake: FakeSlack) -> dict[str, list[str]]:
    """name -> the ts of each parent message posted for it in the channel."""
    found: dict[str, list[str]] = {}
    for call in fake.called("chat.postMessage", channel=CHANNEL):
        if "thread_ts" not in call.args:
            found.setdefault(call.text.split()[0], []).append(str(call.answer["ts"]))
    return found


def ended(fake: FakeSlack, ts: str) -> bool:
    """The thread, or its parent (posted once the job had ended), shows the outcome."""
    text = "\n".join([fake.messages[(CHANNEL, ts)]["text"], *fake.thread(CHANNEL, ts)])
    return "ready in" in text or "failed at" in text or "cancelled." in text


async def test_a_killed_server_still_ends_every_thread(tmp_path: Path, fake: FakeSlack) -> None:
    proc, base = await start_serve(tmp_path, fake)
    try:
        async with aiohttp.ClientSession() as http:
            for n in range(DEPLOYS):
                cpu = " cpu=4" if n in NEEDS_APPROVAL else ""
                text = f"{name(n)} 10.0.0.{20 + n}{cpu}"
                body = command_body(text, ALICE, CHANNEL, fake.new_trigger())
                async with http.post(f"{base}/slack/events", data=body, headers=sign(body)) as r:
                    assert r.status == 200
        # Kill once a few deploys are copying their template: mid-flight, threads open.
        await fake.wait_for(lambda c: "copy template" in c.text, within=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    at_kill = Counter(state for state, _id in jobs(tmp_path).values())
    assert at_kill["running"] + at_kill["queued"] > 0, f"killed too late: {at_kill}"
    unended = [
        n
        for n in range(DEPLOYS)
        if not any(ended(fake, ts) for ts in parents(fake).get(name(n), []))
    ]
    assert len(unended) > len(NEEDS_APPROVAL), "the kill left no thread to finish"
    proc, _base = await start_serve(tmp_path, fake)
    try:
        for _wait in range(120):  # each a second at most without a call to Slack
            if done(tmp_path, fake):
                break
            await fake.next_call(within=1.0)
        else:
            pytest.fail(f"threads not ended: {report(tmp_path, fake)}")
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    posted = parents(fake)
    extra = sum(len(ts) - 1 for ts in posted.values())
    assert extra <= 1, f"parents posted twice: {posted}"


def done(tmp: Path, fake: FakeSlack) -> bool:
    return not report(tmp, fake)


def report(tmp: Path, fake: FakeSlack) -> list[str]:
    """What is still missing: unended threads, untold outcomes, unasked approvers."""
    missing = []
    known = jobs(tmp)
    posted = parents(fake)
    cards = [c.text for c in fake.called("chat.postMessage", channel=APPROVALS)]
    dm_text = "\n".join(c.text for c in fake.called("chat.postMessage", channel=ALICE))
    for n in range(DEPLOYS):
        state, _job_id = known.get(name(n), ("missing", ""))
        if state == "awaiting_approval":
            if not any(name(n) in text for text in cards):
                missing.append(f"{name(n)}: no approval card")
            continue
        if state not in ("succeeded", "failed", "cancelled"):
            missing.append(f"{name(n)}: {state}")
        elif not any(ended(fake, ts) for ts in posted.get(name(n), [])):
            missing.append(f"{name(n)}: thread without its outcome")
        elif f"{name(n)} " not in dm_text:
            missing.append(f"{name(n)}: no direct message")
    return missing


def outbox(tmp: Path, job_id: str) -> dict[str, tuple[str, bool]]:
    """kind -> (the parts recorded as sent, delivered) for one job's notices (the last
    of each kind)."""
    db = sqlite3.connect(tmp / "jobs.db")
    try:
        rows = db.execute(
            "SELECT kind, parts_sent, delivered_at FROM outbox WHERE job_id = ? ORDER BY id",
            [job_id],
        ).fetchall()
        return {str(kind): (str(sent or ""), at is not None) for kind, sent, at in rows}
    finally:
        db.close()


async def test_a_kill_between_the_parts_of_a_notice_repeats_none(
    tmp_path: Path, fake: FakeSlack
) -> None:
    """A finished deploy is told in three parts: its thread's line, its headline, and the
    requester's direct message. The DM goes out at once while the channel is held back
    (Slack answers 429 there); the process is SIGKILLed once the store recorded the DM,
    and started again with the channel free: each part reaches Slack exactly once."""
    proc, base = await start_serve(tmp_path, fake)
    try:
        async with aiohttp.ClientSession() as http:
            body = command_body("p00 10.0.0.60", ALICE, CHANNEL, fake.new_trigger())
            async with http.post(f"{base}/slack/events", data=body, headers=sign(body)) as r:
                assert r.status == 200
        await fake.wait_for(lambda c: c.channel == CHANNEL and c.text.startswith("p00"), 60)
        fake.blocked.add(CHANNEL)  # from now on the thread waits; the DM does not
        await fake.wait_for(lambda c: c.channel == ALICE and "p00 " in c.text, within=120)
        job_id = jobs(tmp_path)["p00"][1]
        for _wait in range(60):  # until the store has the DM (each a call or 0.5 s)
            if "dm" in outbox(tmp_path, job_id).get("finished", ("", False))[0]:
                break
            await fake.next_call(within=0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    sent, delivered = outbox(tmp_path, job_id)["finished"]
    assert sent.split() == ["dm"] and not delivered, sent  # killed between the parts
    fake.blocked.clear()
    proc, _base = await start_serve(tmp_path, fake)
    try:
        for _wait in range(120):  # each a second at most without a call to Slack
            if all(done for _sent, done in outbox(tmp_path, job_id).values()):
                break
            await fake.next_call(within=1.0)
        else:
            pytest.fail(f"not all told: {outbox(tmp_path, job_id)}")
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    (ts,) = parents(fake)["p00"]
    replies = fake.thread(CHANNEL, ts)
    assert sum("ready in" in text for text in replies) == 1, replies
    dms = [c.text for c in fake.called("chat.postMessage", channel=ALICE)]
    assert sum("p00 " in text for text in dms) == 1, dms
    headline = fake.messages[(CHANNEL, ts)]["text"]
    assert "ready" in headline, headline
