"""Leases against the fake Slack, with a simulated clock: days pass between two calls of
the timer's step (`Leases.step`), nobody sleeps.

Reminders at 3 days and 1 day before the end, sent once each however often and from
however many processes the step runs; the end powers the VM off and says so in the
thread; the grace period ends in the destroy path; Extend by button; `never` and a
lease over the maximum refused with what to ask instead.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.models import Job, JobState, utcnow
from handlers.messages.text import when
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import (
    ALICE,
    BOB,
    CAROL,
    CHANNEL,
    MALLORY,
    Harness,
    block,
    is_reply,
    new_fake,
    open_form,
    slack_bot,
    state,
)
from tests.support.slack.fake_api import Call


@dataclass
class SimClock:
    """The deployer's clock: real time at the start, then moved by the test."""

    now: datetime = field(default_factory=utcnow)

    def __call__(self) -> datetime:
        return self.now


async def deploy(h: Harness, text: str = "web01 10.0.0.50", user: str = ALICE) -> Job:
    await h.command(text, user)
    await h.fake.wait_for(is_reply("ssh ubuntu@"))
    await h.settle()
    job = (await h.deployer.history(1))[0]
    assert job.state is JobState.SUCCEEDED
    return job


def reminders(h: Harness, user: str = ALICE) -> list[Call]:
    """Direct messages to `user` carrying the Extend button."""
    return [
        c
        for c in h.fake.called("chat.postMessage", channel=user)
        if '"lease_extend"' in json.dumps(c.args.get("blocks"))
    ]


def thread(h: Harness) -> str:
    parent = h.fake.called("chat.postMessage", channel=CHANNEL)[0]
    return "\n".join(h.fake.thread(CHANNEL, parent.answer["ts"]))


def told(h: Harness, user: str) -> list[str]:
    """Answers only `user` sees: ephemeral in a channel, or in their conversation with
    the app for a click there (a reminder's buttons)."""
    direct = [c.text for c in h.fake.called("chat.postMessage") if c.channel == user]
    return [c.text for c in h.fake.called("chat.postEphemeral", user=user)] + direct


async def job_now(h: Harness, job_id: str) -> Job:
    return (await h.deployer.status(job_id)).job


async def test_reminders_at_3d_and_1d_are_sent_once_each(tmp_path: Path) -> None:
    clock = SimClock()
    fake = await new_fake()
    fake.users[ALICE]["tz"] = "Europe/Berlin"
    try:
        async with slack_bot(tmp_path, fake=fake, clock=clock) as h:
            job = await deploy(h)
            end = job.lease_end
            assert end is not None and job.lease_s == 14 * 86400  # the default
            clock.now = end - timedelta(days=3, minutes=5)
            await h.deployer.leases.step()
            await h.settle()
            assert reminders(h) == []  # not yet
            # A second process on the same database runs the same step at the same time.
            async with running_deployer(
                h.deployer.settings, backends=h.deployer.backends, clock=clock, start=False
            ) as other:
                for _ in range(2):
                    clock.now += timedelta(minutes=10)  # past 3 days before the end
                    await asyncio.gather(h.deployer.leases.step(), other.leases.step())
                    await h.settle()
                assert len(reminders(h)) == 1
                clock.now = end - timedelta(hours=23)  # past 1 day before
                await asyncio.gather(h.deployer.leases.step(), other.leases.step())
                await h.deployer.leases.step()
                await h.settle()
            sent = reminders(h)
            assert len(sent) == 2
            shown = when(end, ZoneInfo("Europe/Berlin"))
            assert shown.endswith((" CET", " CEST"))  # Berlin, not UTC
            assert all(f"expires {shown}" in c.text for c in sent), sent[0].text
            assert "in about 3 days" in sent[0].text and "in about 23 hours" in sent[1].text
            assert len(fake.called("users.info", user=ALICE)) == 1  # kept per person
            audit = [e for e in await h.deployer.store.audit.events() if e.outcome == "reminded"]
            assert len(audit) == 2
    finally:
        await fake.close()


