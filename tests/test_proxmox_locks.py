"""Locks that do not clear (issue 11, item 7): a template or VM held by a backup
(`lock: backup` in its config) is waited for a bounded time, by reading its config
rather than sending the call again, then the call fails naming the lock and what to do;
`deploybot gc` says "VM is locked (backup)" in its report. Against the fake Proxmox API
over HTTPS; the gc command runs as its own process."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from backends.base import CloneSpec, Locked, VMRef
from backends.proxmox import ProxmoxBackend, create
from backends.proxmox.config import Config
from bot.models import JobState
from bot.operations import gc
from handlers.messages.slack import gc_report
from store.db import Store
from tests.support.contract import IDENTITY
from tests.support.deployer import Recorder
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import (
    config_data,
    config_text,
    make_backend,
    pve_settings,
    start_fake,
)
from tests.support.proxmox import ADDRESS, ORIGINAL, deploy, free_port, ours_left

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

CLONE = "/nodes/{node}/qemu/{vmid}/clone"
CONFIG = "/nodes/{node}/qemu/{vmid}/config"
STOP = "/nodes/{node}/qemu/{vmid}/status/stop"
DELETE = "/nodes/{node}/qemu/{vmid}"


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    proxmox = make_backend(pve)  # lock_backoff_s 0.01, lock_wait_s 0.5
    yield proxmox
    await proxmox.close()


def backed_up(fake: FakePVE, vmid: int) -> None:
    """What vzdump does for the length of a backup (and what a backup that died leaves)."""
    fake.cluster.vms[vmid].config["lock"] = "backup"


def config_reads(fake: FakePVE, vmid: str | int, since: float = 0.0) -> int:
    reads = fake.sent("GET", CONFIG)
    return len([r for r in reads if r.path_params["vmid"] == str(vmid) and r.at_s > since])


async def ends_once_polled(fake: FakePVE, vmid: int, refused: Callable[[], float | None]) -> None:
    """The backup ends once the backend has read the VM's config three times since the
    lock refused it (`refused()`: when, or None before): it waits by looking, where a
    client that sent its call again would have been refused a second time already."""

    def polled() -> bool:
        since = refused()
        return since is not None and config_reads(fake, vmid, since) >= 3

    await fake.answered(polled)
    del fake.cluster.vms[vmid].config["lock"]


async def test_a_template_held_by_a_backup_fails_the_deploy_after_one_clone_request(
    pve: FakePVE, tmp_path: Path
) -> None:
    backed_up(pve, 9000)
    job, _events = await deploy(pve, pve_settings(tmp_path, pve), f"web01 {ADDRESS}")
    assert (job.state, job.failed_step) == (JobState.FAILED, "clone")
    error = job.error or ""
    assert "VM is locked (backup): a backup (vzdump) of template ubuntu-24.04 (VM 9000)" in error
    assert "still after 0.5 s" in error and "`qm unlock 9000` on pve1" in error
    assert "try again" not in error.lower()
    # One clone request: while the config says `lock: backup` another one cannot work.
    assert [r.status for r in pve.sent("POST", CLONE)] == [500]
    # The wait reads the template's config at 0.01, 0.02, 0.04 ... s, up to 0.5 s: a few
    # reads (and the ones discovery made before), not one request per poll interval.
    assert config_reads(pve, 9000) <= 9
    assert ours_left(pve) == [] and set(pve.cluster.vms) == ORIGINAL
    assert pve.cluster.vms[9000].config["lock"] == "backup"  # none of our business


async def test_a_backup_that_ends_during_the_wait_lets_the_deploy_go_on(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        backed_up(fake, 9000)
        settings = pve_settings(tmp_path, fake, backends=[config_data(fake, lock_wait_s=5.0)])

        def refused() -> float | None:
            clones = fake.sent("POST", CLONE)
            return clones[0].at_s if clones else None

        ending = asyncio.create_task(ends_once_polled(fake, 9000, refused))
        job, _events = await deploy(fake, settings, f"web01 {ADDRESS}", Recorder())
        ending.cancel()  # a client that never looked at the lock never ended the backup
    assert job.state is JobState.SUCCEEDED, job.error
    assert [r.status for r in fake.sent("POST", CLONE)] == [500, 200]


async def running_vm(backend: ProxmoxBackend) -> VMRef:
    spec = CloneSpec("jlock01", "web01", "ubuntu-24.04")
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    return ref


async def test_a_stop_of_a_vm_held_by_a_backup_fails_naming_the_lock(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    ref = await running_vm(backend)
    backed_up(pve, int(ref.vm_id))
    with pytest.raises(Locked) as failure:
        await backend.power_off(ref)
    assert failure.value.lock == "backup" and not failure.value.retryable
    assert failure.value.message.startswith(
        f"stop of VM {ref.vm_id}: VM is locked (backup): a backup (vzdump) of VM {ref.vm_id} "
        "is running, still after 0.5 s. Wait until that has finished"
    )
    assert len(pve.sent("POST", STOP)) == 1  # the stop task said so once; then config reads
    assert pve.cluster.vms[int(ref.vm_id)].running


async def test_a_destroy_waits_for_a_backup_to_end(pve: FakePVE) -> None:
    backend = make_backend(pve, lock_wait_s=5.0)
    try:
        spec = CloneSpec("jlock02", "web02", "ubuntu-24.04")
        ref = await backend.prepare_clone(spec)
        await backend.clone(spec, ref)
        backed_up(pve, int(ref.vm_id))

        def refused() -> float | None:
            tasks = pve.cluster.tasks.values()
            return next((t.ended_s for t in tasks if t.type == "qmdestroy"), None)

        ending = asyncio.create_task(ends_once_polled(pve, int(ref.vm_id), refused))
        try:
            await backend.destroy(ref)
        finally:
            ending.cancel()  # a client that never looked at the lock never ended the backup
    finally:
        await backend.close()
    assert int(ref.vm_id) not in pve.cluster.vms
    destroys = [t.exitstatus for t in pve.cluster.tasks.values() if t.type == "qmdestroy"]
    assert destroys == ["VM is locked (backup)", "OK"]


# --- deploybot gc ------------------------------------------------------------------------


async def test_deploybot_gc_says_which_vm_is_locked_and_leaves_it(
    pve: FakePVE, tmp_path: Path
) -> None:
    config = tmp_path / "deploybot.toml"
    config.write_text(config_text(pve, tmp_path, None), encoding="utf-8")
    store = await Store.open(tmp_path / "deploybot.db")  # the database the config names
    backend = make_backend(pve)
    try:
        refs = []
        for job, name in (("jghostlock1", "ghost1"), ("jghostfree1", "ghost2")):
            spec = CloneSpec(job, name, "ubuntu-24.04", installation=store.installation_id)
            refs.append(await backend.prepare_clone(spec))
            await backend.clone(spec, refs[-1])
    finally:
        await backend.close()
        await store.close()
    held, free = refs
    backed_up(pve, int(held.vm_id))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env.update(DEPLOYBOT_CONFIG=str(config), PVE_TOKEN_SECRET=pve.token_secret)

    async def gc_cli(*args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("deploybot")),
            "gc",
            *args,
            env=env,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode is not None
        return process.returncode, out.decode() + err.decode()

    code, dry = await gc_cli()
    assert code == 0, dry
    assert f"orphan: VM {held.vm_id} (ghost1) on pve, job jghostlock1" in dry
    assert "    VM is locked (backup): another operation holds it" in dry
    assert f"`qm unlock {held.vm_id}`" in dry and "try again" not in dry
    code, applied = await gc_cli("--apply")
    assert code == 1, applied  # not everything it was asked to remove is gone
    assert f"  removed: VM {free.vm_id} (ghost2) on pve" in applied
    assert f"  left: VM {held.vm_id} (ghost1) on pve: VM is locked (backup): " in applied
    assert "Found 2 orphan(s), removed 1, left 1." in applied
    assert int(held.vm_id) in pve.cluster.vms and int(free.vm_id) not in pve.cluster.vms
    touched = [r for r in pve.requests if r.method != "GET" and r.path_params.get("vmid")]
    assert held.vm_id not in {r.path_params["vmid"] for r in touched}  # never sent a thing


async def test_gc_never_says_try_again_for_a_refusal(pve: FakePVE, tmp_path: Path) -> None:
    """A backend that refuses our credentials will refuse them again: say what to fix."""
    store = await Store.open(tmp_path / "jobs.db")
    wrong = create(Config.model_validate(config_data(pve)), {"PVE_TOKEN_SECRET": "wrong"})
    try:
        report = await gc.dry_run(store, {"pve": wrong}, ["pve"])
    finally:
        await wrong.close()
        await store.close()
    text = "\n".join(gc_report(report, 30))
    assert "pve: refused to be asked (" in text and "check $PVE_TOKEN_SECRET" in text
    assert "try again" not in text
