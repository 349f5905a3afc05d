"""The App Home and quotas in Slack, against the fake Web API: what the home shows (VMs
with their Destroy button, quota, approvals for an approver and none for a stranger,
recent jobs), its buttons, text escaped, 100 blocks at most; the form's quota line and
a request over quota refused with the numbers."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from slack_sdk.errors import SlackApiError

from backends.sim import SimBackend
from backends.sim.vm import DEFAULT_TEMPLATES
from bot.app.queries import VMPage
from bot.models import DeployRequest, Job, JobState, utcnow
from handlers.slack import views
from handlers.slack.home import HOME_BLOCKS_MAX, home_blocks
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import (
    ALICE,
    BOB,
    DAVE,
    MALLORY,
    OPS_GROUP,
    Harness,
    block,
    is_reply,
    slack_bot,
)

QUOTAS = {"default": {"vms": 3, "cores": 8, "memory_mib": 8192}}
ODD = "web&db<v2>"  # vSphere allows these in a template's name


async def opened(h: Harness, user: str) -> dict[str, Any]:
    """Open `user`'s Home tab and return the view the bot published."""
    before = len(h.fake.called("views.publish", user_id=user))
    response = await h.open_home(user)
    assert response.status == 200
    await h.fake.wait_for(
        lambda c: c.method == "views.publish" and c.args["user_id"] == user and c.status == 200
        and len(h.fake.called("views.publish", user_id=user)) > before
    )  # fmt: skip
    await h.settle()
    return h.fake.home(user)


def text_of(view: dict[str, Any]) -> str:
    return json.dumps(view["blocks"], ensure_ascii=False)


async def deployed(h: Harness, text: str = "web01 10.0.0.50", user: str = ALICE) -> Job:
    await h.command(text, user)
    await h.fake.wait_for(is_reply("ssh ubuntu@"))
    await h.settle()
    return (await h.deployer.history(1))[0]


async def test_the_home_shows_my_vms_quota_and_recent_jobs_and_destroys_by_button(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path, quotas=QUOTAS) as h:
        job = await deployed(h, "web01 10.0.0.50 cpu=6")
        home = await opened(h, ALICE)
        shown = text_of(home)
        assert home["type"] == "home"
        assert "Your VMs" in shown and "*web01* `10.0.0.50` on sim" in shown
        # The default lease (14 days) is shown as its end, not "—".
        assert "lease end " in shown and "lease end \u2014" not in shown and "ready" in shown
        assert "Your quota: VMs 1 of 3 \u00b7 cores 6 of 8 \u00b7 memory 2048 of 8192 MiB" in shown
        assert f'"value": "{job.id}"' in shown and '"action_id": "destroy"' in shown
        assert "Your recent jobs" in shown and f"`{job.short_id}` *web01*" in shown
        assert "Waiting for your approval" not in shown  # alice approves nothing

        await h.click_home(ALICE, views.DESTROY, job.id)
        await h.settle()
        await h.deployer.drain()
        await h.settle()
        assert (await h.deployer.status(job.id)).job.state is JobState.DESTROYED
        # The answer goes to her conversation with the app (a home has no channel) ...
        assert h.fake.called("chat.postMessage", channel=ALICE)
        # ... and the home was published again, without the VM.
        after = text_of(h.fake.home(ALICE))
        assert "You have no VMs from deploybot" in after and "destroyed" in after
        assert "VMs 0 of 3" in after


async def test_approvals_show_for_an_approver_escaped_and_not_for_a_stranger(
    tmp_path: Path,
) -> None:
    odd = dataclasses.replace(DEFAULT_TEMPLATES[0], name=ODD)
    sim = SimBackend("sim", time_scale=SIM_SCALE, templates=(*DEFAULT_TEMPLATES, odd))
    policy = {"approvers": [BOB], "always": True}
    async with slack_bot(tmp_path, approval=policy, backend=sim) as h:
        await h.command(f"web01 10.0.0.50 template={ODD}")
        await h.settle()
        (job,) = await h.deployer.history(1)
        assert job.state is JobState.AWAITING_APPROVAL

        shown = text_of(await opened(h, BOB))
        assert "Waiting for your approval" in shown
        assert "web&amp;db&lt;v2&gt;" in shown and ODD not in shown
        assert '"action_id": "approve"' in shown and '"action_id": "reject"' in shown

        for stranger in (MALLORY, ALICE):  # not an approver; the requester herself
            assert "Waiting for your approval" not in text_of(await opened(h, stranger))

        await h.click_home(BOB, views.APPROVE, job.id)
        await h.settle()
        assert (await h.deployer.status(job.id)).job.state in (
            JobState.QUEUED,
            JobState.RUNNING,
            JobState.SUCCEEDED,
        )
        assert "Waiting for your approval" not in text_of(h.fake.home(BOB))
        await h.deployer.drain()
        await h.settle()


