"""Issue 28 item 3 on the simulator, end to end: with a host CA in the environment,
deploybot certifies the host key it confirmed (read through the guest agent: the
`certify` step installs the certificate through it; chosen by deploybot: the certificate
goes in with the key at the identity step), for the VM's name, FQDN and address, until
the lease's end. A key only seen over SSH is never certified; without a CA nothing is.
The certificate verifies against the CA, and a real SSH client that trusts only the
@cert-authority line accepts a server presenting it (asyncssh on loopback)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sqlite3
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from asyncssh.public_key import SSHOpenSSHCertificate

from backends.abilities import ChecksPrivileges, InstallsHostCertificates
from backends.base import MissingPrivilege, PermanentError, Segment, VMRef
from backends.sim import ChoosingSim, SimBackend, Simulator, sim_backend
from backends.sim.vm import FaultKind
from bot.app.runtime import running_deployer, secret_problems
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import HostKeySource, Job, JobState, utcnow
from bot.models.errors import ConfigError
from bot.operations.check import check_backend, check_host_ca
from bot.sshca.authority import load_host_ca
from bot.sshca.certificates import certify, read_certificate
from bot.sshca.revocation import RevokedKey, revoked_keys
from handlers.commands import answer
from handlers.messages.core import finished, slack_outcome_dm
from handlers.messages.hostkeys import certificate_lines
from tests.support.cli import CONFIG, deploybot, no_traceback
from tests.support.crash import KillPoint, job_state, restart, run_round, write_config
from tests.support.deployer import SIM_SCALE, Recorder, deploy, make_settings
from tests.support.realguest import openssh
from tests.support.realguest.support import unavailable

CA_ENV = "TEST_DEPLOYBOT_HOST_CA"  # not DEPLOYBOT_*: the CLI helpers drop those
CERT_TYPE_HOST = 2  # OpenSSH's SSH2_CERT_TYPE_HOST


@pytest.fixture
def ca_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncssh.SSHKey]:
    """A host CA's key, in the environment variable the settings name."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    monkeypatch.setenv(CA_ENV, key.export_private_key("openssh").decode())
    yield key


def ca_settings(tmp_path: Path, ssh: dict[str, Any] | None = None, **overrides: Any) -> Settings:
    return make_settings(tmp_path, ssh={"host_ca_env": CA_ENV, **(ssh or {})}, **overrides)


async def run_deploy(
    tmp_path: Path, sim: Simulator, settings: Settings | None = None
) -> tuple[Job, list[str], list[tuple[str, str, str]], Deployer]:
    """One deploy; the job, its known-hosts answer, its events (step, phase, detail)."""
    settings = settings or ca_settings(tmp_path)
    async with running_deployer(settings, Recorder(), backends={"sim": sim}) as d:
        job = await deploy(d)
        said = await answer(d, "alice", "known-hosts web01")
        events = [(e.step, e.phase, e.detail or "") for e in await d.store.jobs.events(job.id)]
    return job, said, events, d


def skipped(events: list[tuple[str, str, str]], step: str) -> str | None:
    found = [detail for s, phase, detail in events if s == step and phase == "skipped"]
    return found[0] if found else None


def check_certificate(job: Job, ca: asyncssh.SSHKey) -> SSHOpenSSHCertificate:
    """The job's certificate: signed by `ca` (asyncssh checks the signature on import),
    a host certificate of the job's confirmed key, valid now for each of its names."""
    assert job.host_certificate is not None
    assert job.host_certificate.startswith("ssh-ed25519-cert-v01@openssh.com AAAA")
    cert = asyncssh.import_certificate(job.host_certificate)
    assert isinstance(cert, SSHOpenSSHCertificate)
    assert cert.signing_key.get_fingerprint() == ca.get_fingerprint()
    info = read_certificate(job.host_certificate)
    assert info is not None and info.key == job.host_key
    assert info.principals == ("web01", "web01.lab.example", "10.0.0.50")
    for name in info.principals:
        cert.validate(CERT_TYPE_HOST, name)
    with pytest.raises(ValueError, match="principal mismatch"):
        cert.validate(CERT_TYPE_HOST, "web02.lab.example")
    assert info.key_id == f"deploybot:{job.id}:web01"
    return cert


