"""The deploy's pre-flight (bot/kinds/deploy/preflight.py, in check_free) against the fake
Proxmox: a token lacking what a later step needs (the guest agent's file-read on PVE 9,
VM.Monitor on PVE 8) fails before the clone, naming each privilege, its path and purpose,
and no VM is made; a pass is kept a while (an injected clock), a refusal is not; with a
host CA the certificate's privileges are asked too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncssh
import pytest

from bot.app.runtime import running_deployer
from bot.kinds.deploy.preflight import Preflight
from bot.kinds.deploy.runs import StepFailed
from bot.models import JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import make_backend, pve_settings, start_fake
from tests.support.proxmox import ADDRESS, ORIGINAL, deploy, free_port

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls
PERMISSIONS = "/access/permissions"


@pytest.mark.parametrize(
    ("release", "revoke", "named"),
    [
        (
            "9.0",
            ["VM.GuestAgent.FileRead", "VM.GuestAgent.Unrestricted"],
            [
                "VM.GuestAgent.FileRead on /vms "
                "(to read the SSH host keys through the guest agent (file-read))"
            ],
        ),
        (
            "8.2",
            ["VM.Monitor"],
            [
                "VM.Monitor on /vms (to read the address from the guest agent, "
                "read the SSH host keys through the guest agent (file-read))"
            ],
        ),
    ],
)
async def test_a_token_lacking_a_later_steps_privilege_fails_before_the_clone(
    pve_schema: ApiSchema,
    pve_tls: Tls,
    tmp_path: Path,
    release: str,
    revoke: list[str],
    named: list[str],
) -> None:
    async with start_fake(pve_schema, pve_tls, release=release, ssh_port=free_port()) as fake:
        for privilege in revoke:
            fake.acl.revoke(privilege)
        job, events = await deploy(fake, pve_settings(tmp_path, fake), f"web01 {ADDRESS}")
        assert set(fake.cluster.vms) == ORIGINAL  # nothing was cloned
        assert not [r for r in fake.requests if r.method != "GET"]  # nothing was asked to change
    assert job.state is JobState.FAILED
    assert job.vm_id is None
    assert [e.step for e in events if e.phase == "failed"] == ["check_free"]
    error = job.error or ""
    assert error.startswith("root@pam!deploybot lacks privileges this deploy needs on pve: ")
    for text in named:
        assert text in error
    assert "`deploybot check` lists them" in error and "try again" not in error


async def asked(fake: FakePVE, preflight: Preflight, certificates: bool = False) -> int:
    """How many permission reads one pre-flight of ubuntu-24.04 sent."""
    before = len(fake.sent("GET", PERMISSIONS))
    backend = make_backend(fake)
    try:
        await preflight.check("pve", backend, "ubuntu-24.04", certificates=certificates)
    finally:
        await backend.close()
    return len(fake.sent("GET", PERMISSIONS)) - before


async def test_a_pass_is_kept_a_while_and_a_refusal_is_not(
    pve_schema: ApiSchema, pve_tls: Tls
) -> None:
    now = [1000.0]
    preflight = Preflight(keep_s=300.0, clock=lambda: now[0])
    async with start_fake(pve_schema, pve_tls, release="9.0") as fake:
        assert await asked(fake, preflight) > 0
        now[0] += 299.0
        assert await asked(fake, preflight) == 0  # kept: no request at all
        now[0] += 2.0
        fake.acl.revoke("VM.GuestAgent.Audit")
        fake.acl.revoke("VM.GuestAgent.Unrestricted")
        with pytest.raises(StepFailed, match=r"VM\.GuestAgent\.Audit on /vms"):
            await asked(fake, preflight)  # asked again once the while is over
        fake.acl.grant("/", fake.acl.effective("/") | {"VM.GuestAgent.Audit"})
        assert await asked(fake, preflight) > 0  # the refusal was not kept: the grant counts


async def test_with_a_host_ca_the_certificates_privileges_are_asked(
    pve_schema: ApiSchema, pve_tls: Tls
) -> None:
    async with start_fake(pve_schema, pve_tls, release="9.0") as fake:
        fake.acl.revoke("VM.GuestAgent.Unrestricted")  # FileRead, FileWrite are there
        preflight = Preflight()
        assert await asked(fake, preflight) > 0  # passes: no certificates
        with pytest.raises(StepFailed) as refused:  # the pass without them is not kept for them
            await asked(fake, preflight, certificates=True)
    assert refused.value.reason.endswith("(`deploybot check` lists them)")
    assert (
        "VM.GuestAgent.Unrestricted on /vms (to reload sshd with the host certificate through "
        "the guest agent (exec))" in refused.value.reason
    )
    assert "FileWrite" not in refused.value.reason


async def test_deploys_arriving_together_share_one_question(
    pve_schema: ApiSchema, pve_tls: Tls
) -> None:
    async with start_fake(pve_schema, pve_tls, release="9.0") as fake:
        alone = await asked(fake, Preflight())
        backend = make_backend(fake)
        preflight = Preflight()
        try:
            before = len(fake.sent("GET", PERMISSIONS))
            notes = await asyncio.gather(
                *(preflight.check("pve", backend, "ubuntu-24.04") for _ in range(5))
            )
            together = len(fake.sent("GET", PERMISSIONS)) - before
        finally:
            await backend.close()
    assert notes == [None] * 5
    assert together == alone > 0


async def test_a_preflight_passed_in_asks_for_the_certificates_of_a_configured_ca(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Preflight made outside the pipeline (a benchmark's, shared by its runs) still asks
    for the certificates' privileges when the deployer has a host CA: the pipeline says so
    per check, and a pass without certificates is not taken for one with them."""
    ca = asyncssh.generate_private_key("ssh-ed25519")
    monkeypatch.setenv("TEST_PVE_HOST_CA", ca.export_private_key("openssh").decode())
    preflight = Preflight()
    async with start_fake(pve_schema, pve_tls, release="9.0", ssh_port=free_port()) as fake:
        assert await asked(fake, preflight) > 0  # a pass without certificates, kept
        fake.acl.revoke("VM.GuestAgent.Unrestricted")
        settings = pve_settings(tmp_path, fake, ssh={"host_ca_env": "TEST_PVE_HOST_CA"})
        backend = make_backend(fake)
        async with running_deployer(
            settings, backends={"pve": backend}, preflight=preflight, grace_s=5
        ) as deployer:
            args = parse(f"web01 {ADDRESS}")
            assert isinstance(args, DeployArgs)
            job = (await deployer.request_deploy(args, "alice")).id
            await deployer.drain()
            info = await deployer.status(job)
        assert set(fake.cluster.vms) == ORIGINAL  # refused before the clone
    assert info.job.state is JobState.FAILED
    assert [e.step for e in info.events if e.phase == "failed"] == ["check_free"]
    assert "VM.GuestAgent.Unrestricted on /vms (to reload sshd with the host certificate" in (
        info.job.error or ""
    )