async def test_expiry_powers_off_then_the_grace_ends_in_a_destroy(tmp_path: Path) -> None:
    clock = SimClock()
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, backend=sim, clock=clock) as h:
        job = await deploy(h, "web01 10.0.0.50 lease=2d")
        vm_id, end = job.vm_id or "", job.lease_end
        assert end is not None and sim.vms[vm_id].running
        clock.now = end + timedelta(minutes=1)
        await h.deployer.leases.step()
        await h.deployer.leases.step()  # once powered off, a second step changes nothing
        await h.settle()
        off = await job_now(h, job.id)
        assert off.state is JobState.EXPIRED_OFF and off.powered_off_at == clock.now
        assert vm_id in sim.vms and not sim.vms[vm_id].running  # off, not destroyed
        said = thread(h)
        assert said.count(f"VM {vm_id} is powered off, not destroyed") == 1
        destroy_at = when(clock.now + timedelta(days=3))  # the grace, in UTC: no tz known
        assert f"It will be destroyed {destroy_at} unless extended" in said
        dm = [c.text for c in h.fake.called("chat.postMessage", channel=ALICE)]
        assert any("powered off, not destroyed" in t for t in dm)
        listed = await h.deployer.list_vms(ALICE, 1, 10)
        assert listed.jobs[0].state is JobState.EXPIRED_OFF  # still holds name and address
        clock.now += timedelta(days=2, hours=23)  # the grace (3 days) not over yet
        await h.deployer.leases.step()
        assert (await job_now(h, job.id)).state is JobState.EXPIRED_OFF
        clock.now += timedelta(hours=1, minutes=1)
        await h.deployer.leases.step()
        await h.fake.wait_for(is_reply("destroyed"))
        await h.deployer.drain()
        await h.settle()
        gone = await job_now(h, job.id)
        assert gone.state is JobState.DESTROYED and vm_id not in sim.vms
        said = thread(h)
        assert said.count("grace period is over: destroying VM") == 1
        assert "destroy the VM" in said
        outcomes = [e.outcome for e in await h.deployer.store.audit.events() if job.id in e.action]
        assert {"expired", "destroying", "destroyed"} <= set(outcomes)


async def test_extend_by_button_and_by_command_after_the_end(tmp_path: Path) -> None:
    clock = SimClock()
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, backend=sim, clock=clock) as h:
        job = await deploy(h, "web01 10.0.0.50 lease=5d")
        end = job.lease_end
        assert end is not None
        clock.now = end - timedelta(days=1)
        await h.deployer.leases.step()
        await h.settle()
        (card,) = reminders(h)
        await h.click(card, "lease_extend", MALLORY)
        await h.click(card, "lease_extend", ALICE, action_ts="1.000001")
        await h.click(card, "lease_extend", ALICE, action_ts="1.000001")  # redelivered
        await h.settle()
        assert any(
            "Only <@UALICE001> (who deployed it) or an approver may extend the lease of web01" in t
            for t in told(h, MALLORY)
        )
        extended = await job_now(h, job.id)
        assert extended.lease_end == end + timedelta(days=7)  # one step, once
        assert extended.reminders_sent is None  # the reminders start over
        assert any("now ends" in t for t in told(h, ALICE))
        assert thread(h).count("Lease extended by <@UALICE001>: web01 now expires") == 1
        # Past the new end: powered off; the command brings it back.
        clock.now = end + timedelta(days=7, minutes=1)
        await h.deployer.leases.step()
        await h.settle()
        vm_id = extended.vm_id or ""
        assert not sim.vms[vm_id].running
        await h.command("lease extend web01 95d", ALICE)
        await h.command("lease extend web01 7d", ALICE)
        await h.settle()
        assert any("would pass the maximum lease of 90d" in t for t in told(h, ALICE))
        back = await job_now(h, job.id)
        assert back.state is JobState.SUCCEEDED and sim.vms[vm_id].running
        assert back.lease_end == clock.now + timedelta(days=7)
        assert back.powered_off_at is None


