"""ProxmoxBackend's deploy moves against the fake Proxmox API: discovery, linked vs full
clones, vmid collisions, lock timeouts, the identity change, OS profiles and the CPU
baseline, resize, start, the guest agent, and rollback."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from urllib.parse import quote, unquote

import pytest

from backends.base import (
    CloneSpec,
    Identity,
    Locked,
    NotOurVM,
    PermanentError,
    RetryableError,
    VMRef,
)
from backends.proxmox import ProxmoxBackend
from backends.proxmox.apierrors import TaskFailed
from tests.fakepve import testing
from tests.fakepve.server import FakePVE, Recorded
from tests.fakepve.testing import make_backend, start_fake

# The fake server's fixtures, shared by the Proxmox test modules.
pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

KEYS = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 alice@laptop",
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7vbqajDhA+17i/tw3ZJ8 bob's key (2024) +ops",
)
IDENTITY = Identity(
    hostname="web01",
    user="ubuntu",
    ssh_keys=KEYS,
    address=ipaddress.IPv4Interface("127.0.10.50/24"),
    gateway=ipaddress.IPv4Address("127.0.10.1"),
    dns=(ipaddress.IPv4Address("127.0.10.2"), ipaddress.IPv4Address("127.0.10.3")),
    search_domain="lab.example",
    upgrade=False,
    cores=2,
    memory_mib=2048,
)
CLONE = "/nodes/{node}/qemu/{vmid}/clone"
CONFIG = "/nodes/{node}/qemu/{vmid}/config"


@pytest.fixture
async def backend(pve: FakePVE) -> AsyncIterator[ProxmoxBackend]:
    proxmox = make_backend(pve)
    yield proxmox
    await proxmox.close()


async def cloned(
    backend: ProxmoxBackend,
    template: str = "ubuntu-24.04",
    job: str = "jtest01",
    *,
    name: str = "web01",
    placement: str | None = None,
    storage: str | None = None,
) -> VMRef:
    spec = CloneSpec(job, name, template, placement, storage)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    return ref


def config_of(fake: FakePVE, ref: VMRef) -> dict[str, str]:
    return fake.cluster.vms[int(ref.vm_id)].config


def mutations(fake: FakePVE, vmid: str) -> list[Recorded]:
    return [r for r in fake.requests if r.method != "GET" and r.path_params.get("vmid") == vmid]


def no_task_running(fake: FakePVE) -> bool:
    return all(t.exitstatus is not None for t in fake.cluster.tasks.values())


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


# --- identity --------------------------------------------------------------------------


async def test_identity_is_one_config_change(backend: ProxmoxBackend, pve: FakePVE) -> None:
    ref = await cloned(backend)
    assert await backend.apply_identity(ref, IDENTITY) is None
    (change,) = pve.sent("POST", CONFIG)
    sent = change.params
    assert sent["ciupgrade"] == "0"  # unchecked: explicit, since the server default is 1
    assert sent["sshkeys"] == quote("\n".join(KEYS), safe="") and "+" not in sent["sshkeys"]
    assert sent["ipconfig0"] == "ip=127.0.10.50/24,gw=127.0.10.1"
    assert (sent["nameserver"], sent["searchdomain"]) == ("127.0.10.2 127.0.10.3", "lab.example")
    assert (sent["cores"], sent["memory"], sent["agent"]) == ("2", "2048", "1")
    # The bare host name and the domain apart: Proxmox's generated user-data then gives
    # the guest `fqdn: web01.lab.example` (name + searchdomain) and manages /etc/hosts.
    assert (sent["name"], sent["ciuser"], sent["cpu"]) == ("web01", "ubuntu", "x86-64-v2-AES")
    config = config_of(pve, ref)
    assert unquote(config["sshkeys"]) == "\n".join(KEYS)  # two keys and comments, exactly
    assert "deploybot-jtest01" in config["tags"].split(";")
    assert "tag: deploybot-jtest01" in config["description"]
    assert "net0" not in sent  # profile NIC model and bridge already right


async def test_ciupgrade_follows_the_request(backend: ProxmoxBackend, pve: FakePVE) -> None:
    ref = await cloned(backend)
    upgrade = Identity(**{**IDENTITY.__dict__, "upgrade": True, "ssh_keys": ()})
    await backend.apply_identity(ref, upgrade)
    (change,) = pve.sent("POST", CONFIG)
    assert change.params["ciupgrade"] == "1" and "sshkeys" not in change.params


async def test_ciupgrade_is_not_sent_to_a_7_4_server(pve_schema, pve_tls) -> None:  # type: ignore[no-untyped-def]
    async with start_fake(pve_schema, pve_tls, release="7.4") as old:
        backend = make_backend(old)
        try:
            ref = await cloned(backend)
            note = await backend.apply_identity(ref, IDENTITY)
            await backend.apply_identity(ref, IDENTITY)
            await backend.grow_disk(ref, 1)  # before 8.0 resize answers null: no task
        finally:
            await backend.close()
        changes = old.sent("POST", CONFIG)
        assert [c.status for c in changes] == [200, 200]
        assert all("ciupgrade" not in c.params for c in changes)
        assert note is not None and note.startswith("server 7.4: ciupgrade not sent")
        assert len(old.sent("GET", "/version")) == 1  # read once
        assert config_of(old, ref)["scsi0"].endswith("size=5G")


@pytest.mark.parametrize(
    ("template", "cpu"),
    [("ubuntu-24.04", "x86-64-v2-AES"), ("rocky-9", "x86-64-v2-AES"), ("rocky-10", "x86-64-v3")],
)
async def test_the_cpu_comes_from_the_os_profile(
    backend: ProxmoxBackend,
    pve: FakePVE,
    template: str,
    cpu: str,
) -> None:
    ref = await cloned(backend, template)
    await backend.apply_identity(ref, IDENTITY)
    assert config_of(pve, ref)["cpu"] == cpu
    if template == "rocky-9":
        assert config_of(pve, ref)["tags"] == "deploybot-jtest01;os-el9"  # the template's kept


async def test_profiles_and_site_defaults_are_configurable(pve: FakePVE) -> None:
    backend = make_backend(
        pve,
        cpu="host",
        bridge="vmbr1",
        os_profiles={"el9": {"cpu": "x86-64-v3", "nic_model": "e1000"}},
    )
    try:
        ubuntu = await cloned(backend)
        rocky = await cloned(backend, "rocky-9", job="jtest02", name="db01")
        mac = config_of(pve, ubuntu)["net0"].split(",")[0].split("=")[1]
        await backend.apply_identity(ubuntu, IDENTITY)
        await backend.apply_identity(rocky, IDENTITY)
    finally:
        await backend.close()
    assert config_of(pve, ubuntu)["cpu"] == "host"
    assert config_of(pve, ubuntu)["net0"] == f"virtio={mac},bridge=vmbr1"  # MAC kept
    assert config_of(pve, rocky)["cpu"] == "x86-64-v3"
    assert config_of(pve, rocky)["net0"].startswith("e1000=")


async def test_a_node_without_avx2_is_refused_before_cloning(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    pve.cluster.storages["local-lvm"].shared = True  # so pve2 could take a clone at all
    with pytest.raises(PermanentError) as refused:
        await backend.prepare_clone(CloneSpec("jv3", "db01", "rocky-10", placement="pve2"))
    message = refused.value.message
    assert "needs CPU model x86-64-v3" in message and "node pve2" in message and "avx2" in message
    assert pve.sent("GET", "/cluster/nextid") == [] and pve.sent("POST", CLONE) == []
    ok = await backend.prepare_clone(CloneSpec("jv2", "db02", "rocky-9", placement="pve2"))
    assert ok.placement == "pve2@lab"
    await backend.prepare_clone(CloneSpec("jv3", "db01", "rocky-10", placement="pve1"))


async def test_a_baseline_refusal_does_not_send_a_local_template_elsewhere(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    """The template sits on pve2's local storage and pve2 lacks AVX2: "deploy on another
    node" would be wrong advice, since no other node can clone it."""
    pve.cluster.add_template(9010, "rocky-10-pve2", node="pve2", tags="os-el10")
    with pytest.raises(PermanentError) as refused:
        await backend.prepare_clone(CloneSpec("jv4", "db04", "rocky-10-pve2"))
    message = refused.value.message
    assert "needs CPU model x86-64-v3" in message and "node pve2" in message
    assert "on=NODE" not in message
    assert "local storage local-lvm, so no other node can clone it" in message


