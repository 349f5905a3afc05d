"""/deploy through the Bolt app against the fake Web API: the whole flow on the simulator."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from backends.base import Template
from backends.sim import SimBackend
from bot.models import JobState
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import ALICE, CHANNEL, MALLORY, is_reply, slack_bot

KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGvFv0mBq3ZkBUnh3BwrQ8QlUjcB1uWs6KmRZVb0iCq0 alice@laptop"
)


class GatedSim(SimBackend):
    """The simulator, except that listing templates waits until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__("sim", time_scale=SIM_SCALE)
        self.gate = asyncio.Event()

    async def templates(self) -> list[Template]:
        await self.gate.wait()
        return await super().templates()


async def test_deploy_from_command_to_ssh_line(tmp_path: Path) -> None:
    sim = GatedSim()
    async with slack_bot(tmp_path, backend=sim) as h:
        started = time.monotonic()
        response = await h.command("web01 10.0.0.50 mem=4G")
        # Acknowledged while the hypervisor has not even answered the template question.
        assert response.status == 200 and not sim.gate.is_set()
        assert time.monotonic() - started < 3
        sim.gate.set()
        parent = await h.fake.wait_for(
            lambda c: (
                c.method == "chat.postMessage"
                and "thread_ts" not in c.args
                and c.channel == CHANNEL
            )
        )
        assert parent.channel == CHANNEL
        assert parent.text.startswith("web01 10.0.0.50 on sim: ")
        ssh = await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        ts = parent.answer["ts"]
        assert ssh.args["thread_ts"] == ts
        await h.fake.wait_for(
            lambda c: c.method == "chat.update" and c.text == "web01 10.0.0.50 on sim: ready"
        )
        await h.settle()
        thread = "\n".join(h.fake.thread(CHANNEL, ts))
        for step in ("copy template", "set identity", "power on", "wait for address", "SSH"):
            assert step in thread
        assert " s" in thread and "ready in" in thread
        job = (await h.deployer.history(1))[0]
        assert job.state is JobState.SUCCEEDED and job.thread_ref == f"{CHANNEL}/{ts}"
        told = h.fake.called("chat.postEphemeral", user=ALICE)
        assert any(f"Job {job.id}" in c.text for c in told)


