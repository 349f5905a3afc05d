"""Job kinds are data (bot/kinds/): a fourth kind, defined and registered here and
nowhere else, runs through the queue, an approver's decision, the take-over of a job
whose runner was killed, and a Slack thread, with no change to the product's code.

The "noop" kind keeps its jobs as `jobs` rows (kind = "noop"); running one moves it to
running and then succeeded, writing the notices a thread shows. Its ids are ordinary
job ids: nothing about it can be told from its id, only from its row.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

from backends.sim import SimBackend
from bot.app.compose import compose
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.jobs import progress as tell
from bot.kinds import Rows
from bot.models import Approval, ApprovalState, Job, JobState, utcnow
from bot.models.errors import NotAllowed
from bot.ownership.claims import Ended, host_identity, process_start
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from store.db import Store
from store.owners import RunnerRow
from tests.support.deployer import Recorder, make_settings
from tests.support.slack.bot import APPROVALS, BOB, CHANNEL, is_reply, slack_bot
from tests.support.slack.fake_api import Call

NOOP_INTERRUPTED = "noop: its runner died; nothing to undo"


class NoopKind:
    """A kind that does nothing, in steps a person can follow."""

    name = "noop"
    noun = "no-op"
    rows: Rows = "jobs"

    def __init__(self, deployer: Deployer) -> None:
        self.deployer = deployer
        self.ran: list[str] = []
        self.recovered: list[str] = []

    async def request(self, text: str, requester: str, origin: str | None = None) -> Job:
        """Its approval policy: every noop waits for an approver."""
        parsed = parse(text)
        assert isinstance(parsed, DeployArgs)
        made = build_request(parsed, self.deployer.settings, requester)
        job = Job.for_request(made, JobState.AWAITING_APPROVAL).model_copy(
            update={
                "kind": self.name,
                "origin": origin,
                "approval_reason": "every noop needs approval",
                "installation": self.deployer.store.installation_id,
            }
        )
        approval = Approval(
            job_id=job.id,
            reason_required="every noop needs approval",
            expires_at=utcnow() + timedelta(hours=1),
        )
        return await self.deployer.store.jobs.insert(job, approval, announce=True)

    async def run(self, job_id: str) -> object:
        store = self.deployer.store
        self.ran.append(job_id)
        assert await store.jobs.transition(
            job_id,
            [JobState.QUEUED],
            JobState.RUNNING,
            notices=[tell.noted(job_id, "noop: doing nothing")],
            started_at=utcnow(),
        )
        return await store.jobs.transition(
            job_id,
            [JobState.RUNNING],
            JobState.SUCCEEDED,
            notices=[tell.finished(job_id, None)],
            finished_at=utcnow(),
        )

    async def recover(self, job: Job, ended: Ended | None) -> bool:
        self.recovered.append(job.id)
        store = self.deployer.store
        await store.jobs.transition(job.id, [JobState.RUNNING], JobState.ROLLING_BACK)
        await store.jobs.transition(
            job.id,
            [JobState.ROLLING_BACK],
            JobState.FAILED,
            error=NOOP_INTERRUPTED,
            finished_at=utcnow(),
        )
        return False

    def sweep(self) -> Coroutine[Any, Any, object] | None:
        return None

    async def decide(
        self,
        ref: str,
        approver: str,
        approved: bool,
        reason: str | None = None,
        dedupe_key: str | None = None,
    ) -> Job:
        outcome = ApprovalState.APPROVED if approved else ApprovalState.REJECTED
        job_id = (await self.deployer.status(ref)).job.id
        return await self.deployer.approvals.decide(job_id, approver, outcome, reason, dedupe_key)

    async def may_decide(self, ref: str, approver: str) -> Job:
        job_id = (await self.deployer.status(ref)).job.id
        return await self.deployer.approvals.check_decider(job_id, approver)

    async def cancel(self, ref: str, user: str) -> Job:
        raise NotAllowed("A noop cannot be cancelled: it ends on its own.")


def settings_for(tmp_path: Path) -> Settings:
    return make_settings(
        tmp_path,
        approval={"approvers": ["bob"]},
        ownership={"tick_s": 100, "lease_s": 300},
    )


async def test_a_noop_job_waits_for_approval_then_runs_through_the_queue(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    store = await Store.open(settings.database)
    deployer = compose(settings, store, {"sim": SimBackend("sim", time_scale=0.001)}, Recorder())
    noop = NoopKind(deployer)
    deployer.kinds.register(noop)
    await deployer.start()
    try:
        job = await noop.request("noop01 10.0.0.60", "alice")
        assert job.state is JobState.AWAITING_APPROVAL and job.kind == "noop"
        assert (await deployer.kind_of(job.id[:6])).name == "noop"  # a prefix, too
        assert not noop.ran
        await deployer.approve(job.id, "bob")  # the CLI's path: looked up by kind
        await deployer.drain()
        done = (await deployer.status(job.id)).job
        assert done.state is JobState.SUCCEEDED and noop.ran == [job.id]
        # A kind's own refusal reaches the person as it is.
        refused = await _refusal(deployer.cancel(job.id, "alice"))
        assert "cannot be cancelled" in refused
    finally:
        await deployer.close(grace_s=5)
        await store.close()


async def _refusal(call: Coroutine[Any, Any, object]) -> str:
    try:
        await call
    except NotAllowed as exc:
        return exc.message
    raise AssertionError("not refused")


async def test_a_noop_job_whose_runner_was_killed_is_recovered_by_its_kind(
    tmp_path: Path,
) -> None:
    """A real process holds the job, running, and is SIGKILLed; the next runner on this
    host sees its pid gone, takes the job over and hands it to the noop kind's
    `recover` (the deploy kind's recovery would have failed it as INTERRUPTED)."""
    settings = settings_for(tmp_path)
    victim = await asyncio.create_subprocess_exec("sleep", "60")
    store = await Store.open(settings.database)
    now = utcnow()
    until = now + timedelta(hours=1)  # a lease far from lapsing: only the kill frees it
    pid = victim.pid
    await store.runners.register(
        RunnerRow("rvictim", "shell", host_identity(), pid, process_start(pid), now, until)
    )
    made = build_request(parse_deploy("noop02 10.0.0.61"), settings, "alice")
    job = Job.for_request(made, JobState.RUNNING).model_copy(
        update={
            "kind": "noop",
            "owner": "rvictim",
            "lease_until": until,
            "installation": store.installation_id,
        }
    )
    await store.jobs.insert(job)
    os.kill(pid, signal.SIGKILL)
    await victim.wait()
    deployer = compose(settings, store, {"sim": SimBackend("sim", time_scale=0.001)}, Recorder())
    noop = NoopKind(deployer)
    deployer.kinds.register(noop)
    await deployer.start()  # its first tick reaps the dead runner and takes over
    try:
        final = (await deployer.status(job.id)).job
    finally:
        await deployer.close(grace_s=5)
        await store.close()
    assert noop.recovered == [job.id]
    assert final.state is JobState.FAILED and final.error == NOOP_INTERRUPTED
    assert final.owner == deployer.runner.id


def parse_deploy(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


async def test_a_noop_job_is_approved_by_its_card_and_followed_in_its_slack_thread(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path, approval={"approvers": [BOB]}) as h:
        noop = NoopKind(h.deployer)
        h.deployer.kinds.register(noop)
        job = await noop.request("noop03 10.0.0.62", "alice", origin=CHANNEL)

        def is_card(c: Call) -> bool:
            return c.method == "chat.postMessage" and c.channel == APPROVALS

        card = await h.fake.wait_for(is_card)
        await h.settle()
        assert (await h.click(card, "approve", BOB)).status == 200
        await h.settle()
        await h.deployer.drain()
        await h.fake.wait_for(is_reply("noop: doing nothing"))
        await h.settle()
        assert noop.ran == [job.id]
        assert (await h.deployer.status(job.id)).job.state is JobState.SUCCEEDED
        thread = [c for c in h.fake.calls if c.channel == CHANNEL]
        assert thread, "the noop job has a thread in its channel"
