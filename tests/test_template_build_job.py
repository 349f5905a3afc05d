"""The build job on the simulator: queue, store, smoke deploy, publish, rollback and
recovery, through the Deployer as every front end uses it (no libguestfs: the simulator
takes no image)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.app.service import Deployer
from bot.models import JobState, utcnow
from bot.models.builds import Build, BuildState
from bot.models.errors import ConfigError, Conflict, NotAllowed, RequestInvalid, TransitionRefused
from bot.requests.parsed import DeployArgs
from tests.support.deployer import make_settings


@dataclass
class Heard:
    notes: list[str] = field(default_factory=list)
    ended: list[Build] = field(default_factory=list)

    async def build_note(self, build: Build, text: str) -> None:
        self.notes.append(text)

    async def build_finished(self, build: Build) -> None:
        self.ended.append(build)


def recorded(deployer: Deployer, **fields: object) -> Build:
    """A build row as another process (or an earlier life) left it: queued, by alice."""
    base: dict[str, object] = {
        "state": BuildState.QUEUED,
        "requester": "alice",
        "profile": "debian-12",
        "backend": "sim",
        "name": "golden-debian",
        "version": 1,
        "installation": deployer.store.installation_id,
    }
    return Build.model_validate({**base, **fields})


async def build(
    deployer: Deployer,
    profile: str = "debian-12",
    name: str = "golden-debian",
    placement: str | None = None,
) -> Build:
    # bob approves (tests/support/deployer.py): his own build needs no approver.
    asked = await deployer.builds.request(profile, "sim", "bob", name=name, placement=placement)
    await deployer.drain()
    final = await deployer.store.builds.get(asked.id)
    assert final is not None
    return final


async def test_a_build_is_smoke_tested_then_published(deployer: Deployer, sim: SimBackend) -> None:
    heard = Heard()
    deployer.builds.listen(heard)
    first = await build(deployer)
    assert first.state is BuildState.PUBLISHED, first.error
    assert first.version == 1 and first.vm_id is not None and first.smoke_job is not None
    assert [t.name for t in await sim.templates()][-1] == "golden-debian"
    assert any("smoke test passed" in n for n in heard.notes)
    assert heard.ended == [first]
    # The smoke VM was deployed through the pipeline, then destroyed.
    smoke = await deployer.store.jobs.get(first.smoke_job)
    assert smoke is not None and smoke.state is JobState.DESTROYED
    assert smoke.request.template == "golden-debian-v1"
    assert not [vm for vm in sim.vms.values() if vm.name == smoke.name]
    # A normal deploy uses the published template by its plain name.
    job = await deployer.request_deploy(
        DeployArgs(name="web01", template="golden-debian", on="sim"), "alice"
    )
    await deployer.drain()
    done = (await deployer.status(job.id)).job
    assert done.state is JobState.SUCCEEDED
    # The clone carries its own job's tag, not the build's.
    vm = sim.vms[str(done.vm_id)]
    assert vm.tags == {f"deploybot-{deployer.store.installation_id}-{job.id}"}


async def test_a_rebuild_is_a_new_version_and_the_old_one_is_kept(
    deployer: Deployer, sim: SimBackend
) -> None:
    first = await build(deployer)
    second = await build(deployer)
    assert second.state is BuildState.PUBLISHED and second.version == 2
    names = {v.version: v.name for v in await sim.template_versions("golden-debian")}
    assert names == {1: "golden-debian-v1", 2: "golden-debian"}
    assert first.vm_id != second.vm_id


async def test_after_a_rebuild_the_templates_are_called_as_their_versions_say(
    deployer: Deployer, sim: SimBackend
) -> None:
    """Publishing renames by VM id: v2 takes the plain name and only v1 is renamed, so
    what deploys offer (`templates()`) agrees with `template_versions()`."""
    await build(deployer)
    await build(deployer)
    offered = sorted(t.name for t in await sim.templates() if t.name.startswith("golden-"))
    assert offered == ["golden-debian", "golden-debian-v1"]
    versions = sorted(v.name for v in await sim.template_versions("golden-debian"))
    assert offered == versions


async def test_a_failed_smoke_deploy_removes_the_template(
    deployer: Deployer, sim: SimBackend
) -> None:
    sim.inject("power_on", "error")
    failed = await build(deployer)
    assert failed.state is BuildState.FAILED and failed.failed_step == "smoke"
    assert "smoke deploy" in (failed.error or "")
    assert failed.wreckage is None
    assert await sim.template_versions() == []
    assert "golden-debian-v1" not in [t.name for t in await sim.templates()]
    assert sim.vms == {}


async def test_a_failed_create_leaves_nothing(deployer: Deployer, sim: SimBackend) -> None:
    sim.inject("create_template", "error")
    failed = await build(deployer)
    assert failed.state is BuildState.FAILED and failed.failed_step == "create"
    assert sim.vms == {} and await sim.template_versions() == []


async def test_pre_flight_refuses_a_v3_profile_on_a_node_without_avx2(
    deployer: Deployer, sim: SimBackend
) -> None:
    sim.without_avx2 = {"node1"}
    failed = await build(deployer, "rocky-10", name="golden-rocky")
    assert failed.state is BuildState.FAILED and failed.failed_step == "preflight"
    assert "avx2" in (failed.error or "") and "--node" in (failed.error or "")
    assert failed.vm_id is None and sim.vms == {}
    ok = await build(deployer, "rocky-10", name="golden-rocky", placement="node2")
    assert ok.state is BuildState.PUBLISHED, ok.error


async def test_a_name_held_by_a_hand_made_template_is_refused(deployer: Deployer) -> None:
    failed = await build(deployer, name="debian-12")  # the simulator ships one by hand
    assert failed.state is BuildState.FAILED and failed.failed_step == "preflight"
    assert "did not build" in (failed.error or "")


async def test_bad_requests_change_nothing(deployer: Deployer) -> None:
    with pytest.raises(RequestInvalid, match="no build profile 'nope'"):
        await deployer.builds.request("nope", "sim", "alice")
    with pytest.raises(RequestInvalid, match="no backend 'pve'"):
        await deployer.builds.request("debian-12", "pve", "alice")
    assert await deployer.store.builds.recent() == []


async def test_one_build_of_a_name_at_a_time(deployer: Deployer) -> None:
    await deployer.builds.request("debian-12", "sim", "alice", name="golden-debian")
    with pytest.raises(Conflict, match="already under way"):
        await deployer.builds.request("debian-12", "sim", "bob", name="golden-debian")
    await deployer.drain()


async def test_a_build_whose_runner_died_is_rolled_back(
    deployer: Deployer, sim: SimBackend
) -> None:
    """A row left running by a process that died (its claim lapsed), with the template it
    had created: the next process's recovery removes the template and fails the build."""
    from backends.building import BuildTarget
    from bot.kinds.build.runner import plan_for

    row = recorded(deployer, owner="rdead", lease_until=utcnow() - timedelta(seconds=5))
    dead = await deployer.store.builds.insert(row)
    await deployer.store.builds.move(dead.id, [BuildState.QUEUED], BuildState.RUNNING, "rdead")
    profile = deployer.settings.images.profile("debian-12")
    plan = plan_for(dead, profile)
    target = BuildTarget("node1", "local-lvm")
    ref = await sim.prepare_build(plan, target)
    await deployer.store.builds.update(dead.id, "rdead", vm_id=ref.vm_id, vm_placement="node1")
    await sim.create_template(plan, target, ref, None)
    assert len(await sim.template_versions()) == 1
    [recovered] = await deployer.builds.recover()
    assert recovered.state is BuildState.FAILED and "interrupted" in (recovered.error or "")
    assert await sim.template_versions() == []
    assert await deployer.builds.recover() == []  # done once


