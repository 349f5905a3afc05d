"""ProxmoxBackend's deploy moves against the fake Proxmox API: discovery, linked vs full
clones, vmid collisions, lock timeouts and failed tasks."""

from __future__ import annotations

import asyncio

import pytest

from backends.base import (
    CloneSpec,
    Locked,
    PermanentError,
    RetryableError,
)
from backends.proxmox import ProxmoxBackend
from backends.proxmox.apierrors import TaskFailed
from tests.support.fakepve.server import FakePVE
from tests.support.proxmox import (
    CLONE,
    IDENTITY,
    backend,
    cloned,
    config_of,
    mutations,
    no_task_running,
    pve,
    pve_schema,
    pve_tls,
)

__all__ = ["backend", "pve", "pve_schema", "pve_tls"]  # fixtures, used by name


# --- discovery -----------------------------------------------------------------------------


async def test_templates_come_from_the_template_flag(backend: ProxmoxBackend) -> None:
    templates = {t.name: t for t in await backend.templates()}
    assert sorted(templates) == [
        "bare-ubuntu",
        "debian-12",
        "rocky-10",
        "rocky-9",
        "ubuntu-24.04",
        "ubuntu-thick",
    ]
    assert "web-template" not in templates  # a running VM with a template-like name
    assert templates["rocky-9"].os_family == "el9"  # from its os-el9 tag
    assert templates["rocky-10"].os_family == "el10"  # from its name
    assert (templates["debian-12"].storage, templates["debian-12"].disk_gib) == ("local-lvm", 3)


async def test_storages_come_with_their_capacity(backend: ProxmoxBackend, pve: FakePVE) -> None:
    storages = {s.name: s for s in await backend.storages()}
    assert sorted(storages) == ["bulk-nfs", "local-lvm", "thick-lvm"]  # images only
    nfs = pve.cluster.storages["bulk-nfs"]
    assert storages["bulk-nfs"].total_bytes == nfs.total_bytes
    assert storages["bulk-nfs"].free_bytes == nfs.total_bytes - nfs.used_bytes
    assert (
        storages["local-lvm"].supports_linked_clone
        and not storages["thick-lvm"].supports_linked_clone
    )
    assert len(pve.sent("GET", "/nodes/{node}/storage")) == 1  # capacity from the same call
    assert [n.name for n in await backend.networks("pve2")] == ["vmbr0", "vmbr1"]


# --- clone ---------------------------------------------------------------------------------


async def test_linked_or_full_is_known_before_cloning(backend: ProxmoxBackend) -> None:
    linked = await backend.clone_mode(CloneSpec("j1", "a", "ubuntu-24.04"))
    to_nfs = await backend.clone_mode(CloneSpec("j1", "a", "ubuntu-24.04", storage="bulk-nfs"))
    thick = await backend.clone_mode(CloneSpec("j1", "a", "ubuntu-thick"))
    assert linked.linked and "seconds" in linked.reason
    assert not to_nfs.linked and "not the template's storage" in to_nfs.reason
    assert not thick.linked and "thick-lvm (lvm) cannot hold linked clones" in thick.reason
    assert "full copy, minutes" in to_nfs.reason and "full copy, minutes" in thick.reason
    with pytest.raises(PermanentError, match="can only be cloned on pve1"):
        await backend.clone_mode(CloneSpec("j1", "a", "ubuntu-24.04", placement="pve2"))
    with pytest.raises(PermanentError, match="storage 'nope' does not exist"):
        await backend.clone_mode(CloneSpec("j1", "a", "ubuntu-24.04", storage="nope"))


