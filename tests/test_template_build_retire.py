"""`deploybot template gc`: old versions go only when unused, beyond the kept ones, after
a dry run of the same scope."""

from __future__ import annotations

from datetime import timedelta

import pytest

from backends.building import BuildTarget
from backends.sim import SimBackend
from bot.app.service import Deployer
from bot.kinds.build import retire
from bot.kinds.build.runner import plan_for
from bot.models import JobState, utcnow
from bot.models.builds import Build, BuildState
from bot.models.errors import UserError
from bot.requests.parsed import DeployArgs


async def build(deployer: Deployer) -> Build:
    asked = await deployer.builds.request("debian-12", "sim", "bob", name="golden")  # an approver
    await deployer.drain()
    done = await deployer.store.builds.get(asked.id)
    assert done is not None and done.state is BuildState.PUBLISHED, done
    return done


def categories(report: retire.RetireReport) -> dict[str, str]:
    return {v.version.name: v.category for v in report.verdicts}


async def test_old_versions_are_retired_once_unused(deployer: Deployer, sim: SimBackend) -> None:
    first = await build(deployer)
    job = await deployer.request_deploy(
        DeployArgs(name="web01", template="golden", on="sim"), "alice"
    )
    await deployer.drain()
    await build(deployer)
    await build(deployer)
    store, backends = deployer.store, deployer.backends
    report = await retire.dry_run(store, backends, ["sim"], keep=1)
    assert categories(report) == {
        "golden-v1": "in_use",  # web01 is a linked clone of it
        "golden-v2": "kept_previous",
        "golden": "current",
    }
    with pytest.raises(UserError, match="without --apply first"):
        await retire.apply(store, backends, ["other"], 1, 1800, 30)
    gone = await deployer.request_destroy(job.id, "alice")
    await deployer.drain()
    await deployer.destroyer.settle()
    assert (await deployer.status(gone.id)).job.state is JobState.DESTROYED
    # Applying the earlier dry run removes nothing: it listed nothing removable then.
    stale = await retire.apply(store, backends, ["sim"], 1, 1800, 30)
    assert stale.removed == [] and "golden-v1" in str(stale.left)
    report = await retire.dry_run(store, backends, ["sim"], keep=1)
    assert categories(report)["golden-v1"] == "retire"
    applied = await retire.apply(store, backends, ["sim"], 1, 1800, 30)
    assert [v.version.name for v in applied.removed] == ["golden-v1"]
    assert [v.name for v in await sim.template_versions()] == ["golden-v2", "golden"]
    retired = await store.builds.get(first.id)
    assert retired is not None and retired.state is BuildState.RETIRED


async def test_a_template_whose_build_is_unknown_or_foreign(
    deployer: Deployer, sim: SimBackend
) -> None:
    profile = deployer.settings.images.profile("debian-12")
    target = BuildTarget("node1", "local-lvm")
    for installation, name in ((deployer.store.installation_id, "lost"), ("zzzzzzzzzz", "theirs")):
        row = Build(
            state=BuildState.PUBLISHED,
            requester="x",
            profile="debian-12",
            backend="sim",
            name=name,
            version=1,
            installation=installation,
            created_at=utcnow() - timedelta(days=1),
        )
        plan = plan_for(row, profile)  # never recorded in this store
        await sim.create_template(plan, target, await sim.prepare_build(plan, target), None)
    report = await retire.dry_run(deployer.store, deployer.backends, ["sim"], keep=1)
    assert categories(report) == {"lost-v1": "failed_build", "theirs-v1": "other_installation"}