async def test_an_unexpected_error_rolls_back_and_says_where_the_details_are(
    deployer: Deployer, sim: SimBackend
) -> None:
    sim.inject("create_template", "crash")  # the work is done, then the call dies unmapped
    failed = await build(deployer)
    assert failed.state is BuildState.FAILED and failed.failed_step == "create"
    assert failed.error == "internal error (the details are in the bot's log)"
    assert sim.vms == {} and await sim.template_versions() == []


async def test_a_queued_build_nobody_holds_is_claimed_and_run(deployer: Deployer) -> None:
    """Approved in a process that died before running it (its claim lapsed): the next
    runner's claim of queued work takes the build too, and runs it."""
    lapsed = utcnow() - timedelta(seconds=5)
    row = recorded(deployer, owner="rdead", lease_until=lapsed, decided_by="bob")
    left = await deployer.store.builds.insert(row)
    assert await deployer.ownership.claim_queued() == 1
    await deployer.drain()
    done = await deployer.store.builds.get(left.id)
    assert done is not None and done.state is BuildState.PUBLISHED, done
    assert done.owner == deployer.runner.id


async def test_a_non_approvers_build_waits_and_expires(deployer: Deployer) -> None:
    waiting = await deployer.builds.request("debian-12", "sim", "alice", name="golden-debian")
    assert waiting.state is BuildState.AWAITING_APPROVAL and waiting.owner is None
    assert await deployer.builds.expire(utcnow()) == []  # not yet
    later = utcnow() + timedelta(seconds=deployer.settings.approval.expire_after_s + 1)
    [expired] = await deployer.builds.expire(later)
    assert expired.state is BuildState.EXPIRED and expired.id == waiting.id
    with pytest.raises(NotAllowed, match="needs approval"):
        await deployer.builds.request(
            "debian-12", "sim", "alice", name="golden-debian", can_wait_for_approval=False
        )