async def test_without_cpu_flags_the_offered_models_decide(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    pve.cluster.storages["local-lvm"].shared = True
    for node in pve.cluster.nodes.values():
        node.flags = None  # the schema does not promise `flags`
    with pytest.raises(PermanentError, match="does not offer x86-64-v3"):
        await backend.prepare_clone(CloneSpec("jv3", "db01", "rocky-10", placement="pve2"))
    assert len(pve.sent("GET", "/nodes/{node}/capabilities/qemu/cpu")) == 1


# --- resize and start ------------------------------------------------------------------------


async def test_grow_only_and_never_twice(pve: FakePVE) -> None:
    backend = make_backend(pve, request_timeout_s=0.3)
    try:
        ref = await cloned(backend)
        with pytest.raises(PermanentError, match="shrinking"):
            await backend.grow_disk(ref, -1)
        await backend.grow_disk(ref, 0)
        assert pve.sent("PUT", "/nodes/{node}/qemu/{vmid}/resize") == []
        pve.inject("resize", "delay", delay_s=0.6)  # done on the server, the answer lost
        with pytest.raises(RetryableError):
            await backend.grow_disk(ref, 10)
        await backend.grow_disk(ref, 10)  # the retry asks for the same absolute size
        await pve.settled()  # the first answer, and its task, came in the end
    finally:
        await backend.close()
    sent = [
        (r.status, r.params["size"]) for r in pve.sent("PUT", "/nodes/{node}/qemu/{vmid}/resize")
    ]
    assert sent == [(200, "14G"), (200, "14G")]  # both done; with "+10G" it would be 24G
    assert config_of(pve, ref)["scsi0"].endswith("size=14G")


async def test_a_growth_asked_again_by_a_new_process_aims_at_the_same_size(
    pve: FakePVE,
) -> None:
    """A job resumed after a restart asks for its growth again, not knowing whether the
    dead process's resize happened: the size the identity change marked on the VM
    fixes the target, so the disk grows once."""
    first = make_backend(pve)
    try:
        ref = await cloned(first)
        await first.apply_identity(ref, IDENTITY)
        assert "\ndisk-bytes: 4294967296\n" in config_of(pve, ref)["description"]
        await first.grow_disk(ref, 10)
    finally:
        await first.close()
    for _ in range(2):  # two later lives of the bot, with nothing in memory
        later = make_backend(pve)
        try:
            await later.apply_identity(ref, IDENTITY)  # resumed at the identity: mark kept
            await later.grow_disk(ref, 10)
        finally:
            await later.close()
    sent = [r.params["size"] for r in pve.sent("PUT", "/nodes/{node}/qemu/{vmid}/resize")]
    assert sent == ["14G"]  # the later lives found it done
    assert config_of(pve, ref)["scsi0"].endswith("size=14G")
    assert config_of(pve, ref)["description"].count("disk-bytes:") == 1


async def test_power_on_tolerates_a_retry(backend: ProxmoxBackend, pve: FakePVE) -> None:
    ref = await cloned(backend)
    await backend.power_on(ref)
    await backend.power_on(ref)  # a retry after a lost answer: "already running" is fine
    assert pve.cluster.vms[int(ref.vm_id)].running
    pve.inject("start", "task_error", message="start failed: QEMU exited with code 1")
    other = await cloned(backend, job="jtest02", name="web02")
    with pytest.raises(TaskFailed, match="QEMU exited with code 1"):
        await backend.power_on(other)


# --- the guest agent --------------------------------------------------------------------------


async def test_the_address_skips_loopback_link_local_and_docker(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    ref = await cloned(backend)
    await backend.apply_identity(
        ref,
        Identity(
            **{
                **IDENTITY.__dict__,
                "address": ipaddress.IPv4Interface("10.9.0.7/24"),
                "gateway": ipaddress.IPv4Address("10.9.0.1"),
            }
        ),
    )
    await backend.power_on(ref)
    assert await backend.wait_for_address(ref, None) == ipaddress.IPv4Address("10.9.0.7")
    ping = pve.sent("POST", "/nodes/{node}/qemu/{vmid}/agent/ping")
    assert [r.status for r in ping] == [500] * (len(ping) - 1) + [200]
    agent = pve.sent("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces")
    assert [r.status for r in agent] == [200]  # asked only once the agent answered ping


async def test_an_agent_that_never_answers_is_named(backend: ProxmoxBackend) -> None:
    ref = await cloned(backend, "bare-ubuntu")
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    with pytest.raises(
        RetryableError, match=r"has not answered in \d+ s \(does the template have qemu-guest-agent"
    ):
        await backend.wait_for_address(ref, IDENTITY.address.ip)


async def test_an_agent_without_the_address_says_what_it_saw(backend: ProxmoxBackend) -> None:
    ref = await cloned(backend)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    elsewhere = ipaddress.IPv4Address("127.0.10.99")
    with pytest.raises(RetryableError) as failure:
        await backend.wait_for_address(ref, elsewhere)
    message = failure.value.message
    assert "answers but reports no usable address (expected 127.0.10.99)" in message
    assert "docker0 172.17.0.1" in message and "eth0 127.0.10.50" in message


async def test_a_guest_on_another_address_is_not_taken(backend: ProxmoxBackend) -> None:
    """A routable address other than the one asked for (a real guest whose cloud-init
    seed does not parse falls back to DHCP) is no address: the deploy would otherwise be
    handed over on a guest without its user or key."""
    ref = await cloned(backend)
    lease = ipaddress.IPv4Interface("10.9.0.7/24")
    await backend.apply_identity(
        ref, Identity(**{**IDENTITY.__dict__, "address": lease, "gateway": lease.ip + 1})
    )
    await backend.power_on(ref)
    with pytest.raises(RetryableError) as failure:
        await backend.wait_for_address(ref, ipaddress.IPv4Address("10.9.0.60"))
    message = failure.value.message
    assert "answers but reports no usable address (expected 10.9.0.60)" in message
    assert "eth0 10.9.0.7" in message and "(is cloud-init applying ipconfig0?)" in message


async def test_a_stopped_vm_has_no_address(backend: ProxmoxBackend) -> None:
    ref = await cloned(backend)
    await backend.apply_identity(ref, IDENTITY)
    with pytest.raises(PermanentError, match="is not running"):
        await backend.wait_for_address(ref, IDENTITY.address.ip)


# --- rollback and ownership ------------------------------------------------------------------


async def test_rollback_waits_for_the_stop_before_deleting(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    pve.cluster.timings.stop_s = 0.2
    ref = await cloned(backend)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    await backend.power_off(ref)
    await backend.destroy(ref)
    assert int(ref.vm_id) not in pve.cluster.vms
    (stop,) = [t for t in pve.cluster.tasks.values() if t.type == "qmstop"]
    deletes = pve.sent("DELETE", "/nodes/{node}/qemu/{vmid}")
    assert stop.ended_s is not None and deletes[-1].at_s >= stop.ended_s
    assert deletes[-1].params == {"purge": "1", "destroy-unreferenced-disks": "1"}
    await backend.power_off(ref)  # gone is gone
    await backend.destroy(ref)
    assert await backend.find_vm(ref) is None


async def test_a_vm_without_the_job_tag_is_never_touched(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    foreign = VMRef("100", "jother1", "pve1@lab")
    for move in (backend.power_off, backend.destroy, backend.power_on):
        with pytest.raises(NotOurVM, match="does not carry tag deploybot-jother1"):
            await move(foreign)
    with pytest.raises(NotOurVM):
        await backend.apply_identity(foreign, IDENTITY)
    with pytest.raises(NotOurVM):
        await backend.grow_disk(foreign, 1)
    assert await backend.find_vm(foreign) is None
    assert mutations(pve, "100") == [] and pve.cluster.vms[100].running


async def test_a_destroy_that_fails_names_the_vm_left(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    ref = await cloned(backend)
    pve.inject("delete", "task_error", message="volume deactivation failed")
    # Retryable: the VM is still there, and destroying it is the whole point of a rollback.
    with pytest.raises(
        RetryableError, match=f"volume deactivation failed.*VM {ref.vm_id} is left on pve1"
    ):
        await backend.destroy(ref)
    await backend.destroy(ref)
    assert int(ref.vm_id) not in pve.cluster.vms


async def test_finding_vms(backend: ProxmoxBackend, pve: FakePVE) -> None:
    bare = await cloned(backend)  # description mark only: no identity, no tags yet
    dressed = await cloned(backend, job="jtest02", name="web02")
    await backend.apply_identity(dressed, IDENTITY)
    tagged = {v.vm_id: v for v in await backend.find_tagged()}
    assert set(tagged) == {bare.vm_id, dressed.vm_id}
    assert "deploybot-jtest01" in tagged[bare.vm_id].tags
    assert [v.vm_id for v in await backend.find_by_name("web-template")] == ["100"]
    assert await backend.find_by_name("ubuntu-24.04") == []  # templates are not VMs


async def test_a_vm_moved_to_another_node_is_still_found(
    backend: ProxmoxBackend,
    pve: FakePVE,
) -> None:
    ref = await cloned(backend)
    pve.cluster.vms[int(ref.vm_id)].node = "pve2"  # migrated since
    info = await backend.find_vm(ref)
    assert info is not None and info.placement == "pve2"
    await backend.destroy(ref)
    assert int(ref.vm_id) not in pve.cluster.vms


async def test_a_ref_from_another_cluster_is_refused(backend: ProxmoxBackend, pve: FakePVE) -> None:
    ref = await cloned(backend)
    elsewhere = VMRef(ref.vm_id, ref.job_id, "pve1@other")
    with pytest.raises(PermanentError, match="built on cluster other"):
        await backend.destroy(elsewhere)
    assert int(ref.vm_id) in pve.cluster.vms


async def test_the_task_waiter_has_a_timeout(pve: FakePVE) -> None:
    backend = make_backend(pve, task_timeout_s=0.2)
    pve.cluster.timings.clone_s = 5.0
    try:
        with pytest.raises(
            PermanentError, match=r"task UPID:pve1:.*:qmclone:9000:.* still running after 0\.2 s"
        ):
            await cloned(backend)
    finally:
        await backend.close()
    polls = pve.sent("GET", "/nodes/{node}/tasks/{upid}/status")
    # Polled, and every poll counted. The timeout may cancel the last poll after it was
    # counted but before the server saw it, so the two may differ by that one.
    assert len(polls) > 2
    assert len(polls) <= backend.api.task_polls <= len(polls) + 1


async def test_a_clone_whose_answer_was_lost_is_adopted_not_repeated(pve: FakePVE) -> None:
    backend = make_backend(pve, request_timeout_s=0.2, lock_backoff_s=0.3)
    pve.inject("clone", "delay", delay_s=0.3)  # the server clones; its answer comes too late
    try:
        ref = await cloned(backend)
    finally:
        await backend.close()
    assert [r.status for r in pve.sent("POST", CLONE)] == [200]  # sent once, never again
    assert no_task_running(pve) and "lock" not in config_of(pve, ref)
    ours = [
        vm
        for vm in pve.cluster.vms.values()
        if "deploybot-jtest01" in vm.config.get("description", "")
    ]
    assert [vm.vmid for vm in ours] == [int(ref.vm_id)]