async def test_usage_errors_are_ephemeral_and_change_nothing(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        response = await h.command("web01 10.0.0.50 memory=4G")
        assert response.status == 200
        body = json.loads(response.body)
        assert body["response_type"] == "ephemeral"
        assert "Did you mean `mem`?" in body["text"]
        assert body["blocks"][0]["type"] == "section"
        for text in ("frobnicate j1234567", "status nope", "web_01 10.0.0.50"):
            await h.command(text)
        await h.settle()
        assert await h.deployer.history() == []
        audit = await h.deployer.store.audit.events()
        assert len(audit) == 4 and {a.actor for a in audit} == {ALICE}
        posted = [c.method for c in h.fake.calls if c.method != "auth.test"]
        assert "chat.postMessage" not in posted


async def test_help_answers_inside_the_ack(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        body = json.loads((await h.command("help")).body)
        assert body["response_type"] == "ephemeral"
        assert "/deploy status JOB" in json.dumps(body["blocks"])
        assert not [c for c in h.fake.calls if c.method != "auth.test"]


async def test_a_redelivered_command_makes_one_job(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        trigger = h.fake.new_trigger()
        await h.command("web01 10.0.0.50", trigger=trigger)
        await h.settle()
        again = await h.command("web01 10.0.0.50", trigger=trigger, retry=1)
        assert again.status == 200
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        jobs = await h.deployer.history()
        assert len(jobs) == 1
        answers = [c.text for c in h.fake.called("chat.postEphemeral", user=ALICE)]
        assert any(f"I already have this request as job {jobs[0].id}" in t for t in answers)
        parents = [
            c
            for c in h.fake.called("chat.postMessage", channel=CHANNEL)
            if "thread_ts" not in c.args
        ]
        assert len(parents) == 1
        (dm,) = h.fake.called("chat.postMessage", channel=ALICE)  # the outcome, told once
        assert "ssh ubuntu@10.0.0.50" in dm.text


async def test_bad_requests_are_told_to_the_user_and_queue_nothing(tmp_path: Path) -> None:
    approval = {"approvers": ["UBOB00001"], "deployers": [ALICE]}
    async with slack_bot(tmp_path, approval=approval) as h:
        await h.command("web01 10.0.0.50")
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        cases = {
            "web01 10.0.0.60": "A VM named web01 already exists on sim",
            "web02 10.0.0.50": "10.0.0.50 belongs to web01",
            "web03 10.0.0.61 template=windows-95": "'windows-95' is not a template on sim",
            "web04 10.0.0.62 on=node9": "'node9' is neither a backend nor a node",
            "web05 10.0.0.63 storage=tape": "'tape' is not a storage for VM disks on sim",
            "web06 10.0.0.64 cpu=64": "cpu: 64 is over the limit of 16",
        }
        for text in cases:
            await h.command(text)
        await h.command("web07 10.0.0.65", user=MALLORY)
        await h.settle()
        told = "\n".join(c.text for c in h.fake.called("chat.postEphemeral"))
        for expected in cases.values():
            assert expected in told
        assert f"<@{MALLORY}> is not on the list of people who may deploy" in told
        assert len(await h.deployer.history()) == 1
        audit = await h.deployer.store.audit.events()
        assert len(audit) == len(cases) + 1 and all(a.outcome == "refused" for a in audit)


async def test_subcommands_answer_ephemerally_with_blocks(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        await h.command("web01 10.0.0.50")
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        job = (await h.deployer.history(1))[0]
        for text in (f"status {job.short_id}", "history", "templates", f"cancel {job.id[:5]}"):
            await h.command(text)
            await h.settle()
        answers = h.fake.called("chat.postEphemeral", user=ALICE)[-4:]
        status, history, templates, cancel = answers
        assert "ready (requested by <@UALICE001>)" in status.text
        assert status.args["blocks"][0]["text"]["text"].startswith("```")
        assert job.short_id in history.text and "ready" in history.text
        assert "ubuntu-24.04 (ubuntu)" in templates.text
        assert f"Job {job.id} is succeeded: there is nothing to cancel." in cancel.text
        assert all(a.args["channel"] == CHANNEL for a in answers)


async def test_saved_keys_and_default_template_are_used_when_a_request_names_none(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        bad = await h.command("key ssh-ed25519 not-base64!! me")
        assert "not valid base64" in json.loads(bad.body)["text"]
        wrong = await h.command(
            "key ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAIGvFv0mBq3ZkBUnh3BwrQ8QlUjcB1uWs6KmRZVb0iCq0"
        )
        assert "does not hold a ssh-rsa key" in json.loads(wrong.body)["text"]
        await h.command(f"key {KEY}")
        await h.command("settings")
        opened = await h.fake.wait_for(lambda c: c.method == "views.open")
        view_id = opened.answer["view"]["id"]
        await h.fake.wait_for(lambda c: c.method == "views.update")
        await h.settle()
        view = h.fake.views[view_id]
        assert view["blocks"][0]["element"]["initial_value"] == KEY
        values: dict[str, dict[str, dict[str, Any]]] = {
            "keys": {"keys": {"type": "plain_text_input", "value": f"{KEY}\nssh-dss AAAA"}},
            "default_template": {"default_template": {"type": "static_select"}},
        }
        refused = json.loads((await h.submit(view_id, values)).body)
        assert "ssh-dss" in refused["errors"]["keys"]
        values["keys"]["keys"]["value"] = KEY
        values["default_template"]["default_template"]["selected_option"] = {
            "value": "sim|debian-12"
        }
        assert (await h.submit(view_id, values)).status == 200
        await h.settle()
        await h.command("web01 10.0.0.50")
        await h.fake.wait_for(is_reply("ssh debian@10.0.0.50"))  # debian-12 logs in as debian
        await h.settle()
        job = (await h.deployer.history(1))[0]
        assert job.request.ssh_keys == (KEY,) and job.request.template == "debian-12"
        assert any("default template debian-12" in c.text for c in h.fake.calls)


async def test_deploy_without_an_address_shows_the_next_free_one_first(tmp_path: Path) -> None:
    """`/deploy web01`: the thread's first line already has the address deploybot chose
    (the example's pool starts at 10.0.0.100), and the SSH line uses it."""
    async with slack_bot(tmp_path, backend=SimBackend("sim", time_scale=SIM_SCALE)) as h:
        assert (await h.command("web01")).status == 200
        parent = await h.fake.wait_for(
            lambda c: c.method == "chat.postMessage" and "thread_ts" not in c.args
        )
        assert parent.text.startswith("web01 10.0.0.100 on sim: ")
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.100"))
        await h.settle()