async def test_a_build_awaiting_approval_is_cancelled_and_cannot_be_approved(
    deployer: Deployer,
) -> None:
    waiting = await deployer.builds.request("debian-12", "sim", "alice", name="golden-debian")
    with pytest.raises(NotAllowed, match="Only alice or an approver"):
        await deployer.cancel_build(waiting.id, "mallory")
    cancelled = await deployer.cancel_build(waiting.id[:6], "alice")
    assert cancelled.state is BuildState.CANCELLED and cancelled.error == "cancelled by alice"
    with pytest.raises(TransitionRefused):
        await deployer.decide_build(waiting.id, "bob", True)
    with pytest.raises(TransitionRefused, match="nothing to cancel"):
        await deployer.cancel_build(waiting.id, "alice")


async def test_a_running_build_cancelled_rolls_back(deployer: Deployer, sim: SimBackend) -> None:
    """Cancelled while it runs in this process: its task is cancelled, and its rollback
    removes what it made (the template a hung create call finished on the simulator)."""
    sim.inject("create_template", "hang")  # the work is done, the answer never comes
    reached = asyncio.Event()

    class Watching(Heard):
        async def build_note(self, build: Build, text: str) -> None:
            await super().build_note(build, text)
            if "takes no image" in text:
                reached.set()

    deployer.builds.listen(Watching())
    asked = await deployer.builds.request("debian-12", "sim", "bob", name="golden-debian")
    await reached.wait()
    answer = await deployer.cancel_build(asked.id, "bob")
    assert answer.state is BuildState.RUNNING
    await deployer.drain()
    done = await deployer.store.builds.get(asked.id)
    assert done is not None and done.state is BuildState.CANCELLED, done
    assert sim.vms == {} and await sim.template_versions() == []


async def test_a_build_running_elsewhere_is_asked_through_the_store(deployer: Deployer) -> None:
    """Run by another runner: the cancel is written on the row, and that runner's next
    renewal hands it back with the ask (bot/ownership/claims.py cancels its task then)."""
    row = recorded(deployer, owner="rother", lease_until=utcnow() + timedelta(minutes=5))
    elsewhere = await deployer.store.builds.insert(row)
    await deployer.store.builds.move(elsewhere.id, [BuildState.QUEUED], BuildState.RUNNING)
    answer = await deployer.cancel_build(elsewhere.id, "alice")
    assert answer.state is BuildState.RUNNING
    now = utcnow()
    held = await deployer.store.runners.renew_claims(
        "rother", now, now + timedelta(minutes=5), [elsewhere.id]
    )
    assert [(h.job_id, h.cancel_requested) for h in held] == [(elsewhere.id, "alice")]