async def test_a_key_read_through_the_agent_is_certified_until_the_lease_ends(
    tmp_path: Path, ca_key: asyncssh.SSHKey, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    assert isinstance(sim, InstallsHostCertificates)
    job, said, events, _d = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.host_key_source is HostKeySource.AGENT
    check_certificate(job, ca_key)
    (vm,) = sim.vms.values()
    assert vm.host_certificate == job.host_certificate  # installed through the agent
    assert ("install_host_certificate", vm.vm_id) in sim.task_log
    # Until the lease's end (14 days by default), from five minutes back.
    info = read_certificate(job.host_certificate or "")
    assert info is not None and job.lease_end is not None and job.finished_at is not None
    assert abs(info.valid_before - job.lease_end) < timedelta(seconds=5)
    assert timedelta(minutes=5) <= job.finished_at - info.valid_after < timedelta(minutes=6)
    assert ("certify", "finished") in [(s, p) for s, p, _ in events]
    assert skipped(events, "certify") is None
    # Said wherever the key is: the thread's end, the DM, known-hosts.
    until = f"until {info.valid_before.day} {info.valid_before:%b %Y}"
    for text in ("\n".join(finished(job, None)), slack_outcome_dm(job), "\n".join(said)):
        assert "certified by deploybot's host CA" in text and until in text
        assert "web01, web01.lab.example, 10.0.0.50" in text and "deploybot ssh-ca" in text
    # No private key anywhere: not the CA's, in no row and no log line.
    db = (tmp_path / "jobs.db").read_bytes()
    assert b"PRIVATE KEY" not in db and "PRIVATE KEY" not in caplog.text


async def test_a_chosen_key_gets_its_certificate_with_the_identity(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = ChoosingSim("sim", time_scale=SIM_SCALE)
    job, _said, events, _d = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.host_key_source is HostKeySource.CHOSEN
    check_certificate(job, ca_key)
    (vm,) = sim.vms.values()
    # The hypervisor got it in the identity (cloud-config), beside the key it installed.
    assert vm.identity is not None and vm.identity.host_certificate == job.host_certificate
    assert vm.host_certificate == job.host_certificate and vm.host_key == job.host_key
    reason = skipped(events, "certify")
    assert reason is not None and "identity step" in reason
    assert vm.user_data_key is None  # the private key is still forgotten


async def test_a_key_only_seen_over_ssh_is_never_certified(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = sim_backend("sim", host_keys="none", time_scale=SIM_SCALE)
    job, said, events, _d = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.host_key_source is HostKeySource.SSH and job.host_key
    assert job.host_certificate is None
    reason = skipped(events, "certify")
    assert reason is not None and "only seen over SSH" in reason
    assert "certified" not in "\n".join([*finished(job, None), *said])


class ReadingSim(Simulator):
    """Reads its guests' keys (as Proxmox's agent) but cannot install a certificate."""

    host_keys_through = "the simulator's guest agent"

    async def host_keys(self, ref: VMRef) -> list[str]:
        return await self.guests.host_keys(ref)


async def test_a_backend_that_cannot_install_one_skips_the_step(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = ReadingSim("sim", time_scale=SIM_SCALE)
    job, _said, events, _d = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.host_key_source is HostKeySource.AGENT and job.host_certificate is None
    assert skipped(events, "certify") == "sim cannot install a certificate into a running guest"


async def test_without_a_ca_nothing_is_certified(tmp_path: Path) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    job, said, events, d = await run_deploy(tmp_path, sim, make_settings(tmp_path))
    assert job.state is JobState.SUCCEEDED, job.error
    assert job.host_certificate is None
    assert [vm.host_certificate for vm in sim.vms.values()] == [None]
    assert skipped(events, "certify") == "no host CA configured ([ssh] host_ca_env)"
    assert "certified" not in "\n".join([*finished(job, None), *said])
    assert d.host_ca is None


async def test_without_a_lease_the_certificate_holds_certificate_days(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    settings = ca_settings(tmp_path, ssh={"certificate_days": 30}, leases={"default": "never"})
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    job, _said, _events, _d = await run_deploy(tmp_path, sim, settings)
    assert job.state is JobState.SUCCEEDED and job.lease_s is None
    info = read_certificate(job.host_certificate or "")
    assert info is not None and job.finished_at is not None
    assert abs(info.valid_before - (job.finished_at + timedelta(days=30))) < timedelta(seconds=5)


@pytest.mark.parametrize("kind", ["error", "hang", "crash"])
async def test_an_install_that_fails_fails_the_deploy_and_rolls_back(
    tmp_path: Path, ca_key: asyncssh.SSHKey, kind: FaultKind
) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    sim.inject("install_host_certificate", kind)
    job, _said, _events, _d = await run_deploy(tmp_path, sim)
    assert job.state is JobState.FAILED and job.failed_step == "certify"
    assert sim.vms == {} and job.wreckage is None
    assert "certify the host key" in "\n".join(finished(job, None))
    assert job.host_certificate is None


async def test_a_flaky_install_is_retried_and_a_cancel_rolls_back(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    sim.inject("install_host_certificate", "flaky", times=2)
    job, _said, _events, _d = await run_deploy(tmp_path, sim)
    assert job.state is JobState.SUCCEEDED and job.host_certificate is not None

    sim = SimBackend("sim", time_scale=SIM_SCALE)
    recorder = Recorder()
    async with running_deployer(
        ca_settings(tmp_path / "cancel"), recorder, backends={"sim": sim}
    ) as d:

        async def cancel_at(job: Job, started: str) -> None:
            if started == "certify":
                await d.cancel(job.id, "alice")

        recorder.on_step = cancel_at
        job = await deploy(d)
    assert job.state is JobState.CANCELLED and sim.vms == {}


async def test_a_certificate_installed_again_replaces_the_old_one(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    """A resumed job certifies again (after reading the key again at the SSH check): the
    new certificate replaces the old one in the guest; one of another key is refused."""
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(ca_settings(tmp_path), Recorder(), backends={"sim": sim}) as d:
        job = await deploy(d)
        (vm,) = sim.vms.values()
        first = vm.host_certificate
        ref = VMRef(vm.vm_id, job.id, vm.placement, job.installation)
        assert d.host_ca is not None and job.host_key is not None
        again = certify(d.host_ca, job, job.host_key, "10.0.0.50", utcnow())
        assert await sim.install_host_certificate(ref, again)
        assert vm.host_certificate == again != first
        stranger = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
        other = certify(d.host_ca, job, stranger, "10.0.0.50", utcnow())
        with pytest.raises(PermanentError, match="not of VM"):
            await sim.install_host_certificate(ref, other)
    assert vm.host_certificate == again


# --- the CA's set-up -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, f"the environment variable {CA_ENV} is unset or empty"),
        ("", f"the environment variable {CA_ENV} is unset or empty"),
        ("not a key at all", f"{CA_ENV} does not hold an unencrypted OpenSSH private key"),
    ],
)
async def test_a_ca_that_does_not_load_stops_the_start_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None, said: str
) -> None:
    if value is None:
        monkeypatch.delenv(CA_ENV, raising=False)
    else:
        monkeypatch.setenv(CA_ENV, value)
    settings = ca_settings(tmp_path)
    with pytest.raises(ConfigError) as refused:
        async with running_deployer(settings, Recorder(), backends={"sim": SimBackend("sim")}):
            pass
    assert said in refused.value.message and "ssh-keygen" in refused.value.message
    if value:
        assert value not in refused.value.message
    assert any(said in p for p in await secret_problems(settings, dict(os.environ)))
    (result,) = check_host_ca(settings)
    assert not result.ok and said in result.detail
    assert not (tmp_path / "jobs.db").exists()  # refused before anything opened


def test_a_public_key_in_the_variable_is_refused_without_echoing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    monkeypatch.setenv(CA_ENV, public)
    with pytest.raises(ConfigError) as refused:
        load_host_ca(ca_settings(tmp_path), {CA_ENV: public})
    assert public.split()[1] not in refused.value.message


def test_the_ca_reports_its_fingerprint_and_never_shows_its_key(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    settings = ca_settings(tmp_path)
    ca = load_host_ca(settings, {CA_ENV: ca_key.export_private_key("openssh").decode()})
    assert ca is not None
    assert ca.fingerprint == ca_key.get_fingerprint("sha256")
    assert ca.patterns == ("*.lab.example",)  # the bundled subnet's search domain
    public = ca_key.export_public_key().decode().split()
    assert ca.authority_line() == (
        f"@cert-authority *.lab.example {public[0]} {public[1]} deploybot-host-ca"
    )
    private = ca_key.export_private_key("openssh").decode()
    assert private not in repr(ca) and "PRIVATE" not in repr(ca) and "PRIVATE" not in str(vars(ca))
    (result,) = check_host_ca(settings)
    assert result.ok and ca.fingerprint in result.detail and CA_ENV in result.detail
    (none,) = check_host_ca(make_settings(tmp_path))
    assert none.ok and "none configured" in none.detail


def test_ca_hosts_name_the_patterns_and_a_ca_without_any_is_refused(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    env = {CA_ENV: ca_key.export_private_key("openssh").decode()}
    chosen = ca_settings(tmp_path, ssh={"ca_hosts": ["*.corp.example", "10.0.0.*"]})
    ca = load_host_ca(chosen, env)
    assert ca is not None and ca.authority_line().startswith(
        "@cert-authority *.corp.example,10.0.0.* ssh-ed25519 "
    )
    bare = [{"cidr": "10.0.0.0/24", "gateway": "10.0.0.1"}]
    with pytest.raises(ConfigError, match="set ca_hosts"):
        load_host_ca(ca_settings(tmp_path, subnets=bare), env)
    with pytest.raises(ConfigError, match="no spaces or commas"):
        ca_settings(tmp_path, ssh={"ca_hosts": ["a.example,b.example"]})


async def test_names_are_certified_in_lower_case_as_ssh_compares_them(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    """ssh lower-cases the name typed before it matches principals and patterns: a
    domain written "Lab.Example" must still give principals and patterns that match."""
    upper = [{"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "search_domain": "Lab.Example"}]
    settings = ca_settings(tmp_path, subnets=upper)
    job, _said, _events, _d = await run_deploy(
        tmp_path, SimBackend("sim", time_scale=SIM_SCALE), settings
    )
    assert job.state is JobState.SUCCEEDED, job.error
    info = read_certificate(job.host_certificate or "")
    assert info is not None and info.principals == ("web01", "web01.lab.example", "10.0.0.50")
    cert = asyncssh.import_certificate(job.host_certificate or "")
    assert isinstance(cert, SSHOpenSSHCertificate)
    cert.validate(CERT_TYPE_HOST, "web01.lab.example")
    env = {CA_ENV: ca_key.export_private_key("openssh").decode()}
    ca = load_host_ca(settings, env)
    assert ca is not None and ca.patterns == ("*.lab.example",)
    chosen = load_host_ca(ca_settings(tmp_path, ssh={"ca_hosts": ["*.Corp.Example"]}), env)
    assert chosen is not None and chosen.patterns == ("*.corp.example",)


async def test_a_certificate_past_its_end_is_said_to_have_ended(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    job, _said, _events, _d = await run_deploy(tmp_path, SimBackend("sim", time_scale=SIM_SCALE))
    info = read_certificate(job.host_certificate or "")
    assert info is not None
    (valid,) = certificate_lines(job, now=info.valid_before - timedelta(seconds=1))
    assert valid.startswith("It is certified by deploybot's host CA until")
    (ended,) = certificate_lines(job, now=info.valid_before)
    assert "ended" in ended and "certified by" not in ended and "until" not in ended


async def test_ssh_ca_prints_the_line_or_how_to_get_one(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    async with running_deployer(
        ca_settings(tmp_path), Recorder(), backends={"sim": SimBackend("sim")}
    ) as d:
        said = await answer(d, "alice", "ssh-ca")
    assert d.host_ca is not None
    assert said[-1] == f"    {d.host_ca.authority_line()}"
    assert d.host_ca.fingerprint in said[0]
    async with running_deployer(
        make_settings(tmp_path / "bare"), Recorder(), backends={"sim": SimBackend("sim")}
    ) as d:
        (none,) = await answer(d, "alice", "ssh-ca")
    assert "no host CA" in none and "host_ca_env" in none and "ssh-keygen" in none
    assert "try again" not in none


async def test_ssh_ca_names_the_keys_of_vms_that_are_gone_until_their_certificates_end(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    """web01 is destroyed while its certificate holds: `ssh-ca` adds an @revoked line
    for its key (never web02's, which lives); once the certificate ends, none."""
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(ca_settings(tmp_path), Recorder(), backends={"sim": sim}) as d:
        gone = await deploy(d, "web01 10.0.0.50")
        alive = await deploy(d, "web02 10.0.0.51")
        assert gone.state is alive.state is JobState.SUCCEEDED, (gone.error, alive.error)
        await d.request_destroy("web01", "bob")  # an approver
        await d.drain()
        assert (await d.status(gone.id)).job.state is JobState.DESTROYED
        said = await answer(d, "alice", "ssh-ca")
        info = read_certificate(gone.host_certificate or "")
        assert info is not None and alive.host_key is not None
        revoked = [line.strip() for line in said if line.startswith("    @revoked")]
        assert revoked == [f"@revoked * {info.key} deploybot-gone:web01"]
        assert not any(alive.host_key in line for line in said)
        assert await revoked_keys(d.store, info.valid_before - timedelta(seconds=1)) != []
        assert await revoked_keys(d.store, info.valid_before) == []  # it ended: no line


# --- a real SSH client trusts the certificate through the @cert-authority line --------


class _NoAuth(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return False  # no login: the question is only whether the host key is trusted


async def _connect_as(host: str, port: int, known_hosts: bytes) -> None:
    """An SSH client connecting to 127.0.0.1:port while calling the host `host`, with
    `known_hosts` as its only trust."""
    sock = socket.create_connection(("127.0.0.1", port))
    conn = await asyncssh.connect(
        host, sock=sock, known_hosts=asyncssh.import_known_hosts(known_hosts.decode()),
        username="nobody", config=None, agent_path=None, client_keys=None,
    )  # fmt: skip
    conn.close()
    await conn.wait_closed()


async def test_a_client_trusting_only_the_ca_line_accepts_the_vm_and_nothing_else(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    settings = ca_settings(tmp_path)
    ca = load_host_ca(settings, {CA_ENV: ca_key.export_private_key("openssh").decode()})
    assert ca is not None
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    public = " ".join(host_key.export_public_key().decode().split()[:2])
    async with running_deployer(settings, Recorder(), backends={"sim": SimBackend("sim")}) as d:
        job = await deploy(d)
    line = certify(ca, job, public, "10.0.0.50", utcnow())
    server = await asyncssh.create_server(
        _NoAuth, "127.0.0.1", 0,
        server_host_keys=[(host_key, asyncssh.import_certificate(line))],
    )  # fmt: skip
    port = server.sockets[0].getsockname()[1]
    known = (ca.authority_line() + "\n").encode()
    try:
        await _connect_as("web01.lab.example", port, known)  # no prompt, no error
        with pytest.raises(asyncssh.HostKeyNotVerifiable):  # not a name it holds for
            await _connect_as("web02.lab.example", port, known)
        other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
        stranger = f"@cert-authority *.lab.example {other}".encode()
        with pytest.raises(asyncssh.HostKeyNotVerifiable):  # another CA's line
            await _connect_as("web01.lab.example", port, stranger)
    finally:
        server.close()
        await server.wait_closed()
    # A certificate past its validity is refused by that client.
    expired = ca.sign(
        public,
        principals=["web01.lab.example"],
        valid_after=utcnow() - timedelta(days=2),
        valid_before=utcnow() - timedelta(days=1),
        key_id="expired",
    )
    server = await asyncssh.create_server(
        _NoAuth, "127.0.0.1", 0,
        server_host_keys=[(host_key, asyncssh.import_certificate(expired))],
    )  # fmt: skip
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(asyncssh.HostKeyNotVerifiable):
            await _connect_as("web01.lab.example", port, known)
    finally:
        server.close()
        await server.wait_closed()


async def test_the_real_openssh_client_refuses_a_revoked_key_the_ca_certified(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    """OpenSSH itself (/usr/bin/ssh): the certificate is accepted through the CA line
    alone (the host key passes, only the login is refused), and refused once the
    known_hosts file also holds the key's @revoked line as `ssh-ca` prints it."""
    if not openssh.available():
        unavailable(f"no OpenSSH client at {openssh.SSH} (apt-get install openssh-client)")
    ca = load_host_ca(
        ca_settings(tmp_path), {CA_ENV: ca_key.export_private_key("openssh").decode()}
    )
    assert ca is not None
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    public = " ".join(host_key.export_public_key().decode().split()[:2])
    line = ca.sign(
        public, principals=["web01.lab.example"], valid_after=utcnow() - timedelta(minutes=5),
        valid_before=utcnow() + timedelta(days=1), key_id="deploybot:test:web01",
    )  # fmt: skip
    server = await asyncssh.create_server(
        _LetsNobodyIn, "127.0.0.1", 0,
        server_host_keys=[(host_key, asyncssh.import_certificate(line))],
    )  # fmt: skip
    port = server.sockets[0].getsockname()[1]
    identity = tmp_path / "id"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(identity))
    identity.chmod(0o600)
    revoked = RevokedKey("web01", public, utcnow() + timedelta(days=1)).line
    try:
        trusted = await _real_ssh(tmp_path, port, identity, [ca.authority_line()])
        refused = await _real_ssh(tmp_path, port, identity, [ca.authority_line(), revoked])
    finally:
        server.close()
        await server.wait_closed()
    assert "Permission denied" in trusted and "Host key verification failed" not in trusted
    assert "REVOKED HOST KEY" in refused and "Permission denied" not in refused


class _LetsNobodyIn(asyncssh.SSHServer):
    """Asks for a key and takes none: a client that trusted the host key hears
    "Permission denied"."""

    def begin_auth(self, username: str) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return False


async def _real_ssh(tmp_path: Path, port: int, identity: Path, known: list[str]) -> str:
    """What /usr/bin/ssh says connecting to 127.0.0.1:port as web01.lab.example with
    only `known` as its known_hosts (it never gets a shell: the server lets nobody in)."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("\n".join(known) + "\n", encoding="utf-8")
    command = openssh.argv(
        None, user="nobody", host="web01.lab.example", address="127.0.0.1", port=port,
        identity=identity, known_hosts=known_hosts, command="true",
    )  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), openssh.TIMEOUT_S)
    assert process.returncode == 255, out
    return out.decode()


# --- the command line, and a restart in the middle of `certify` --------------------------


def with_ca(config: str) -> str:
    """A configuration with the test's host CA (a subnet without a search domain: the
    @cert-authority line's hosts are named)."""
    return config + f'\n[ssh]\nhost_ca_env = "{CA_ENV}"\nca_hosts = ["*.lab.example"]\n'


def test_the_cli_prints_the_line_alone_on_stdout(tmp_path: Path, ca_key: asyncssh.SSHKey) -> None:
    result = deploybot(tmp_path, "ssh-ca", config=with_ca(CONFIG))
    assert result.returncode == 0, result.stderr
    public = " ".join(ca_key.export_public_key().decode().split()[:2])
    assert result.stdout == f"@cert-authority *.lab.example {public} deploybot-host-ca\n"
    assert ca_key.get_fingerprint() in result.stderr
    no_traceback(result)
    bare = deploybot(tmp_path, "ssh-ca")
    assert bare.returncode == 1 and bare.stdout == ""
    assert "no host CA" in bare.stderr and "host_ca_env" in bare.stderr
    no_traceback(bare)


def test_check_config_names_the_ca_it_loads(tmp_path: Path, ca_key: asyncssh.SSHKey) -> None:
    result = deploybot(tmp_path, "check-config", config=with_ca(CONFIG))
    assert result.returncode == 0, result.stderr
    assert f"host CA: {ca_key.get_fingerprint()} from ${CA_ENV}" in result.stdout
    assert "PRIVATE" not in result.stdout + result.stderr
    assert "host CA: none" in deploybot(tmp_path, "check-config").stdout


def test_the_default_variable_name_is_no_setting_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEPLOYBOT_SSH_HOST_CA starts like the variables that override settings
    (DEPLOYBOT_SSH__...): it must be read as the CA's key, not refused as a setting."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    monkeypatch.setenv("DEPLOYBOT_SSH_HOST_CA", key.export_private_key("openssh").decode())
    settings = make_settings(tmp_path, ssh={"host_ca_env": "DEPLOYBOT_SSH_HOST_CA"})
    ca = load_host_ca(settings, os.environ)
    assert ca is not None and ca.fingerprint == key.get_fingerprint()


def test_the_cli_refuses_a_ca_variable_that_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CA_ENV, raising=False)
    for command in ("ssh-ca", "check-config"):
        result = deploybot(tmp_path, command, config=with_ca(CONFIG))
        assert result.returncode == 2, command
        assert f"{CA_ENV} is unset or empty" in result.stderr
        no_traceback(result)


def test_a_job_killed_in_the_middle_of_certify_is_certified_after_the_restart(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    """SIGKILL while the certificate is being installed (the install never answers in
    that life); restarted with recovery `resume`, the job reads the key again, certifies
    it again and succeeds: the guest presents the certificate the job records."""
    env = write_config(tmp_path, None, resume=True, more=[("install_host_certificate", "hang")])
    path = Path(env["DEPLOYBOT_CONFIG"])
    path.write_text(with_ca(path.read_text()))
    point = KillPoint(None, "… certify the host key", resume=True)
    assert run_round(tmp_path, env, point, "web01", "10.20.1.10")
    restarted = write_config(tmp_path, None, resume=True)
    path.write_text(with_ca(path.read_text()))
    said = restart(tmp_path, restarted)
    assert "resuming after a restart" in said
    assert job_state(tmp_path, "web01") == "succeeded"
    db = sqlite3.connect(tmp_path / "jobs.db")
    try:
        key, certificate = db.execute(
            "SELECT host_key, host_certificate FROM jobs WHERE name = 'web01'"
        ).fetchone()
    finally:
        db.close()
    (vm,) = json.loads((tmp_path / "sim.json").read_text())["vms"]
    assert certificate is not None and vm["host_certificate"] == certificate
    info = read_certificate(certificate)
    assert info is not None and info.key == key == vm["host_key"]


# --- a lease extension -------------------------------------------------------------------


async def test_an_extension_renews_the_certificate_where_the_backend_installs_one(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(ca_settings(tmp_path), Recorder(), backends={"sim": sim}) as d:
        job = await deploy(d)
        old = read_certificate(job.host_certificate or "")
        (said,) = await answer(d, "alice", "lease extend web01 7d")
        extended = (await d.status(job.id)).job
    (vm,) = sim.vms.values()
    new = read_certificate(extended.host_certificate or "")
    assert old is not None and new is not None and extended.lease_end is not None
    assert abs(new.valid_before - extended.lease_end) < timedelta(seconds=5)
    assert new.valid_before - old.valid_before > timedelta(days=6)
    assert new.key == old.key == job.host_key and new.principals == old.principals
    assert vm.host_certificate == extended.host_certificate  # installed in the guest
    assert "renewed to the same end" in said


async def test_an_extension_on_a_backend_that_cannot_install_keeps_the_old_end(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = ChoosingSim("sim", time_scale=SIM_SCALE)  # vSphere's way: only at the identity
    async with running_deployer(ca_settings(tmp_path), Recorder(), backends={"sim": sim}) as d:
        job = await deploy(d)
        (said,) = await answer(d, "alice", "lease extend web01 7d")
        extended = (await d.status(job.id)).job
    assert extended.host_certificate == job.host_certificate
    info = read_certificate(job.host_certificate or "")
    assert info is not None and extended.lease_end is not None
    assert info.valid_before < extended.lease_end - timedelta(days=6)
    assert "Its host certificate still ends" in said and "/deploy known-hosts web01" in said


async def test_an_install_that_fails_at_an_extension_keeps_the_old_certificate(
    tmp_path: Path, ca_key: asyncssh.SSHKey
) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    recorder = Recorder()
    async with running_deployer(ca_settings(tmp_path), recorder, backends={"sim": sim}) as d:
        job = await deploy(d)
        sim.inject("install_host_certificate", "error")
        (said,) = await answer(d, "alice", "lease extend web01 7d")
        extended = (await d.status(job.id)).job
        (vm,) = sim.vms.values()
        assert extended.host_certificate == job.host_certificate == vm.host_certificate
        assert "still ends" in said
        assert any("host certificate was not renewed" in note for _id, note in recorder.notes)
        # The lease timer makes good what the extension could not (as after a process
        # killed between the extension's write and the re-signing): signed to the new end.
        await d.leases.step()
        renewed = (await d.status(job.id)).job
    info = read_certificate(renewed.host_certificate or "")
    assert renewed.host_certificate != job.host_certificate
    assert info is not None and renewed.lease_end is not None
    assert abs(info.valid_before - renewed.lease_end) < timedelta(seconds=5)
    assert vm.host_certificate == renewed.host_certificate  # installed, not only recorded


class PrivilegedSim(SimBackend):
    """Says which privileges a deploy lacks (`ChecksPrivileges`), as Proxmox does: the
    agent's write and exec only when certificates are asked for."""

    default_storage = None
    endpoint = ("127.0.0.1", 8006)

    async def missing_privileges(
        self, template: str, segments: Sequence[Segment] = (), *, certificates: bool = False
    ) -> list[MissingPrivilege]:
        if not certificates:
            return []
        return [MissingPrivilege("VM.GuestAgent.FileWrite", "/vms", "certify", "bot@pve!t")]


async def test_check_asks_for_the_certificate_privileges_only_with_a_ca() -> None:
    sim = PrivilegedSim("sim", time_scale=SIM_SCALE)
    assert isinstance(sim, ChecksPrivileges)
    try:
        without = await check_backend("sim", sim, "ubuntu-24.04")
        with_ca = await check_backend("sim", sim, "ubuntu-24.04", certificates=True)
    finally:
        await sim.close()
    assert [r.name for r in without if not r.ok] == []
    (lacking,) = [r for r in with_ca if not r.ok]
    assert lacking.name == "sim: privilege VM.GuestAgent.FileWrite on /vms"
