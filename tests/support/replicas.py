"""Several `deploybot serve` processes on one store, with the fake Slack in a thread:
start them, reap them, ask them in Slack, and read what the database and Slack say."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from tests.support.fakepve.process import FakePVE
from tests.support.postgres import PASSWORD
from tests.support.reference import reference_json
from tests.support.slack.bot import (
    ALICE,
    BOT_TOKEN,
    CHANNEL,
    SIGNING_SECRET,
    command_body,
    directory,
    sign,
)
from tests.support.slack.fake_api import Call, FakeSlack

OWNERSHIP = "\n[ownership]\nlease_s = 3\ntick_s = 0.5\n"

SLACK = '\n[slack]\napi_base_url = "{url}"\nposts_per_second = 40\n'

# What the fake Slack shows of a step, to kill the server at: the headline names the
# step under way, the thread gets a line when it ends.
SLACK_STEPS = ["copy template", "set identity", "power on", "wait for address", "check SSH"]

T = TypeVar("T")


class SlackThread:
    """The fake Slack Web API on an event loop of its own: the harness is synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fake = self.run(self._start())

    async def _start(self) -> FakeSlack:
        fake = FakeSlack(reference_json("slack-methods.json"), BOT_TOKEN, {CHANNEL}, directory())
        await fake.start()
        return fake

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.run(self.fake.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def slack() -> Iterator[SlackThread]:
    running = SlackThread()
    try:
        yield running
    finally:
        running.close()


@dataclass
class Proc:
    """A bot process whose output is read by a thread, so several run side by side."""

    name: str  # the VM it deploys
    popen: subprocess.Popen[str]
    trigger: str | None = None
    lines: list[str] = field(default_factory=list)
    hit: threading.Event = field(default_factory=threading.Event)
    listening: str = ""  # serve: the URL Slack's events go to
    up: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self.lock:
                self.lines.append(line)
                if self._hits(line):
                    self.hit.set()
            if "listening on " in line:
                self.listening = line.split("listening on ", 1)[1].split()[0]
                self.up.set()
        self.hit.set()  # ended before its kill point: nothing to wait for
        self.up.set()

    def watch(self, trigger: str) -> None:
        """Set `hit` at the line saying `trigger`, even one printed before this call
        (the process runs from its spawn on)."""
        with self.lock:
            self.trigger = trigger
            if any(self._hits(line) for line in self.lines):
                self.hit.set()

    def _hits(self, line: str) -> bool:
        return bool(self.trigger) and f"[{self.name} " in line and str(self.trigger) in line


SPAWNED: list[subprocess.Popen[str]] = []  # killed at the end, so a failure leaks none


@pytest.fixture(autouse=True)
def _reap() -> Iterator[None]:
    yield
    while SPAWNED:
        popen = SPAWNED.pop()
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def spawn(args: list[str], env: dict[str, str], cwd: Path, name: str) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "-m", "handlers.entry", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
    )
    SPAWNED.append(popen)
    proc = Proc(name, popen)
    threading.Thread(target=proc.pump, daemon=True).start()
    return proc


def serve(env: dict[str, str], cwd: Path, name: str) -> Proc:
    """`deploybot serve --http` on a free loopback port, once it listens."""
    slack_env = {**env, "SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_SIGNING_SECRET": SIGNING_SECRET}
    proc = spawn(["serve", "--http", "127.0.0.1:0"], slack_env, cwd, name)
    assert proc.up.wait(60) and proc.listening, "".join(proc.lines)
    return proc


def ask_in_slack(server: Proc, slack: SlackThread, text: str) -> None:
    body = command_body(text, ALICE, CHANNEL, slack.fake.new_trigger())
    request = urllib.request.Request(
        server.listening, data=body.encode(), headers=sign(body), method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200


def mentions(fake: FakeSlack, name: str, label: str) -> Callable[[Call], bool]:
    """A call showing `label` for the job deploying `name`: its headline, which names
    it, or a line in its thread (a step shorter than one headline update shows only
    there)."""

    def shows(call: Call) -> bool:
        if label not in call.text:
            return False
        thread = call.args.get("thread_ts")
        if thread is None:
            return name in call.text
        return any(
            parent.answer.get("ts") == thread and parent.text.split()[:1] == [name]
            for parent in fake.called("chat.postMessage", channel=CHANNEL)
            if "thread_ts" not in parent.args
        )

    return shows


def rows(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, password=PASSWORD, autocommit=True) as conn:
        return conn.execute(sql.encode(), params).fetchall()


def until_or_none(found: Callable[[], Any], slack: SlackThread, within_s: float = 120) -> Any:
    """Look again each time the bots call Slack (or each half second), up to `within_s`;
    the last answer."""
    deadline = time.monotonic() + within_s
    answer = found()
    while not answer and time.monotonic() < deadline:
        slack.run(slack.fake.next_call(within=0.5))
        answer = found()
    return answer


def until(found: Callable[[], Any], slack: SlackThread, what: str, within_s: float = 120) -> Any:
    answer = until_or_none(found, slack, within_s)
    if not answer:
        pytest.fail(f"never: {what}")
    return answer


def parents(slack: SlackThread) -> dict[str, list[str]]:
    """Each job name's thread parents in the channel, oldest first (their ts)."""
    found: dict[str, list[str]] = {}
    for call in slack.fake.called("chat.postMessage", channel=CHANNEL):
        if "thread_ts" not in call.args:
            found.setdefault(call.text.split()[0], []).append(str(call.answer["ts"]))
    return found


def check_vms(jobs: dict[str, tuple[str, str]], fake: FakePVE) -> None:
    vms = fake.vms()
    ours = {str(vm["vmid"]) for vm in vms if "deploybot-" in str(vm.get("tags", ""))}
    succeeded = {vm for state, vm in jobs.values() if state == "succeeded"}
    assert ours == succeeded, (
        f"VMs {sorted(ours - succeeded)} orphaned, {sorted(succeeded - ours)} lost"
    )


def command(server: Proc, slack: SlackThread, text: str) -> tuple[int, dict[str, object], float]:
    """A signed /deploy: Slack's view of it (status, body, seconds to the answer)."""
    body = command_body(text, ALICE, CHANNEL, slack.fake.new_trigger())
    request = urllib.request.Request(
        server.listening, data=body.encode(), headers=sign(body), method="POST"
    )
    began = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            raw, status = answer.read(), answer.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return status, (json.loads(raw) if raw else {}), time.monotonic() - began


def get(server: Proc, path: str) -> tuple[int, str]:
    url = server.listening.replace("/slack/events", path)
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