async def test_never_and_over_the_maximum_are_refused_with_what_to_ask(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        await h.command("web01 10.0.0.50 lease=never", ALICE)
        await h.command("web02 10.0.0.51 lease=100d", ALICE)
        await h.settle()
        refusals = told(h, ALICE)
        assert any("lease=never (no end) is only for approvers" in t for t in refusals)
        assert any("ask for up to lease=90d" in t for t in refusals)
        assert any("lease=100d is longer than the maximum here (90d)" in t for t in refusals)
        assert not any("try again" in t for t in refusals)
        assert await h.deployer.history(10) == []  # nothing recorded
        forever = await deploy(h, "web03 10.0.0.52 lease=never", BOB)  # an approver may
        assert forever.lease_s is None and forever.lease_end is None
        await h.command("list all", CAROL)
        await h.settle()
        listing = h.fake.called("chat.postEphemeral", user=CAROL)[-1]
        assert "lease end never" in json.dumps(listing.args["blocks"])


async def test_destroy_now_from_the_reminder_after_the_end(tmp_path: Path) -> None:
    """Destroy now works on a VM already powered off by its lease; a person whose zone
    Slack will not say (the token lacks users:read) reads UTC."""
    clock = SimClock()
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    fake = await new_fake()
    fake.users[ALICE]["tz"] = "Asia/Tokyo"
    fake.scopes.remove("users:read")
    try:
        async with slack_bot(tmp_path, backend=sim, fake=fake, clock=clock) as h:
            job = await deploy(h, "web01 10.0.0.50 lease=2d")
            end = job.lease_end
            assert end is not None
            clock.now = end - timedelta(hours=12)
            await h.deployer.leases.step()
            await h.settle()
            (card,) = reminders(h)
            assert f"expires {when(end)}" in card.text and end.tzinfo is not None  # UTC
            clock.now = end + timedelta(minutes=1)
            await h.deployer.leases.step()
            await h.settle()
            assert (await job_now(h, job.id)).state is JobState.EXPIRED_OFF
            await h.click(card, "destroy", ALICE)
            await h.fake.wait_for(is_reply("destroyed (asked by"))
            await h.deployer.drain()
            await h.settle()
            assert (await job_now(h, job.id)).state is JobState.DESTROYED
            assert (job.vm_id or "") not in sim.vms
    finally:
        await fake.close()


async def test_a_vm_changed_by_hand_is_left_running_and_the_thread_says_why(
    tmp_path: Path,
) -> None:
    clock = SimClock()
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, backend=sim, clock=clock) as h:
        job = await deploy(h, "web01 10.0.0.50 lease=1d")
        vm_id, end = job.vm_id or "", job.lease_end
        assert end is not None
        sim.vms[vm_id].tags.clear()  # someone edited the VM on the hypervisor
        clock.now = end + timedelta(minutes=1)
        await h.deployer.leases.step()
        await h.settle()
        assert sim.vms[vm_id].running
        assert "no longer carries deploybot's tag (changed by hand)" in thread(h)
        assert "powered off" not in thread(h)
        clock.now += timedelta(days=3, minutes=1)
        await h.deployer.leases.step()
        await h.deployer.drain()
        await h.settle()
        kept = await job_now(h, job.id)
        assert kept.state is JobState.SUCCEEDED and vm_id in sim.vms  # refused, untouched
        assert "destroy refused" in thread(h) and "nothing was touched" in thread(h)


async def test_the_form_asks_for_a_lease_and_checks_it(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        view_id = await open_form(h)
        view = h.fake.views[view_id]
        field = block(view, "lease")
        assert "up to 90d" in field["hint"]["text"] and "14d here" in field["hint"]["text"]
        for typed, wanted in (("100d", "up to 90d (the maximum here)"), ("7x", "like 7d")):
            chosen = state(view, name="web01", address="10.0.0.50", lease=typed)
            errors = json.loads((await h.submit(view_id, chosen)).body)["errors"]
            assert set(errors) == {"lease"} and wanted in errors["lease"], errors
        chosen = state(view, name="web01", address="10.0.0.50", lease="3d")
        assert (await h.submit(view_id, chosen)).status == 200
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        job = (await h.deployer.history(1))[0]
        assert job.state is JobState.SUCCEEDED and job.lease_s == 3 * 86400
