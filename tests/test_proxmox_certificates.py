"""ProxmoxBackend installs a host certificate through the guest agent
(InstallsHostCertificates), against the fake Proxmox: file-write of the certificate, exec
of the `sh -c` that adds `HostCertificate` and reloads sshd (run for real by the fake's
guest, confined to its own /etc/ssh and /run), exec-status until it exited; the requests
follow the schema; a refusal names the privilege of the release (PVE 8 and 9), and so does
`missing_privileges(certificates=True)`; a failing command's exit code and output are
reported."""

from __future__ import annotations

from pathlib import Path

import asyncssh
import pytest

from backends.base import PermanentError, RetryableError, VMRef
from backends.proxmox import ProxmoxBackend
from backends.proxmox.certificates import DROP_IN
from bot.models import JobState
from tests.support import mountns
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import make_backend, pve_settings, start_fake
from tests.support.hostkeys import host_certificate
from tests.support.proxmox import (
    ADDRESS,
    IDENTITY,
    backend,
    cloned,
    deploy,
    free_port,
    pve,
    pve_schema,
    pve_tls,
)

__all__ = ["backend", "pve", "pve_schema", "pve_tls"]  # fixtures, used by name

AGENT = "/nodes/{node}/qemu/{vmid}/agent/"
CERT = "/etc/ssh/ssh_host_ed25519_key-cert.pub"
LINE = f"HostCertificate {CERT}"


@pytest.fixture(autouse=True)
def confined_commands() -> None:
    """The fake's guest runs commands in a mount namespace of their own."""
    mountns.require()


async def running(backend: ProxmoxBackend) -> VMRef:
    ref = await cloned(backend, "ubuntu-24.04")
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    await backend.wait_for_address(ref, IDENTITY.address.ip)  # the agent is up
    return ref


def certificate_of(fake: FakePVE, ref: VMRef) -> str:
    files = fake.cluster.vms[int(ref.vm_id)].files
    return host_certificate(files["/etc/ssh/ssh_host_ed25519_key.pub"].decode())


def guest_file(fake: FakePVE, ref: VMRef, path: str) -> str:
    return fake.cluster.vms[int(ref.vm_id)].files[path].decode()


async def test_the_certificate_lands_and_sshd_presents_it_after_a_reload(
    backend: ProxmoxBackend, pve: FakePVE, pve_schema: ApiSchema
) -> None:
    assert backend.certificates_through == "the QEMU guest agent"
    ref = await running(backend)
    certificate = certificate_of(pve, ref)
    note = await backend.install_host_certificate(ref, certificate)
    assert guest_file(pve, ref, CERT) == certificate + "\n"
    # Debian's sshd_config includes sshd_config.d: the line goes there, once.
    assert guest_file(pve, ref, DROP_IN) == LINE + "\n"
    assert LINE not in guest_file(pve, ref, "/etc/ssh/sshd_config")
    assert (
        guest_file(pve, ref, "/run/systemctl.log")
        == "systemctl try-reload-or-restart ssh.service\n"
    )
    assert note is not None and "reloaded ssh.service" in note
    # Again (a retried step): still one line, sshd reloaded again.
    await backend.install_host_certificate(ref, certificate)
    assert guest_file(pve, ref, DROP_IN) == LINE + "\n"
    assert guest_file(pve, ref, "/run/systemctl.log").count("\n") == 2
    mine = {AGENT + name for name in ("file-write", "exec", "exec-status")}
    sent = [r for r in pve.requests if r.template in mine]
    names = [r.template.removeprefix(AGENT) for r in sent if r.template]
    # Twice: file-write, exec, then exec-status until it exited.
    first = names[: names.index("file-write", 1)]
    assert first[:2] == ["file-write", "exec"] and set(first[2:]) == {"exec-status"}
    assert names.count("file-write") == names.count("exec") == 2
    assert names[-1] == "exec-status"
    for r in sent:
        method_params = {**r.params, **r.path_params}
        assert pve_schema.check(r.template or "", r.method, method_params) == {}, r
        assert r.status == 200, r
    agent = pve.cluster.machines.agents[int(ref.vm_id)]  # type: ignore[attr-defined]
    assert agent.executed[0][:2] == ["/bin/sh", "-c"] and agent.executed[0][-1] == CERT


