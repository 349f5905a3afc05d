"""`deploybot serve` and `deploybot manifest`: tokens checked, HTTP mode over 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import jsonschema
import pytest
import yaml

from handlers.slack.serve import run_http
from tests.support.cli import CONFIG, deploybot, no_traceback
from tests.support.reference import reference_json
from tests.support.slack.bot import (
    BOT_TOKEN,
    CHANNEL,
    SIGNING_SECRET,
    command_body,
    directory,
    env_without_slack,
    is_reply,
    sign,
    slack_bot,
)
from tests.support.slack.fake_api import FakeSlack

APP_TOKEN = "xapp-1-A0000001-1234567890-abcdefabcdef"
MANIFEST = Path(__file__).resolve().parent.parent / "manifest.yml"


async def test_http_mode_answers_health_and_signed_commands(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        stop = asyncio.Event()
        urls: list[str] = []
        ready = asyncio.Event()

        def on_ready(text: str) -> None:
            urls.append(text.split(" on ")[1].split("/slack/events")[0])
            ready.set()

        server = asyncio.create_task(run_http(h.bot, ("127.0.0.1", 0), on_ready, stop))
        await ready.wait()
        base = urls[0]
        assert base.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as health:
                assert health.status == 200 and (await health.json())["ok"] is True
            body = command_body("web01 10.0.0.50", "UALICE001", CHANNEL, h.fake.new_trigger())
            async with http.post(f"{base}/slack/events", data=body, headers=sign(body)) as answer:
                assert answer.status == 200
            forged = sign(body, secret="f" * 32)
            async with http.post(f"{base}/slack/events", data=body, headers=forged) as refused:
                assert refused.status == 401
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        assert len(await h.deployer.history()) == 1  # the forged copy did nothing
        stop.set()
        await server


@pytest.mark.parametrize(
    ("args", "env", "variable", "leaked"),
    [
        ([], {}, "SLACK_BOT_TOKEN is not set", None),
        ([], {"SLACK_BOT_TOKEN": BOT_TOKEN}, "SLACK_APP_TOKEN is not set", None),
        ([], {"SLACK_BOT_TOKEN": "xoxp-user-token-secret"}, "SLACK_BOT_TOKEN does not", "secret"),
        (
            [],
            {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": "xoxb-wrong-kind-123456"},
            "SLACK_APP_TOKEN does not look like a app-level token",
            "wrong-kind",
        ),
        (["--http", "127.0.0.1:0"], {"SLACK_BOT_TOKEN": BOT_TOKEN}, "SLACK_SIGNING_SECRET", None),
        (["--http", "nowhere"], {"SLACK_BOT_TOKEN": BOT_TOKEN}, "give HOST:PORT", None),
    ],
)
def test_serve_refuses_to_start_without_good_tokens(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    variable: str,
    leaked: str | None,
) -> None:
    for name in [k for k in os.environ if k.startswith("SLACK_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = deploybot(tmp_path, "serve", *args)
    assert result.returncode == 2, result.stderr
    assert variable in result.stderr
    if args != ["--http", "nowhere"]:
        assert "did not start" in result.stderr
    no_traceback(result)
    if leaked:
        assert leaked not in result.stderr + result.stdout


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    fake = FakeSlack(reference_json("slack-methods.json"), BOT_TOKEN, {CHANNEL}, directory())
    await fake.start()
    yield fake
    await fake.close()


async def test_serve_http_runs_as_a_process_and_keeps_tokens_secret(
    tmp_path: Path, fake: FakeSlack
) -> None:
    config = tmp_path / "deploybot.toml"
    # JSON log lines and /metrics are outputs too: the tokens stay out of them as well.
    text = CONFIG.format(tmp=tmp_path).replace(
        "\n[[backends]]", 'log_format = "json"\n\n[[backends]]', 1
    )
    config.write_text(text + f'\n[slack]\napi_base_url = "{fake.url}"\n')
    env = env_without_slack(
        DEPLOYBOT_CONFIG=str(config), SLACK_BOT_TOKEN=BOT_TOKEN, SLACK_SIGNING_SECRET=SIGNING_SECRET
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "handlers.entry", "serve", "--http", "127.0.0.1:0",
        cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(60):
            while not any("listening on" in line for line in seen):
                seen.append((await proc.stderr.readline()).decode())
                assert seen[-1], "".join(seen)
        base = seen[-1].split(" on ")[1].split("/slack/events")[0]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as health:
                assert health.status == 200
            body = command_body("help", "UALICE001", CHANNEL, fake.new_trigger())
            async with http.post(f"{base}/slack/events", data=body, headers=sign(body)) as r:
                assert r.status == 200
                assert "/deploy status JOB" in json.dumps(await r.json())
            async with http.get(f"{base}/metrics") as scrape:
                assert scrape.status == 200
                metrics = await scrape.text()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = (await proc.communicate())[1].decode()
    assert proc.returncode == 0, "".join(seen) + rest
    assert fake.called("auth.test")
    output = "".join(seen) + rest  # serve logs to stderr
    log = (tmp_path / "bot.log").read_text()  # and to the log file, one JSON object a line
    assert all(json.loads(line)["level"] for line in log.splitlines())
    for secret in (BOT_TOKEN, SIGNING_SECRET):
        assert secret not in output and secret not in log and secret not in metrics
        assert secret.encode() not in (tmp_path / "jobs.db").read_bytes()


def test_manifest_prints_the_checked_in_file_and_any_command_name(tmp_path: Path) -> None:
    schema = reference_json("slack-manifest.schema.1.0.0.json")
    default = deploybot(tmp_path, "manifest")
    assert default.returncode == 0 and default.stdout == MANIFEST.read_text()
    custom = deploybot(tmp_path, "manifest", "--command", "/vm")
    data = yaml.safe_load(custom.stdout)
    jsonschema.Draft7Validator(schema).validate(data)
    assert data["features"]["slash_commands"][0]["command"] == "/vm"
    assert data["settings"]["interactivity"]["is_enabled"] is True
    assert "chat:write" in data["oauth_config"]["scopes"]["bot"]
    bad = deploybot(tmp_path, "manifest", "--command", "deploy")
    assert bad.returncode == 2 and "start with /" in bad.stderr
