"""ProxmoxBackend against the fake Proxmox API once the VM exists: the guest agent's
address, rollback, ownership, finding VMs, and waits that end."""

from __future__ import annotations

import ipaddress
import re

import pytest

from backends.base import (
    Identity,
    NotOurVM,
    PermanentError,
    RetryableError,
    Unreachable,
    VMRef,
)
from backends.proxmox import ProxmoxBackend
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend
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


async def test_a_node_out_of_reach_is_not_blamed_on_the_agent(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """Issue 25, item 13: with the node answering 595 through the boot wait, the wait
    says the node did not answer (Unreachable, the last error), not that the template
    may lack qemu-guest-agent."""
    ref = await cloned(backend)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    pve.inject("agent_ping", "error", times=10_000, status=595, message="No route to host")
    with pytest.raises(Unreachable) as failure:
        await backend.wait_for_address(ref, IDENTITY.address.ip)
    message = failure.value.message
    assert "qemu-guest-agent" not in message
    assert re.fullmatch(
        rf"VM {ref.vm_id}: its guest agent could not be asked in \d+ s: the last \d+ "
        rf"question\(s\) got no answer from the API \(last: guest agent of VM {ref.vm_id}: "
        r"127\.0\.0\.1:\d+ answered 595 No route to host\); check that node pve1 is up "
        "and reachable from the API endpoint",
        message,
    ), message


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