async def test_a_template_name_must_be_a_vm_name(deployer: Deployer) -> None:
    for bad in ("<!channel>", "Debian_12", "-x", "a" * 51):
        with pytest.raises(RequestInvalid, match="cannot be a template name"):
            await deployer.builds.request("debian-12", "sim", "bob", name=bad)
    assert await deployer.store.builds.recent() == []
    status = await deployer.builds.request("debian-12", "sim", "alice", name="golden")
    assert status.state is BuildState.AWAITING_APPROVAL


async def test_a_build_whose_profile_left_the_configuration_fails_at_once(
    deployer: Deployer,
) -> None:
    """Approved after the operator removed its profile: it fails saying so, nothing made."""
    row = recorded(deployer, profile="gone-1", name="golden", owner=deployer.runner.id)
    queued = await deployer.store.builds.insert(row)
    done = await deployer.builds.run(queued.id)
    assert done is not None and done.state is BuildState.FAILED
    assert done.failed_step == "preflight" and "no build profile 'gone-1'" in (done.error or "")


TWO_SUBNETS = [
    {"name": "lab-a", "cidr": "10.0.0.0/24", "gateway": "10.0.0.1"},
    {"name": "lab-b", "cidr": "10.0.1.0/24", "gateway": "10.0.1.1"},
]


async def test_a_smoke_deploy_without_a_subnet_fails_the_build_at_pre_flight(
    tmp_path: Path, sim: SimBackend
) -> None:
    """Issue 25, item 4: refused before anything is made, in the build's own words (not
    "internal error" after the image, the upload and the template)."""
    settings = make_settings(tmp_path, subnets=TWO_SUBNETS, approval={"approvers": ["bob"]})
    heard = Heard()
    async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as deployer:
        deployer.builds.listen(heard)
        failed = await build(deployer)
        jobs = await deployer.store.jobs.history(limit=10)
    assert failed.state is BuildState.FAILED and failed.failed_step == "preflight"
    error = failed.error or ""
    assert "smoke_subnet under [images]" in error and "lab-a (10.0.0.0/24)" in error, error
    assert "internal error" not in error and "subnet=NAME" not in error
    # Nothing was downloaded, made or deployed: the image step never ran, no template.
    assert failed.vm_id is None and failed.smoke_job is None and jobs == []
    assert heard.notes == [f"preflight failed: {error}"]
    assert sim.vms == {} and await sim.template_versions() == []
    assert not settings.images.cache_dir.exists() or not any(settings.images.cache_dir.iterdir())


async def test_with_smoke_subnet_set_the_same_build_is_published(
    tmp_path: Path, sim: SimBackend
) -> None:
    settings = make_settings(
        tmp_path, subnets=TWO_SUBNETS, images={"smoke_subnet": "lab-b"},
        approval={"approvers": ["bob"]},
    )  # fmt: skip
    async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as deployer:
        done = await build(deployer)
        smoke = await deployer.store.jobs.get(done.smoke_job or "")
    assert done.state is BuildState.PUBLISHED, done.error
    assert smoke is not None and smoke.address.startswith("10.0.1.")


async def test_a_smoke_deploy_refused_later_is_said_not_internal_error(
    tmp_path: Path, sim: SimBackend
) -> None:
    """A refusal the pre-flight cannot foresee (the pool ran out meanwhile) is still the
    intake's sentence: every `UserError` of a step is its reason."""
    subnet = {**TWO_SUBNETS[0], "pool": "10.0.0.10-10.0.0.10"}
    settings = make_settings(tmp_path, subnets=[subnet], approval={"approvers": ["bob"]})
    async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as deployer:
        job = await deployer.request_deploy(DeployArgs(name="web01", on="sim"), "bob")
        await deployer.drain()
        assert (await deployer.status(job.id)).job.state is JobState.SUCCEEDED
        failed = await build(deployer)
    assert failed.state is BuildState.FAILED and failed.failed_step == "smoke"
    assert "No free address is left in lab-a" in (failed.error or ""), failed.error
    assert await sim.template_versions() == []  # the template was removed


def test_a_smoke_subnet_that_is_not_a_subnet_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"images\.smoke_subnet 'lab-c' is not a subnet"):
        make_settings(tmp_path, subnets=TWO_SUBNETS, images={"smoke_subnet": "lab-c"})