async def test_without_the_include_the_line_goes_into_sshd_config(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    ref = await running(backend)
    files = pve.cluster.vms[int(ref.vm_id)].files
    files["/etc/ssh/sshd_config"] = b"PermitRootLogin no\nUsePAM yes\n"
    await backend.install_host_certificate(ref, certificate_of(pve, ref))
    assert (
        guest_file(pve, ref, "/etc/ssh/sshd_config") == f"PermitRootLogin no\nUsePAM yes\n{LINE}\n"
    )
    assert DROP_IN not in files


async def test_a_failing_command_reports_its_exit_code_and_output(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """A guest without sshd_config: the script says so and exits 2; nothing is added."""
    ref = await running(backend)
    del pve.cluster.vms[int(ref.vm_id)].files["/etc/ssh/sshd_config"]
    with pytest.raises(PermanentError) as failed:
        await backend.install_host_certificate(ref, certificate_of(pve, ref))
    message = failed.value.message
    assert "installing its host certificate failed in the guest (exit code 2)" in message
    assert "/etc/ssh/sshd_config is missing: is openssh-server installed?" in message
    assert "/etc/ssh/sshd_config" not in pve.cluster.vms[int(ref.vm_id)].files
    assert "try again" not in message


async def test_an_agent_not_running_yet_is_retryable(backend: ProxmoxBackend, pve: FakePVE) -> None:
    ref = await cloned(backend, "bare-ubuntu")  # agent enabled, never answers
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    files = pve.cluster.vms[int(ref.vm_id)].files
    with pytest.raises(RetryableError, match="guest agent is not running"):
        await backend.install_host_certificate(ref, host_certificate(IDENTITY.ssh_keys[0]))
    assert CERT not in files


@pytest.mark.parametrize(
    ("release", "revoke", "named"),
    [
        ("8.2", ["VM.Monitor"], "VM.Monitor"),
        ("9.0", ["VM.GuestAgent.Unrestricted"], "VM.GuestAgent.Unrestricted"),
        (
            "9.0",
            ["VM.GuestAgent.FileWrite", "VM.GuestAgent.Unrestricted"],
            "VM.GuestAgent.FileWrite (or VM.GuestAgent.Unrestricted)",
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
            certificate = certificate_of(fake, ref)
            assert await proxmox.missing_privileges("ubuntu-24.04", certificates=True) == []
            for privilege in revoke:
                fake.acl.revoke(privilege)
            with pytest.raises(PermanentError) as refused:
                await proxmox.install_host_certificate(ref, certificate)
            plain = await proxmox.missing_privileges("ubuntu-24.04")
            missing = await proxmox.missing_privileges("ubuntu-24.04", certificates=True)
        finally:
            await proxmox.close()
    message = refused.value.message
    assert f"grant {named} on /vms (PVE {release})" in message
    assert "root@pam!deploybot may not" in message and "host certificate" in message
    assert "try again" not in message
    steps = {(m.privilege, m.step) for m in missing if m.where == "/vms"}
    wanted = {
        "8.2": {
            ("VM.Monitor", "write the SSH host certificate through the guest agent (file-write)"),
            ("VM.Monitor", "reload sshd with the host certificate through the guest agent (exec)"),
        },
        "9.0": {
            (
                "VM.GuestAgent.Unrestricted",
                "reload sshd with the host certificate through the guest agent (exec)",
            )
        },
    }[release]
    assert wanted <= steps
    # Without certificates, only what the rest of the deploy needs is named.
    assert not {step for _p, step in steps if "certificate" in step} & {m.step for m in plain}
    write = (
        "VM.GuestAgent.FileWrite",
        "write the SSH host certificate through the guest agent (file-write)",
    )
    assert (write in steps) == ("VM.GuestAgent.FileWrite" in revoke)


async def verdict(address: str, port: int, ca: asyncssh.SSHKey) -> str:
    """What an SSH client trusting only `ca` (one @cert-authority line) makes of the
    guest's sshd: past the host key it is refused for want of a user key."""
    trusted = f"@cert-authority {address} {ca.export_public_key().decode()}"
    try:
        async with asyncssh.connect(
            address,
            port,
            known_hosts=asyncssh.import_known_hosts(trusted),
            username="ubuntu",
            client_keys=None,
            password=None,
        ):
            return "logged in"
    except (asyncssh.HostKeyNotVerifiable, asyncssh.KeyExchangeFailed):
        # Without a certificate the client finds no host key it could accept at all.
        return "host key refused"
    except asyncssh.PermissionDenied:
        return "host trusted"


async def test_after_the_reload_the_guests_sshd_presents_the_certificate(
    pve_schema: ApiSchema, pve_tls: Tls
) -> None:
    """The fake guest's sshd restarts on the reload and presents what HostCertificate
    names: a client with only the CA's line trusts it, one with another CA does not."""
    ca, stranger = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    address = str(IDENTITY.address.ip)
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        proxmox = make_backend(fake)
        try:
            ref = await running(proxmox)
            vm = fake.cluster.vms[int(ref.vm_id)]
            assert vm.boot is not None and fake.cluster.guest.ssh_port is not None
            await vm.boot  # sshd up
            port = fake.cluster.guest.ssh_port
            assert await verdict(address, port, ca) == "host key refused"  # no certificate yet
            public = vm.files["/etc/ssh/ssh_host_ed25519_key.pub"].decode()
            certificate = host_certificate(public, ("web01", address), ca)
            await proxmox.install_host_certificate(ref, certificate)
            assert await verdict(address, port, ca) == "host trusted"
            assert await verdict(address, port, stranger) == "host key refused"
            # The plain key is still presented: the SSH check's confirmation is unchanged.
            presented = await proxmox.probe_ssh(ref, IDENTITY.address.ip, port)
            assert presented is not None and presented.split()[:2] == public.split()[:2]
        finally:
            await proxmox.close()


async def test_a_deploy_with_a_host_ca_certifies_the_key_the_agent_read(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole pipeline with a host CA (bot/sshca): the pre-flight asks for the
    certificate's privileges too, `certify` signs the key read through the agent and
    installs it through file-write and exec; the guest's sshd then presents it to a
    client that trusts only the CA."""
    ca = asyncssh.generate_private_key("ssh-ed25519")
    monkeypatch.setenv("TEST_PVE_HOST_CA", ca.export_private_key("openssh").decode())
    async with start_fake(pve_schema, pve_tls, release="9.0", ssh_port=free_port()) as fake:
        settings = pve_settings(tmp_path, fake, ssh={"host_ca_env": "TEST_PVE_HOST_CA"})
        job, events = await deploy(fake, settings, f"web01 {ADDRESS}")
        assert job.state is JobState.SUCCEEDED, job.error
        vm = fake.cluster.vms[int(job.vm_id or 0)]
        assert fake.cluster.guest.ssh_port is not None
        trusted = await verdict(ADDRESS, fake.cluster.guest.ssh_port, ca)
        permissions = [r.params.get("path") for r in fake.sent("GET", "/access/permissions")]
    assert job.host_certificate is not None
    assert vm.files[CERT].decode().strip() == " ".join(job.host_certificate.split()[:2])
    assert LINE in vm.files[DROP_IN].decode()
    assert trusted == "host trusted"
    assert "certify" in {e.step for e in events if e.phase == "finished"}
    assert "/vms" in permissions  # the pre-flight asked before the clone


async def test_a_match_block_keeps_the_line_above_it(backend: ProxmoxBackend, pve: FakePVE) -> None:
    """sshd_config ends with a Match block (and includes its drop-ins only inside it): the
    line goes above the first Match, where sshd accepts it, not into the block."""
    ref = await running(backend)
    files = pve.cluster.vms[int(ref.vm_id)].files
    head = "PermitRootLogin no\nUsePAM yes\n"
    block = (
        "Match User backup\n  ForceCommand internal-sftp\nInclude /etc/ssh/sshd_config.d/*.conf\n"
    )
    files["/etc/ssh/sshd_config"] = (head + block).encode()
    note = await backend.install_host_certificate(ref, certificate_of(pve, ref))
    assert guest_file(pve, ref, "/etc/ssh/sshd_config") == f"{head}{LINE}\n{block}"
    assert DROP_IN not in files
    assert note is not None and "reloaded ssh.service" in note
    assert guest_file(pve, ref, "/run/systemctl.log") == (
        "systemctl try-reload-or-restart ssh.service\n"
    )


async def test_a_configuration_sshd_rejects_is_put_back_and_sshd_not_reloaded(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """`sshd -t` fails (here: a HostCertificate line someone put inside a Match block): the
    file is as before, sshd is not reloaded (a reload would stop it), and the deploy fails
    with sshd's words and what to fix."""
    ref = await running(backend)
    files = pve.cluster.vms[int(ref.vm_id)].files
    broken = b"UsePAM yes\nMatch Address 10.0.0.0/8\n  HostCertificate /etc/ssh/old-cert.pub\n"
    files["/etc/ssh/sshd_config"] = broken
    with pytest.raises(PermanentError) as failed:
        await backend.install_host_certificate(ref, certificate_of(pve, ref))
    message = failed.value.message
    assert "failed in the guest (exit code 4)" in message
    assert "sshd -t rejects the configuration (sshd not reloaded" in message
    # line 4: the new line went in above the Match block before sshd -t looked.
    assert "line 4: Directive 'HostCertificate' is not allowed within a Match block" in message
    assert "fix its template" in message and "without a host CA" in message
    assert files["/etc/ssh/sshd_config"] == broken
    assert not [p for p in files if "deploybot" in p]
    assert "/run/systemctl.log" not in files
    assert "try again" not in message


async def test_a_failed_unit_reload_fails_without_a_sighup(
    backend: ProxmoxBackend, pve: FakePVE
) -> None:
    """systemctl is there but reloads no sshd unit: that is the failure, reported; the
    pid in /run/sshd.pid gets no SIGHUP (which would be taken as success)."""
    ref = await running(backend)
    pve.cluster.machines.guest_agent(int(ref.vm_id)).units = ()  # type: ignore[attr-defined]
    files = pve.cluster.vms[int(ref.vm_id)].files
    files["/run/sshd.pid"] = b"1\n"  # in the guest's PID namespace: its own first process
    with pytest.raises(PermanentError) as failed:
        await backend.install_host_certificate(ref, certificate_of(pve, ref))
    message = failed.value.message
    assert "failed in the guest (exit code 3)" in message
    assert (
        "systemctl could not reload sshd: ssh.service: Failed to try-reload-or-restart" in message
    )
    assert "sent SIGHUP" not in message
