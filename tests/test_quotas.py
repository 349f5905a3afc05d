"""Quotas through the Deployer: the boundary, per person and per group, sending for
approval, and requests racing for the last room: in one process, in two processes on
one database, and at the store's insert (each of the last two on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import HOLDING_STATES, Job, JobState
from bot.models.errors import ConfigError, UserError
from bot.requests import quotas
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.quotas import QuotaExceeded
from bot.requests.validation import build_request
from store.db import Store
from tests.support.deployer import Recorder, make_settings

QUOTA = {"vms": 3, "cores": 8, "memory_mib": 8192, "disk_gib": 30}


def args(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


@asynccontextmanager
async def deployer(tmp_path: Path, sim: SimBackend, **quota: Any) -> AsyncIterator[Deployer]:
    settings = make_settings(tmp_path, quotas={"default": QUOTA, **quota})
    async with running_deployer(settings, Recorder(), backends={"sim": sim}, grace_s=5) as d:
        yield d


async def test_exactly_at_the_limit_passes_one_more_is_refused_with_the_numbers(
    tmp_path: Path, sim: SimBackend
) -> None:
    async with deployer(tmp_path, sim) as d:
        await d.request_deploy(args("web01 10.0.0.50 cpu=4 mem=4G disk=+10G"), "alice")
        last = await d.request_deploy(args("web02 10.0.0.51 cpu=4 mem=4G disk=+20G"), "alice")
        assert last.state is JobState.QUEUED  # 8 of 8 cores, 8192 of 8192 MiB, 30 of 30 GiB
        with pytest.raises(QuotaExceeded) as refused:
            await d.request_deploy(args("web03 10.0.0.52 cpu=1 mem=512M"), "alice")
        message = refused.value.message
        assert "over your quota (cores: 8 used + 1 asked > 8; " in message
        assert "memory: 8192 MiB used + 512 MiB asked > 8192 MiB)" in message
        assert "disk" not in message.split("(")[1]  # only what does not fit is named
        assert "Destroy a VM you no longer need" in message and "try again" not in message
        # Nothing was recorded for the refused request, and others are not affected.
        assert [j.name for j in await d.history(requester="alice")] == ["web02", "web01"]
        assert (await d.request_deploy(args("web03 10.0.0.52 cpu=8"), "bob")).state is (
            JobState.QUEUED
        )


async def test_a_destroyed_vm_frees_its_share(tmp_path: Path, sim: SimBackend) -> None:
    async with deployer(tmp_path, sim, default={"vms": 1}) as d:
        first = await d.request_deploy(args("web01 10.0.0.50"), "alice")
        with pytest.raises(QuotaExceeded, match=r"VMs: 1 used \+ 1 asked > 1"):
            await d.request_deploy(args("web02 10.0.0.51"), "alice")
        await d.drain()
        await d.request_destroy(first.id, "alice")
        await d.drain()
        assert (await d.status(first.id)).job.state is JobState.DESTROYED
        assert (await d.request_deploy(args("web02 10.0.0.51"), "alice")).state is (JobState.QUEUED)


async def test_a_request_awaiting_approval_counts_and_a_rejected_one_frees(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(
        tmp_path, approval={"approvers": ["bob"], "always": True}, quotas={"default": {"vms": 1}}
    )
    async with running_deployer(settings, Recorder(), backends={"sim": sim}, grace_s=5) as d:
        waiting = await d.request_deploy(args("web01 10.0.0.50"), "alice")
        assert waiting.state is JobState.AWAITING_APPROVAL
        with pytest.raises(QuotaExceeded, match=r"VMs: 1 used \+ 1 asked > 1"):
            await d.request_deploy(args("web02 10.0.0.51"), "alice")
        await d.reject(waiting.id, "bob", "not now")
        second = await d.request_deploy(args("web02 10.0.0.51"), "alice")
        assert second.state is JobState.AWAITING_APPROVAL


async def test_a_person_s_override_keeps_the_default_s_other_limits(
    tmp_path: Path, sim: SimBackend
) -> None:
    async with deployer(tmp_path, sim, users={"alice": {"cores": 12}}) as d:
        await d.request_deploy(args("web01 10.0.0.50 cpu=11 mem=1G"), "alice")
        with pytest.raises(QuotaExceeded, match=r"\(memory: 1024 MiB used \+ 8192 MiB asked"):
            await d.request_deploy(args("web02 10.0.0.51 cpu=1 mem=8G"), "alice")
        with pytest.raises(QuotaExceeded, match=r"\(cores: 11 used \+ 2 asked > 12\)"):
            await d.request_deploy(args("web02 10.0.0.51 cpu=2 mem=1G"), "alice")


async def test_a_group_quota_counts_every_member_s_jobs(tmp_path: Path, sim: SimBackend) -> None:
    team = {"group": "STEAM0001", "cores": 6, "members": ["alice", "bob"]}
    async with deployer(tmp_path, sim, groups=[team]) as d:
        await d.request_deploy(args("web01 10.0.0.50 cpu=4"), "alice")
        with pytest.raises(QuotaExceeded) as refused:
            await d.request_deploy(args("web02 10.0.0.51 cpu=4"), "bob")
        assert "over the quota of group STEAM0001 (cores: 4 used + 4 asked > 6)" in (
            refused.value.message
        )
        await d.request_deploy(args("web02 10.0.0.51 cpu=2"), "bob")  # exactly 6
        await d.request_deploy(args("web03 10.0.0.52 cpu=4"), "carol")  # not a member


async def test_group_members_come_from_the_front_end_s_look_up(
    tmp_path: Path, sim: SimBackend
) -> None:
    team = {"group": "STEAM0001", "vms": 1}
    async with deployer(tmp_path, sim, groups=[team]) as d:

        async def members(group: str) -> frozenset[str]:  # what Slack's usergroups answer
            return frozenset({"alice", "bob"}) if group == "STEAM0001" else frozenset()

        d.groups.members = members
        await d.request_deploy(args("web01 10.0.0.50"), "alice")
        with pytest.raises(QuotaExceeded, match="group STEAM0001"):
            await d.request_deploy(args("web02 10.0.0.51"), "bob")

        async def broken(group: str) -> frozenset[str]:
            raise ConnectionError("slack is away")

        d.groups.members = broken  # a quota that cannot be counted is not skipped
        with pytest.raises(UserError, match="could not list the members of group"):
            await d.request_deploy(args("web02 10.0.0.51"), "carol")


async def test_over_quota_goes_to_an_approver_when_the_policy_says_so(
    tmp_path: Path, sim: SimBackend
) -> None:
    async with deployer(tmp_path, sim, default={"cores": 4}, over="approval") as d:
        await d.request_deploy(args("web01 10.0.0.50 cpu=4"), "alice")
        waiting = await d.request_deploy(args("web02 10.0.0.51 cpu=2"), "alice")
        assert waiting.state is JobState.AWAITING_APPROVAL
        assert waiting.approval_reason == "over your quota (cores: 4 used + 2 asked > 4)"
        approved = await d.approve(waiting.id, "bob")
        assert approved.state is JobState.QUEUED
        await d.drain()
        assert (await d.status(waiting.id)).job.state is JobState.SUCCEEDED
        # The one-shot CLI has nobody to approve: refused before anything is recorded.
        with pytest.raises(UserError, match="needs approval"):
            await d.request_deploy(
                args("web03 10.0.0.52 cpu=1"), "alice", can_wait_for_approval=False
            )


def test_sending_over_quota_requests_for_approval_needs_approvers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"quotas\.over"):
        make_settings(tmp_path, approval={}, quotas={"over": "approval"})


async def test_two_requests_racing_for_the_last_room_in_one_process(
    tmp_path: Path, sim: SimBackend
) -> None:
    async with deployer(tmp_path, sim, default={"vms": 3}) as d:
        await d.request_deploy(args("web00 10.0.0.49"), "alice")
        await d.request_deploy(args("web01 10.0.0.50"), "alice")
        results = await asyncio.gather(
            d.request_deploy(args("web02 10.0.0.51"), "alice"),
            d.request_deploy(args("web03 10.0.0.52"), "alice"),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["Job", "QuotaExceeded"]
        held = [j for j in await d.history(requester="alice") if j.state in HOLDING_STATES]
        assert len(held) == 3


async def test_racing_requests_under_the_approval_policy_one_runs_one_waits(
    tmp_path: Path, sim: SimBackend
) -> None:
    async with deployer(tmp_path, sim, default={"vms": 1}, over="approval") as d:
        jobs = await asyncio.gather(
            d.request_deploy(args("web01 10.0.0.50"), "alice"),
            d.request_deploy(args("web02 10.0.0.51"), "alice"),
        )
        states = sorted(j.state.value for j in jobs)
        assert states == ["awaiting_approval", "queued"]
        (waiting,) = [j for j in jobs if j.state is JobState.AWAITING_APPROVAL]
        assert waiting.approval_reason == "over your quota (VMs: 1 used + 1 asked > 1)"
        await d.drain()


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return str(tmp_path / "jobs.db")


async def test_two_processes_on_one_database_cannot_both_take_the_last_vm(
    tmp_path: Path, sim: SimBackend, database: str
) -> None:
    settings = make_settings(tmp_path, database=database, quotas={"default": {"vms": 1}})
    async with (
        running_deployer(settings, Recorder(), backends={"sim": sim}, grace_s=5) as one,
        running_deployer(settings, Recorder(), backends={"sim": sim}, grace_s=5) as two,
    ):
        assert one.store is not two.store  # two connections, as two processes have
        for _round in range(5):  # each round: both ask at once, exactly one is recorded
            results = await asyncio.gather(
                one.request_deploy(args("web01 10.0.0.50"), "alice"),
                two.request_deploy(args("web02 10.0.0.51"), "alice"),
                return_exceptions=True,
            )
            won = [r for r in results if isinstance(r, Job)]
            assert len(won) == 1, results
            assert all(isinstance(r, Job | QuotaExceeded) for r in results), results
            await one.drain()
            await two.drain()
            owner = one if won[0] in await one.history(requester="alice") else two
            await owner.request_destroy(won[0].id, "alice")
            await one.drain()
            await two.drain()


def _job(settings: Settings, text: str, who: str) -> Job:
    request = build_request(args(text), settings, who)
    return Job.for_request(request, JobState.QUEUED)


async def test_the_insert_checks_the_quota_under_the_store_s_lock(
    tmp_path: Path, database: str
) -> None:
    """Ten inserts on two connections at once, room for three: exactly three recorded.
    No early check here: only the insert's own (bot/requests/quotas.admission, run by
    store/quotas.admit) stands between them."""
    settings = make_settings(tmp_path, database=database)
    cap = quotas.Cap("alice", frozenset({"alice"}), {"vms": 3})
    stores = [await Store.open(database, password=settings.database_password) for _ in "ab"]
    try:

        async def insert(n: int) -> bool:
            job = _job(settings, f"web{n:02d} 10.0.0.{60 + n}", "alice")
            try:
                await stores[n % 2].jobs.insert(
                    job, admit=quotas.admission([cap], quotas.asked(job.request))
                )
            except quotas.OverQuota as over:
                assert over.used.vms == 3
                return False
            return True

        results = await asyncio.gather(*(insert(n) for n in range(10)))
        assert results.count(True) == 3
        assert (await stores[0].jobs.quota_usage({"alice"})).vms == 3
    finally:
        for store in stores:
            await store.close()