def _job(n: int) -> Job:
    request = DeployRequest(
        name=f"web{n:03d}",
        address=f"10.0.{n // 200}.{n % 200 + 10}/16",
        gateway="10.0.255.254",
        template="ubuntu-24.04",
        backend="sim",
        cores=1,
        memory_mib=1024,
        user="ubuntu",
        requester=ALICE,
    )
    return Job.for_request(request, JobState.SUCCEEDED)


def test_a_full_home_keeps_to_100_blocks_and_says_how_many_more() -> None:
    vms = [_job(n) for n in range(60)]
    page = VMPage(vms, 1, 3, 150, ALICE)
    waiting = [j.model_copy(update={"state": JobState.AWAITING_APPROVAL}) for j in vms]
    blocks = home_blocks(page, [], waiting, vms[:10], utcnow() + timedelta(hours=1))
    assert len(blocks) <= HOME_BLOCKS_MAX
    shown = json.dumps(views.dicts(blocks))
    assert "more: /deploy list shows them all" in shown
    assert "more: the approvals channel shows them all" in shown
    assert "Your recent jobs" in shown  # the last section is never cut


async def form_as(h: Harness, user: str) -> dict[str, Any]:
    """`/deploy` alone by `user`: the form, once filled in."""
    await h.command("", user)
    opened = await h.fake.wait_for(lambda c: c.method == "views.open" and c.status == 200)
    view_id = str(opened.answer["view"]["id"])
    await h.fake.wait_for(lambda c: c.method == "views.update" and c.args["view_id"] == view_id)
    await h.settle()
    return h.fake.views[view_id]


async def test_the_form_shows_the_quota_left(tmp_path: Path) -> None:
    quotas = {**QUOTAS, "groups": [{"group": OPS_GROUP, "vms": 2}]}
    async with slack_bot(tmp_path, quotas=quotas) as h:
        await deployed(h, "web01 10.0.0.50 cpu=2")
        line = json.dumps(block(await form_as(h, ALICE), "quota"))
        assert "Quota left: you: 2 VMs, 6 cores, 6144 MiB memory." in line
        # dave is in the ops group (the fake's usergroups.users.list): its quota too.
        await deployed(h, "web02 10.0.0.51", user=DAVE)
        h.fake.calls.clear()
        line = json.dumps(block(await form_as(h, DAVE), "quota"))
        assert "you: 2 VMs, 6 cores, 6144 MiB memory; group SOPS00001: 1 VM." in line


async def test_a_request_over_quota_is_refused_with_the_numbers(tmp_path: Path) -> None:
    quotas = {"default": {"cores": 4}}
    async with slack_bot(tmp_path, quotas=quotas) as h:
        await deployed(h, "web01 10.0.0.50 cpu=4")
        await h.command("web02 10.0.0.51 cpu=1")
        await h.settle()
        answer = h.fake.called("chat.postEphemeral", user=ALICE)[-1].text
        assert "over your quota (cores: 4 used + 1 asked &gt; 4)" in answer
        assert "try again" not in answer


async def test_the_fake_refuses_what_views_publish_does_not_take(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        view = {"type": "home", "blocks": [{"type": "divider"}]}
        ok = await h.bot.client.api_call("views.publish", json={"user_id": ALICE, "view": view})
        assert ok["ok"]
        for wrong in (
            {"user_id": ALICE, "view": view, "channel": "CDEPLOYS01"},  # not an argument of it
            {"view": view},  # user_id is required
            {"user_id": ALICE, "view": {**view, "type": "modal", "title": "x"}},
        ):
            with pytest.raises(SlackApiError) as refused:
                await h.bot.client.api_call("views.publish", json=wrong)
            assert refused.value.response["error"] == "invalid_arguments", wrong
