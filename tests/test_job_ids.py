"""Job ids: 99 random bits, shown short, found by any unambiguous prefix of 4+ characters."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import Approval, Job, JobState, utcnow
from bot.models.errors import AmbiguousJob, JobNotFound, NotAllowed
from bot.models.ids import _ID_ALPHABET, new_job_id
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from handlers.commands import answer
from store.db import Store
from tests.support.deployer import make_settings

# Ids chosen so that prefixes collide: two share their first 8 characters, and an id of
# the old 7-character kind is a prefix of a new one.
TWINS = ("j4k7tqa2bxw9cdn3efhpr", "j4k7tqa2zzw9cdn3efhpr")
OLD = "jabcdef"
NEWER = "jabcdefgh2345678abcde"


def job_with_id(settings: Settings, job_id: str, name: str, host: int) -> Job:
    parsed = parse(f"{name} 10.0.0.{host}")
    assert isinstance(parsed, DeployArgs)
    request = build_request(parsed, settings, "alice")
    job = Job.for_request(request, JobState.AWAITING_APPROVAL)
    return job.model_copy(update={"id": job_id})


def approval_for(job: Job) -> Approval:
    return Approval(job_id=job.id, reason_required="test", expires_at=utcnow().replace(year=2999))


@pytest.fixture
async def seeded(tmp_path: Path, sim: SimBackend) -> AsyncIterator[Deployer]:
    """Four jobs awaiting approval, with ids whose prefixes clash on purpose."""
    settings = make_settings(tmp_path, approval={"approvers": ["bob"], "always": True})
    store = await Store.open(settings.database)
    for number, job_id in enumerate((*TWINS, OLD, NEWER)):
        job = job_with_id(settings, job_id, f"vm{number}", 60 + number)
        await store.jobs.insert(job, approval_for(job))
    await store.close()
    async with running_deployer(settings, backends={"sim": sim}) as d:
        yield d


def test_new_ids_carry_at_least_96_random_bits() -> None:
    assert len(_ID_ALPHABET) == len(set(_ID_ALPHABET)) == 31
    ids = [new_job_id() for _ in range(3000)]
    assert all(len(i) == 21 and i[0] == "j" and set(i[1:]) <= set(_ID_ALPHABET) for i in ids)
    assert math.log2(len(_ID_ALPHABET)) * (len(ids[0]) - 1) >= 96
    assert len(set(ids)) == len(ids)
    # Every letter of the alphabet turns up in every position (60000 draws): no position
    # is fixed or drawn from a smaller set.
    for position in range(1, 21):
        assert {i[position] for i in ids} == set(_ID_ALPHABET)


async def test_any_unambiguous_prefix_finds_the_job(seeded: Deployer) -> None:
    for ref in ("j4k7tqa2b", "J4K7TQA2B", "#j4k7tqa2b", TWINS[0]):
        assert (await seeded.status(ref)).job.id == TWINS[0]
    assert (await seeded.status("j4k7tqa2z")).job.id == TWINS[1]
    assert (await seeded.status("jabcdefg")).job.id == NEWER


async def test_an_old_short_id_is_exact_and_wins_over_longer_ids(seeded: Deployer) -> None:
    assert (await seeded.status(OLD)).job.id == OLD
    cancelled = await seeded.cancel(OLD, "alice")
    assert (cancelled.id, cancelled.state) == (OLD, JobState.CANCELLED)
    assert (await seeded.status(NEWER)).job.state is JobState.AWAITING_APPROVAL


async def test_an_ambiguous_prefix_lists_the_matches(seeded: Deployer) -> None:
    with pytest.raises(AmbiguousJob) as caught:
        await seeded.status("j4k7tqa2")
    text = caught.value.message
    assert sorted(caught.value.matches) == sorted(TWINS)
    # The listed prefixes are long enough to tell the two apart.
    assert "j4k7tqa2b (vm0, awaiting_approval)" in text
    assert "j4k7tqa2z (vm1, awaiting_approval)" in text
    assert "Type more characters of the id" in text
    with pytest.raises(AmbiguousJob, match="jabc matches several jobs"):
        await seeded.approve("jabc", "bob")
    # Nothing was decided on an ambiguous prefix.
    assert (await seeded.status(TWINS[0])).job.state is JobState.AWAITING_APPROVAL


async def test_too_short_unknown_and_odd_refs_are_refused(seeded: Deployer) -> None:
    with pytest.raises(JobNotFound, match="first 4 or more characters"):
        await seeded.status("j4k")
    with pytest.raises(JobNotFound, match="There is no job j9999"):
        await seeded.status("j9999")
    for odd in ("", "x4k7tqa2", "j4k7tq\u0130", "j4k7 tqa2", "j4k7%", "j4k7_"):
        with pytest.raises(JobNotFound):
            await seeded.status(odd)


async def test_every_command_takes_a_prefix(seeded: Deployer) -> None:
    said = await answer(seeded, "bob", "approve j4k7tqa2b")
    assert said == [f"Job {TWINS[0]}: approved by bob; queued."]
    said = await answer(seeded, "bob", "reject j4k7tqa2z too big")
    assert said == [f"Job {TWINS[1]}: rejected; alice has been told why."]
    said = await answer(seeded, "alice", "cancel jabcdefg")
    assert said == [f"Job {NEWER} cancelled before it started; nothing was built."]
    said = await answer(seeded, "alice", "status jabc")
    assert said[0].startswith("jabc matches several jobs: jabcdef (vm2, awaiting_approval)")
    with pytest.raises(NotAllowed):  # the resolved id goes on through the usual checks
        await seeded.cancel("jabcdef", "mallory")
    await seeded.drain()


async def test_history_and_threads_show_the_short_id(seeded: Deployer) -> None:
    from handlers.messages.reports import history

    lines = history(await seeded.history(10))
    assert any(line.startswith("j4k7tqa2 ") for line in lines)
    assert not any(TWINS[0] in line for line in lines)
    job = (await seeded.status(TWINS[0])).job
    assert job.short_id == "j4k7tqa2"


async def test_a_clashing_id_is_stored_under_a_fresh_one(settings: Settings) -> None:
    store = await Store.open(settings.database)
    try:
        first = job_with_id(settings, TWINS[0], "web01", 50)
        await store.jobs.insert(first, approval_for(first), dedupe_key="first")
        clash = job_with_id(settings, TWINS[0], "web02", 51)
        stored = await store.jobs.insert(clash, approval_for(clash), dedupe_key="second")
        assert stored.id != TWINS[0] and len(stored.id) == 21
        assert stored.model_copy(update={"id": TWINS[0]}) == clash
        assert await store.jobs.get(stored.id) == stored
        kept = await store.jobs.get(TWINS[0])
        assert kept is not None and kept.name == "web01"
        approval = await store.approvals.get(stored.id)
        assert approval is not None and approval.job_id == stored.id
        # The redelivery key points at the id the job really has.
        assert await store.jobs.delivered("second") == stored.id
        assert await store.jobs.delivered("first") == TWINS[0]
    finally:
        await store.close()
