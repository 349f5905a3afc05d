"""The real TCP reachability check, against listeners on 127.0.0.0/8 only."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncssh
import pytest

from backends.base import RetryableError, Unreachable
from backends.sim import SimBackend, Simulator
from backends.sshcheck import SshCheck, fingerprint, ssh_host_key, tcp_probe
from bot.app.runtime import running_deployer
from bot.config.sections import Timeouts
from bot.jobs.waiting import retrying
from bot.models import JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import make_settings

GUEST = ipaddress.IPv4Address("127.0.5.10")


@pytest.fixture
async def listener() -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP server on the guest's loopback address; records each connection."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.write(b"SSH-2.0-OpenSSH_9.6 deploybot-test\r\n")
        writer.close()

    server = await asyncio.start_server(on_connect, str(GUEST), 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield port, accepted


async def free_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, str(GUEST), 0)
    port: int = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port


async def test_probe_connects(listener: tuple[int, list[int]]) -> None:
    port, _accepted = listener
    await tcp_probe(GUEST, port)


async def test_probe_of_a_closed_port_is_retryable() -> None:
    with pytest.raises(RetryableError, match="does not answer yet"):
        await tcp_probe(GUEST, await free_port())


def loopback_settings(tmp_path: Path, port: int):  # type: ignore[no-untyped-def]
    return make_settings(
        tmp_path,
        subnets=[{"cidr": "127.0.5.0/24", "gateway": "127.0.5.1"}],
        defaults={"ssh_port": port},
    )


def deploy_args() -> DeployArgs:
    parsed = parse(f"loop01 {GUEST}")
    assert isinstance(parsed, DeployArgs)
    return parsed


async def test_a_deploy_proves_ssh_over_real_tcp(
    tmp_path: Path, listener: tuple[int, list[int]]
) -> None:
    port, accepted = listener
    sim = Simulator("sim", time_scale=0.001)  # a real listener: no agent reads its keys
    async with running_deployer(loopback_settings(tmp_path, port), backends={"sim": sim}) as d:
        job = await d.request_deploy(deploy_args(), "alice")
        await d.drain()
        final = (await d.status(job.id)).job
    assert final.state is JobState.SUCCEEDED
    assert final.ssh_line == f"ssh ubuntu@{GUEST}"
    assert accepted, "the SSH check must really connect"


async def test_a_guest_that_never_answers_fails_the_deploy(tmp_path: Path) -> None:
    sim = Simulator("sim", time_scale=0.001)  # a real listener: no agent reads its keys
    settings = loopback_settings(tmp_path, await free_port())
    async with running_deployer(settings, backends={"sim": sim}) as d:
        job = await d.request_deploy(deploy_args(), "alice")
        await d.drain()
        final = (await d.status(job.id)).job
    assert final.state is JobState.FAILED
    assert final.failed_step == "ssh"
    assert "timed out" in (final.error or "") and "does not answer yet" in (final.error or "")
    assert sim.vms == {}


async def test_the_host_key_comes_from_the_key_exchange() -> None:
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.create_server(
        asyncssh.SSHServer, str(GUEST), 0, server_host_keys=[host_key]
    )
    port = server.sockets[0].getsockname()[1]
    try:
        presented = await SshCheck(None).probe(GUEST, port)
    finally:
        server.close()
        await server.wait_closed()
    # The public line, without a comment, the way a known_hosts line carries it.
    assert presented == " ".join(host_key.export_public_key().decode().split()[:2])
    assert presented is not None and presented.startswith("ssh-ed25519 AAAA")
    assert fingerprint(presented) == host_key.get_fingerprint("sha256")


async def test_the_fingerprint_is_the_key_openssh_shows_first() -> None:
    """A guest with RSA, ECDSA and ed25519 host keys (as cloud-init makes them): the
    printed fingerprint is the ed25519 key's, the one `ssh` shows at first contact and
    the message asks to compare with."""
    keys = [asyncssh.generate_private_key(alg) for alg in ("ssh-rsa", "ecdsa-sha2-nistp256")]
    ed25519 = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.create_server(
        asyncssh.SSHServer, str(GUEST), 0, server_host_keys=[*keys, ed25519]
    )
    port = server.sockets[0].getsockname()[1]
    try:
        presented = await SshCheck(None).probe(GUEST, port)
    finally:
        server.close()
        await server.wait_closed()
    assert presented is not None and fingerprint(presented) == ed25519.get_fingerprint("sha256")


async def test_a_listener_that_is_not_sshd_proves_reachability_without_a_key(
    listener: tuple[int, list[int]],
) -> None:
    port, _accepted = listener
    assert await ssh_host_key(GUEST, port, timeout_s=5) is None


async def test_a_starting_sshd_is_asked_again_at_the_poll_pace(
    tmp_path: Path, listener: tuple[int, list[int]]
) -> None:
    """A refused SSH port after the address is found is sshd still starting: the check
    asks again after `poll_initial_s`, not after the error backoff (here longer than the
    whole step may take, so the old pacing would fail the deploy)."""
    port, accepted = listener
    sim = Simulator("sim", time_scale=0.001)  # a real listener: no agent reads its keys
    sim.inject("probe_ssh", "flaky", times=3)  # three refusals before sshd answers
    settings = loopback_settings(tmp_path, port)
    timeouts = {**settings.timeouts.model_dump(), "retry_initial_s": 30.0, "ssh_s": 5.0}
    settings = settings.model_copy(update={"timeouts": type(settings.timeouts)(**timeouts)})
    async with running_deployer(settings, backends={"sim": sim}) as d:
        job = await d.request_deploy(deploy_args(), "alice")
        await d.drain()
        final = (await d.status(job.id)).job
    assert final.state is JobState.SUCCEEDED, final.error
    assert [f.times for f in sim.faults] == [0]  # all three refusals were met
    assert accepted


async def test_polling_still_backs_off_from_an_endpoint_that_does_not_answer() -> None:
    """`polling` is for "not yet" answers; a jump host or API that does not answer at all
    (Unreachable) gets the error backoff, here far longer than the caller waits."""
    timeouts = Timeouts(retry_initial_s=30.0, poll_initial_s=0.01)

    def answers(*items: object) -> Callable[[], Awaitable[object]]:
        queue = list(items)

        async def action() -> object:
            item = queue.pop(0)
            if isinstance(item, Exception):
                raise item
            return item

        return action

    not_yet = answers(RetryableError("not yet"), RetryableError("not yet"), "up")
    async with asyncio.timeout(5.0):
        assert await retrying(not_yet, timeouts, polling=True) == "up"
    gone = answers(Unreachable("jump host gone"), "up")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await retrying(gone, timeouts, polling=True)


async def test_a_key_the_agent_cannot_confirm_is_never_believed(tmp_path: Path) -> None:
    """A backend whose agent reads host keys, and a guest where it finds no key files
    (cloud-init has not written them yet; here: a loopback sshd outside the simulator,
    whose files the simulator's agent cannot see) while an sshd answers on the address:
    its key is not taken as "only seen over SSH". The step asks again until its timeout,
    then fails and rolls back, saying why."""
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.create_server(
        asyncssh.SSHServer, str(GUEST), 0, server_host_keys=[host_key]
    )
    port = server.sockets[0].getsockname()[1]
    sim = SimBackend("sim", time_scale=0.001)  # reads keys through its guest agent
    try:
        async with running_deployer(loopback_settings(tmp_path, port), backends={"sim": sim}) as d:
            job = await d.request_deploy(deploy_args(), "alice")
            await d.drain()
            final = (await d.status(job.id)).job
    finally:
        server.close()
        await server.wait_closed()
    assert final.state is JobState.FAILED and final.failed_step == "ssh"
    assert "finds no SSH host key files in the guest yet" in (final.error or "")
    assert final.host_key is None and sim.vms == {}
