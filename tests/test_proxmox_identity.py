"""ProxmoxBackend's identity change (cloud-init fields, ciupgrade, OS profiles and the
CPU baseline), disk growth and start, against the fake Proxmox API."""

from __future__ import annotations

from urllib.parse import quote, unquote

import pytest

from backends.base import (
    CloneSpec,
    Identity,
    PermanentError,
    RetryableError,
)
from backends.proxmox import ProxmoxBackend
from backends.proxmox.apierrors import TaskFailed
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend, start_fake
from tests.support.proxmox import (
    CLONE,
    CONFIG,
    IDENTITY,
    KEYS,
    backend,
    cloned,
    config_of,
    pve,
    pve_schema,
    pve_tls,
)

__all__ = ["backend", "pve", "pve_schema", "pve_tls"]  # fixtures, used by name


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