async def test_a_linked_clone_sends_no_storage_and_a_full_one_does(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    linked = await cloned(backend)
    spec = CloneSpec("jtest02", "web02", "ubuntu-24.04", storage="bulk-nfs")
    full = await backend.prepare_clone(spec)
    note = await backend.clone(spec, full)
    thick = await cloned(backend, "ubuntu-thick", job="jtest03", name="web03")
    sent = {r.params["newid"]: r.params for r in pve.sent("POST", CLONE)}
    assert "full" not in sent[linked.vm_id] and "storage" not in sent[linked.vm_id]
    assert (sent[full.vm_id]["full"], sent[full.vm_id]["storage"]) == ("1", "bulk-nfs")
    assert (sent[thick.vm_id]["full"], sent[thick.vm_id]["storage"]) == ("1", "thick-lvm")
    assert note == "full copy onto bulk-nfs: minutes, not seconds"
    assert config_of(pve, full)["scsi0"].startswith(f"bulk-nfs:vm-{full.vm_id}-disk-0")
    assert config_of(pve, linked)["description"].splitlines()[2] == "tag: deploybot-jtest01"


async def test_no_call_returns_before_its_task_ended(backend: ProxmoxBackend, pve: FakePVE) -> None:
    pve.cluster.timings.clone_s = 0.3
    ref = await cloned(backend)
    assert no_task_running(pve) and "lock" not in config_of(pve, ref)
    await backend.apply_identity(ref, IDENTITY)
    assert no_task_running(pve)
    await backend.grow_disk(ref, 2)
    assert no_task_running(pve)
    await backend.power_on(ref)
    assert no_task_running(pve) and pve.cluster.vms[int(ref.vm_id)].running
    assert all(r.status == 200 for r in pve.requests)  # never `VM is locked (clone)`


async def test_concurrent_deploys_get_distinct_ids(backend: ProxmoxBackend, pve: FakePVE) -> None:
    specs = [CloneSpec(f"jcon{i:03d}", f"web{i}", "ubuntu-24.04") for i in range(6)]
    refs = await asyncio.gather(*(backend.prepare_clone(s) for s in specs))
    assert len({r.vm_id for r in refs}) == 6
    await asyncio.gather(*(backend.clone(s, r) for s, r in zip(specs, refs, strict=True)))
    assert all(config_of(pve, r)["name"] == s.name for s, r in zip(specs, refs, strict=True))


def nextid_checks(pve: FakePVE) -> list[int]:
    """The ids the backend asked `nextid?vmid=` about."""
    return [int(r.params["vmid"]) for r in pve.sent("GET", "/cluster/nextid") if r.params]


async def test_deploys_asking_together_share_one_nextid_and_skip_ids_in_use(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    free = next(i for i in range(100, 1000) if i not in pve.cluster.vms)
    pve.cluster.add_vm(free + 2, "busy")  # a hole after the lowest free id
    await backend.templates()  # the listing that knows the busy one
    specs = [CloneSpec(f"jtog{i:03d}", f"web{i}", "ubuntu-24.04") for i in range(5)]
    refs = await asyncio.gather(*(backend.prepare_clone(s) for s in specs))
    assert sorted(int(r.vm_id) for r in refs) == [free, free + 1, free + 3, free + 4, free + 5]
    answers = [r for r in pve.sent("GET", "/cluster/nextid") if not r.params]
    assert len(answers) == 1  # one shared answer; the ids after it checked one by one
    assert sorted(nextid_checks(pve)) == [free + 1, free + 3, free + 4, free + 5]
    await asyncio.gather(*(backend.clone(s, r) for s, r in zip(specs, refs, strict=True)))
    assert pve.cluster.vms[free + 2].config["name"] == "busy"


@pytest.mark.parametrize("hidden", [False, True])
async def test_an_id_in_use_unknown_to_the_listing_is_skipped(
    backend: ProxmoxBackend, pve: FakePVE, hidden: bool
) -> None:
    """Made after the listing, or never in it: a token limited to a pool does not see
    the cluster's other VMs, but `nextid?vmid=` does."""
    free = next(i for i in range(100, 1000) if i not in pve.cluster.vms)
    if hidden:
        pve.cluster.hidden.add(free + 1)
    await backend.templates()
    pve.cluster.add_vm(free + 1, "newcomer")
    specs = [CloneSpec(f"jnew{i:03d}", f"web{i}", "ubuntu-24.04") for i in range(2)]
    first, second = await asyncio.gather(*(backend.prepare_clone(s) for s in specs))
    assert (int(first.vm_id), int(second.vm_id)) == (free, free + 2)
    await asyncio.gather(
        *(backend.clone(s, r) for s, r in zip(specs, (first, second), strict=True))
    )
    assert pve.cluster.vms[free + 1].config["name"] == "newcomer"
    assert mutations(pve, str(free + 1)) == []


async def test_an_id_someone_we_cannot_see_took_means_a_new_id(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    spec = CloneSpec("jhid001", "web01", "ubuntu-24.04")
    ref = await backend.prepare_clone(spec)
    pve.cluster.add_vm(int(ref.vm_id), "invisible")  # in between, in another pool
    pve.cluster.hidden.add(int(ref.vm_id))
    with pytest.raises(RetryableError, match="taken by another client"):
        await backend.clone(spec, ref)  # 403 on the clone, and the id is in use
    assert mutations(pve, ref.vm_id) == []
    again = await backend.prepare_clone(spec)
    await backend.clone(spec, again)
    assert again.vm_id != ref.vm_id and config_of(pve, again)["name"] == "web01"


async def test_a_vmid_taken_by_another_client_means_a_new_id(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    spec = CloneSpec("jrace01", "web01", "ubuntu-24.04")
    pve.inject("nextid", "race")
    ref = await backend.prepare_clone(spec)
    with pytest.raises(RetryableError, match="taken by another client"):
        await backend.clone(spec, ref)
    intruder = pve.cluster.vms[int(ref.vm_id)]
    assert intruder.config["name"] == f"intruder{ref.vm_id}"
    assert mutations(pve, ref.vm_id) == []  # the intruder was never touched
    again = await backend.prepare_clone(spec)
    await backend.clone(spec, again)
    assert again.vm_id != ref.vm_id and config_of(pve, again)["name"] == "web01"


async def test_a_clone_retried_after_a_lost_answer_adopts_its_own_vm(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    spec = CloneSpec("jlost01", "web01", "ubuntu-24.04")
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    assert await backend.clone(spec, ref) is None  # "config file already exists": ours
    assert len(pve.sent("POST", CLONE)) == 2


@pytest.mark.parametrize("kind", ["lock_timeout", "task_lock_timeout"])
async def test_lock_timeouts_are_retried_with_backoff(
    backend: ProxmoxBackend,
    pve: FakePVE,
    kind: str,
) -> None:
    pve.inject("clone", kind, times=2)  # type: ignore[arg-type]
    ref = await cloned(backend)
    assert config_of(pve, ref)["name"] == "web01"
    assert len(pve.sent("POST", CLONE)) == 3


async def test_a_file_lock_that_never_comes_free_fails_within_its_wait(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    pve.inject("clone", "lock_timeout", times=10_000)
    began = asyncio.get_running_loop().time()
    with pytest.raises(Locked, match=r"can't lock file .* got timeout; still so after 0\.5 s") as e:
        await cloned(backend)
    took = asyncio.get_running_loop().time() - began
    assert not e.value.retryable and e.value.lock == "file lock"
    assert "task list of node pve1" in e.value.message
    # Sent again after 0.01, 0.02, 0.04 ... s until lock_wait_s (0.5 s) is spent: at
    # most 2 + log2(0.5 / 0.01) = 7.6 requests, never one more after the wait is over.
    assert 3 <= len(pve.sent("POST", CLONE)) <= 7
    assert 0.5 <= took < 2.0


async def test_a_failed_task_reports_its_error_and_log(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    pve.inject("clone", "task_error", message="disk full")
    with pytest.raises(TaskFailed) as failure:
        await cloned(backend)
    assert failure.value.exitstatus == "clone failed: disk full"
    assert failure.value.message == (
        f"clone of ubuntu-24.04 into VM {failure.value.vm_id} failed: clone failed: disk full "
        "(task log: create linked clone of drive scsi0 (local-lvm:base-9000-disk-0) | "
        "transferred 0.0 B of 4G (0.00%))"
    )
    assert set(pve.cluster.vms) == {100, 9000, 9001, 9002, 9003, 9004, 9005}


async def test_warnings_are_a_success(backend: ProxmoxBackend, pve: FakePVE) -> None:
    ref = await cloned(backend)
    pve.inject("config", "task_warnings", message="unable to apply pending change")
    await backend.apply_identity(ref, IDENTITY)
    assert config_of(pve, ref)["ciuser"] == "ubuntu"
