"""ProxmoxBackend reads a guest's SSH host keys through the guest agent's file-read
(ReadsHostKeys), against the fake Proxmox: the keys are the guest's files and the ones
its sshd presents; an agent not up yet is retryable; a refusal names the privilege of
the server's release, and so does `missing_privileges` (`deploybot check`)."""

from __future__ import annotations

import asyncssh
import pytest

from backends.base import PermanentError, RetryableError, VMRef
from backends.proxmox import ProxmoxBackend
from backends.proxmox.hostkeys import HOST_KEY_FILES
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import make_backend, start_fake
from tests.support.proxmox import IDENTITY, backend, cloned, free_port, pve, pve_schema, pve_tls

__all__ = ["backend", "pve", "pve_schema", "pve_tls"]  # fixtures, used by name

READ = "/nodes/{node}/qemu/{vmid}/agent/file-read"


async def running(backend: ProxmoxBackend, template: str = "ubuntu-24.04") -> VMRef:
    ref = await cloned(backend, template)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    return ref


def key_file(fake: FakePVE, ref: VMRef, kind: str) -> str:
    text = fake.cluster.vms[int(ref.vm_id)].files[f"/etc/ssh/ssh_host_{kind}_key.pub"].decode()
    return " ".join(text.split()[:2])


async def test_the_host_keys_are_the_guests_files_read_through_the_agent(
    backend: ProxmoxBackend, pve: FakePVE, pve_schema: ApiSchema
) -> None:
    assert backend.host_keys_through == "the QEMU guest agent"
    ref = await running(backend)
    await backend.wait_for_address(ref, IDENTITY.address.ip)
    keys = await backend.host_keys(ref)
    assert keys == [key_file(pve, ref, "ed25519"), key_file(pve, ref, "ecdsa")]
    assert keys[0].startswith("ssh-ed25519 ") and keys[1].startswith("ecdsa-sha2-nistp256 ")
    reads = pve.sent("GET", READ)
    assert [r.params["file"] for r in reads] == list(HOST_KEY_FILES)
    assert [r.status for r in reads] == [200, 200, 500]  # no RSA key in this guest: skipped
    for r in reads:
        assert pve_schema.check(READ, "GET", {**r.params, **r.path_params}) == {}


async def test_the_guests_sshd_presents_the_key_read_through_the_agent(
    pve_schema: ApiSchema, pve_tls: Tls
) -> None:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        proxmox = make_backend(fake)
        try:
            ref = await running(proxmox)
            address = await proxmox.wait_for_address(ref, IDENTITY.address.ip)
            vm = fake.cluster.vms[int(ref.vm_id)]
            assert vm.boot is not None
            await vm.boot  # sshd up
            keys = await proxmox.host_keys(ref)
            assert fake.cluster.guest.ssh_port is not None
            presented = await proxmox.probe_ssh(ref, address, fake.cluster.guest.ssh_port)
        finally:
            await proxmox.close()
    fingerprints = [asyncssh.import_public_key(k).get_fingerprint("sha256") for k in keys]
    assert presented is not None
    assert presented in keys and fingerprints  # the key line, one of those read


async def test_an_agent_not_running_yet_is_retryable(backend: ProxmoxBackend) -> None:
    ref = await running(backend, "bare-ubuntu")  # agent enabled, never answers
    with pytest.raises(RetryableError, match="guest agent is not running"):
        await backend.host_keys(ref)


@pytest.mark.parametrize(
    ("release", "revoke", "named"),
    [
        ("8.2", ["VM.Monitor"], "VM.Monitor"),
        (
            "9.0",
            ["VM.GuestAgent.FileRead", "VM.GuestAgent.Unrestricted"],
            "VM.GuestAgent.FileRead (or VM.GuestAgent.Unrestricted)",
        ),
    ],
)
async def test_a_refusal_names_the_privilege_of_the_release(
    pve_schema: ApiSchema, pve_tls: Tls, release: str, revoke: list[str], named: str
) -> None:
    async with start_fake(pve_schema, pve_tls, release=release) as fake:
        proxmox = make_backend(fake)
        try:
            ref = await running(proxmox)
            await proxmox.wait_for_address(ref, IDENTITY.address.ip)
            for privilege in revoke:
                fake.acl.revoke(privilege)
            with pytest.raises(PermanentError) as refused:
                await proxmox.host_keys(ref)
            missing = await proxmox.missing_privileges("ubuntu-24.04")
        finally:
            await proxmox.close()
    message = refused.value.message
    assert f"grant {named} on /vms" in message
    assert "root@pam!deploybot may not read files through the QEMU guest agent" in message
    assert "try again" not in message
    steps = {m.privilege: m.step for m in missing if m.where == "/vms"}
    assert "read the SSH host keys through the guest agent (file-read)" in steps.values()
    assert revoke[0] in steps


async def test_a_full_token_on_9_lacks_nothing_for_the_agent(
    pve_schema: ApiSchema, pve_tls: Tls
) -> None:
    """On PVE 9 VM.Monitor no longer exists: asking for it would be a false alarm."""
    async with start_fake(pve_schema, pve_tls, release="9.0") as fake:
        proxmox = make_backend(fake)
        try:
            assert await proxmox.missing_privileges("ubuntu-24.04") == []
            fake.acl.revoke("VM.GuestAgent.FileRead")  # Unrestricted will do
            assert await proxmox.missing_privileges("ubuntu-24.04") == []
        finally:
            await proxmox.close()
