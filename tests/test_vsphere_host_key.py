"""The host key deploybot chooses for a vSphere or ESXi guest (issue 28), against vcsim
in both modes: the clone or create spec carries it in guestinfo.userdata, and once
the VM is ready `forget_host_key` blanks that document, so that nobody who may read the
VM's configuration can read the private key afterwards. The key never reaches a log."""

# mypy: disable-error-code="no-untyped-call"
# (pyVim and the constructors of pyVmomi's data objects are not typed)

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import pytest

from backends.base import NotOurVM, PermanentError
from backends.vsphere import VSphereBackend
from backends.vsphere.guestinfo import userdata
from tests.support.contract import IDENTITY
from tests.support.hostkeys import chosen_host_key, host_certificate
from tests.support.vsphere.pipeline import cloned
from tests.support.vsphere.simulator import (
    Simulated,
    decode,
    esxi_fixture,  # noqa: F401
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

USERDATA = "guestinfo.userdata"


def test_the_user_data_carries_the_chosen_pair_and_deletes_the_images_keys() -> None:
    pair = chosen_host_key()
    document = userdata(dataclasses.replace(IDENTITY, host_key=pair))
    assert document["ssh_keys"] == {
        "ed25519_private": pair.private_openssh,
        "ed25519_public": pair.public,
    }
    assert document["ssh_deletekeys"] is True
    plain = userdata(IDENTITY)
    assert "ssh_keys" not in plain and "ssh_deletekeys" not in plain


def test_the_host_certificate_rides_with_the_pair_it_certifies() -> None:
    """cloud-init's `ssh_keys: ed25519_certificate` (cc_ssh writes it and sets sshd's
    HostCertificate: tests/test_cloudinit_renderers.py runs it); a certificate of another
    key, a damaged line or one without the chosen key is deploybot's fault, refused."""
    pair = chosen_host_key()
    certificate = host_certificate(pair.public)
    document = userdata(dataclasses.replace(IDENTITY, host_key=pair, host_certificate=certificate))
    assert document["ssh_keys"]["ed25519_certificate"] == certificate + "\n"
    assert set(document["ssh_keys"]) == {"ed25519_private", "ed25519_public", "ed25519_certificate"}
    for bad, why in (
        (host_certificate(chosen_host_key().public), "does not certify the host key"),
        (certificate + "\nssh-ed25519 AAAAsmuggled", "not one ssh-ed25519-cert-v01"),
        (pair.public, "not one ssh-ed25519-cert-v01"),
    ):
        with pytest.raises(PermanentError, match=why):
            userdata(dataclasses.replace(IDENTITY, host_key=pair, host_certificate=bad))
    with pytest.raises(PermanentError, match="without the host key it certifies"):
        userdata(dataclasses.replace(IDENTITY, host_certificate=certificate))


def test_a_damaged_pair_is_refused_without_quoting_it() -> None:
    pair = chosen_host_key()
    for bad in (
        dataclasses.replace(pair, public=pair.public + "\nssh-ed25519 AAAAsmuggled"),
        dataclasses.replace(pair, public="ssh-rsa " + pair.public.split()[1]),
        dataclasses.replace(pair, private_openssh="not a key"),
        dataclasses.replace(pair, private_openssh=pair.private_openssh.replace("\n", "\r\n")),
    ):
        with pytest.raises(PermanentError) as refused:
            userdata(dataclasses.replace(IDENTITY, host_key=bad))
        assert pair.public.split()[1] not in str(refused.value)
        assert pair.private_openssh.splitlines()[1] not in str(refused.value)


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_the_chosen_key_is_in_guestinfo_until_forgotten(
    mode: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """The clone (vCenter) or created VM (ESXi) carries exactly the pair; forgetting
    blanks guestinfo.userdata and its encoding in one waited task; again, no task; a VM
    that is gone is no error. Nothing logged at DEBUG holds the key, plain or encoded."""
    lab: Simulated = request.getfixturevalue(mode)
    backend = lab.sim.backend()
    caplog.set_level(logging.DEBUG)
    pair = chosen_host_key()
    try:
        ref = await cloned(
            backend, "web01", "jvs0101", dataclasses.replace(IDENTITY, host_key=pair)
        )
        await backend.apply_identity(ref, dataclasses.replace(IDENTITY, host_key=pair))
        extra = lab.sim.extra(lab.sim.vm(ref.vm_id))
        encoded = extra[USERDATA]
        document = decode(encoded)
        assert document["ssh_keys"] == {
            "ed25519_private": pair.private_openssh,
            "ed25519_public": pair.public,
        }
        assert document["ssh_deletekeys"] is True
        assert await backend.holds_host_key(ref) is True

        history = Counter(lab.sim.task_history())
        await backend.forget_host_key(ref)
        assert (Counter(lab.sim.task_history()) - history)["VirtualMachine.reconfigVm"] == 1
        extra = lab.sim.extra(lab.sim.vm(ref.vm_id))
        # vcsim keeps a key set to "" (vSphere removes it): either way, no user-data.
        assert extra.get(USERDATA, "") == extra.get(f"{USERDATA}.encoding", "") == ""
        assert "PRIVATE KEY" not in str(extra)
        assert await backend.holds_host_key(ref) is False
        # The rest of the identity stays: the metadata names the VM and its network.
        assert decode(extra["guestinfo.metadata"])["instance-id"] == ref.vm_id

        history = Counter(lab.sim.task_history())
        await backend.forget_host_key(ref)  # again: nothing left to remove, no task
        assert (Counter(lab.sim.task_history()) - history)["VirtualMachine.reconfigVm"] == 0

        await backend.destroy(ref)
        await backend.forget_host_key(ref)  # gone: not an error
        assert await backend.holds_host_key(ref) is False
    finally:
        await backend.close()
    secrets = [encoded, *pair.private_openssh.splitlines()[1:-1]]
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        assert not any(secret in text for secret in secrets), record.name


@pytest.mark.parametrize("mode", ["vcenter", "esxi"])
async def test_a_vm_without_our_tag_keeps_its_guestinfo(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """Someone edited the VM's notes: deploybot no longer touches it, not even to
    remove the key (NotOurVM); reading whether it holds one is no change and answers."""
    lab: Simulated = request.getfixturevalue(mode)
    backend = lab.sim.backend()
    try:
        identity = dataclasses.replace(IDENTITY, host_key=chosen_host_key())
        ref = await cloned(backend, "web01", "jvs0102", identity)
        lab.sim.set_annotation(ref.vm_id, "someone else's VM now")
        before = lab.sim.extra(lab.sim.vm(ref.vm_id))[USERDATA]
        history = Counter(lab.sim.task_history())
        with pytest.raises(NotOurVM):
            await backend.forget_host_key(ref)
        assert (Counter(lab.sim.task_history()) - history)["VirtualMachine.reconfigVm"] == 0
        assert lab.sim.extra(lab.sim.vm(ref.vm_id))[USERDATA] == before
        assert await backend.holds_host_key(ref) is True
    finally:
        await backend.close()


async def test_a_vm_deployed_without_a_chosen_key_holds_none(vcenter: Simulated) -> None:
    backend: VSphereBackend = vcenter.sim.backend()
    try:
        ref = await cloned(backend, "web01", "jvs0103", IDENTITY)
        assert await backend.holds_host_key(ref) is False
        history = Counter(vcenter.sim.task_history())
        await backend.forget_host_key(ref)
        assert (Counter(vcenter.sim.task_history()) - history)["VirtualMachine.reconfigVm"] == 0
        assert "users" in decode(vcenter.sim.extra(vcenter.sim.vm(ref.vm_id))[USERDATA])
    finally:
        await backend.close()
