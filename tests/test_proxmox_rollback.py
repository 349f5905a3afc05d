"""A Proxmox rollback finishes (issue 11, item 7): a deploy whose guest agent stays silent
is rolled back, and one HTTP 500 on its stop, or a VM found running again by the destroy,
still ends with the VM gone. Against the fake Proxmox API over HTTPS; the pipeline runs
in process, `deploybot deploy` as its own process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.base import CloneSpec, RetryableError, VMRef
from backends.proxmox import ProxmoxBackend
from bot.config.sections import Timeouts
from bot.jobs.waiting import remove_vm
from bot.models import JobState
from tests.support.contract import IDENTITY
from tests.support.deployer import Recorder
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import (
    config_text,
    make_backend,
    pve_settings,
    run_deploybot,
    start_fake,
)
from tests.support.proxmox import ADDRESS, ORIGINAL, deploy, free_port, ours_left

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

STOP = "/nodes/{node}/qemu/{vmid}/status/stop"
DELETE = "/nodes/{node}/qemu/{vmid}"
# What pmxcfs answers when /etc/pve hiccups under the API: a plain 500, no lock, no code.
CFS_500 = "unable to open file '/etc/pve/nodes/pve1/qemu-server/101.conf.tmp.4242' - I/O error"
FAST = Timeouts(retry_initial_s=0.01, retry_max_s=0.05, power_off_s=3, destroy_s=3)


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    proxmox = make_backend(pve)
    yield proxmox
    await proxmox.close()


async def running_vm(backend: ProxmoxBackend, job: str = "jroll01") -> VMRef:
    spec = CloneSpec(job, "web01", "ubuntu-24.04")
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    return ref


def silent_agent(fake: FakePVE) -> None:
    """The template's guests never start qemu-guest-agent: the address step times out
    with the VM running, so the rollback has a VM to stop."""
    fake.cluster.vms[9000].agent_installed = False


def stop_ended_before_the_last_delete(fake: FakePVE) -> bool:
    stops = [t for t in fake.cluster.tasks.values() if t.type == "qmstop"]
    deletes = fake.sent("DELETE", DELETE)
    return bool(stops) and all(
        s.ended_s is not None and s.ended_s <= deletes[-1].at_s for s in stops
    )


async def test_a_rollback_whose_stop_meets_a_500_ends_with_the_vm_gone(
    pve: FakePVE, tmp_path: Path
) -> None:
    silent_agent(pve)
    pve.inject("stop", "error", message=CFS_500)  # the rollback's stop is the first one
    settings = pve_settings(tmp_path, pve)
    timeouts = {**settings.timeouts.model_dump(), "address_s": 0.5}
    recorder = Recorder()
    job, events = await deploy(
        pve, pve_settings(tmp_path, pve, timeouts=timeouts), f"web01 {ADDRESS}", recorder
    )
    assert (job.state, job.failed_step) == (JobState.FAILED, "address"), job.error
    await pve.settled()
    assert ours_left(pve) == [] and set(pve.cluster.vms) == ORIGINAL
    assert job.wreckage is None
    _job, report = recorder.finished[job.id]
    assert report is not None and report.clean, report
    assert report.undone == [f"stop VM {job.vm_id}", f"destroy VM {job.vm_id}"]
    assert [r.status for r in pve.sent("POST", STOP)] == [500, 200]  # the stop was sent again
    assert [r.status for r in pve.sent("DELETE", DELETE)] == [200]  # only once it had stopped
    assert stop_ended_before_the_last_delete(pve)
    assert not [e for e in events if e.phase == "undo_failed"]


async def test_a_destroy_that_finds_the_vm_running_stops_it_then_destroys_it(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """`VM <id> is running - destroy failed`: stop, wait for the stop task, destroy again."""
    pve.cluster.timings.stop_s = 0.2  # a delete sent before the stop ended would fail
    ref = await running_vm(backend)
    await backend.destroy(ref)  # no power_off first: the stop failed, or HA started it again
    assert int(ref.vm_id) not in pve.cluster.vms
    deletes = pve.sent("DELETE", DELETE)
    assert [(r.status, r.path_params["vmid"]) for r in deletes] == [
        (500, ref.vm_id),
        (200, ref.vm_id),
    ]
    assert len(pve.sent("POST", STOP)) == 1 and stop_ended_before_the_last_delete(pve)
    assert await backend.find_vm(ref) is None


async def test_a_stop_that_fails_while_the_vm_runs_is_retried(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    ref = await running_vm(backend)
    pve.inject("stop", "error", message=CFS_500)
    with pytest.raises(RetryableError, match=f"I/O error; VM {ref.vm_id} still runs"):
        await backend.power_off(ref)
    pve.inject("stop", "task_error", message="VM quit/powerdown failed")
    with pytest.raises(RetryableError, match=r"powerdown failed.*still runs: stopping it again"):
        await backend.power_off(ref)
    await backend.power_off(ref)
    assert not pve.cluster.vms[int(ref.vm_id)].running


async def test_remove_vm_outlasts_a_fault_on_each_move(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """The core's stop-then-destroy (gc, the wreckage sweep): a 500 on the stop and a
    failed delete task, each retried within its own timeout."""
    ref = await running_vm(backend)
    pve.inject("stop", "error", message=CFS_500)
    pve.inject("delete", "task_error", message="volume deactivation failed")
    await remove_vm(backend, ref, FAST)
    assert int(ref.vm_id) not in pve.cluster.vms
    assert [r.status for r in pve.sent("POST", STOP)] == [500, 200]
    assert len(pve.sent("DELETE", DELETE)) == 2


async def test_a_cli_deploy_rolled_back_after_a_500_on_its_stop_leaves_nothing(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    """The issue's report: `deploybot deploy` (which never retries wreckage later), a
    silent agent, one 500 on the rollback's stop. The VM must be gone when it exits."""
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        silent_agent(fake)
        fake.inject("stop", "error", message=CFS_500)
        config = tmp_path / "deploybot.toml"
        text = config_text(fake, tmp_path, fake.cluster.guest.ssh_port)
        # Fast retries: what a test changes is only how long each pause is.
        text = text.replace('ca_bundle = "', 'task_poll_initial_s = 0.01\nca_bundle = "', 1)
        text += "\n[timeouts]\naddress_s = 1\nretry_initial_s = 0.05\nretry_max_s = 0.2\n"
        config.write_text(text, encoding="utf-8")
        returncode, output = await run_deploybot(
            fake,
            config,
            tmp_path,
            "deploy",
            "web01",
            ADDRESS,
            "--backend",
            "pve",
            "--user",
            "alice",
        )
        await fake.settled()
        assert returncode == 1, output
        assert "Rolled back: stop VM 101; destroy VM 101." in output
        assert "Left behind" not in output and "Rollback problem" not in output
        assert set(fake.cluster.vms) == ORIGINAL
        assert [r.status for r in fake.sent("POST", STOP)] == [500, 200]
