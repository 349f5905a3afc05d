"""The SSH check through a jump host: a real asyncssh bastion on 127.0.0.1 that forwards
only to the loopback sshd it maps a guest address to (tests/support/jumphost.py)."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest
from pydantic import ValidationError

from backends.base import PermanentError, RetryableError, Unreachable
from backends.config import SshJump
from backends.sshcheck import SshCheck, public_line
from bot.config.settings import load_settings
from bot.models.errors import ConfigError
from tests.support.jumphost import JumpHost

GUEST = ipaddress.IPv4Address("10.0.0.50")  # never connected to: the jump host maps it


@pytest.fixture
async def sshd() -> AsyncIterator[tuple[int, str]]:
    """The guest's sshd, on loopback; its port and public host key line."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.create_server(
        asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[key]
    )
    yield server.sockets[0].getsockname()[1], public_line(key)
    server.close()
    await server.wait_closed()


@pytest.fixture
async def jump(tmp_path: Path, sshd: tuple[int, str]) -> AsyncIterator[JumpHost]:
    port = sshd[0]

    def route(host: str, dest_port: int) -> tuple[str, int] | None:
        return ("127.0.0.1", port) if (host, dest_port) == (str(GUEST), 22) else None

    host = await JumpHost(tmp_path / "jump", route).start()
    yield host
    await host.close()


def settings_of(jump: JumpHost, **changes: object) -> SshJump:
    return SshJump.model_validate({**jump.config(), **changes})


async def probe_ssh_endpoint(
    address: ipaddress.IPv4Address, port: int, jump: SshJump | None
) -> str | None:
    """One check with a connection to the jump host of its own."""
    check = SshCheck(jump)
    try:
        return await check.probe(address, port)
    finally:
        await check.close()


async def test_the_check_goes_through_the_jump_host(jump: JumpHost, sshd: tuple[int, str]) -> None:
    fingerprint = await probe_ssh_endpoint(GUEST, 22, settings_of(jump))
    assert fingerprint == sshd[1]  # the guest's key, read through the tunnel
    assert jump.requests == [(str(GUEST), 22), (str(GUEST), 22)]  # TCP check, key exchange


async def test_a_guest_the_jump_host_cannot_reach_is_not_there_yet(jump: JumpHost) -> None:
    with pytest.raises(RetryableError, match=r"10.0.0.51:22 does not answer yet \(from 127"):
        await probe_ssh_endpoint(ipaddress.IPv4Address("10.0.0.51"), 22, settings_of(jump))
    assert jump.requests == [("10.0.0.51", 22)]


async def test_a_refused_key_says_what_to_fix(jump: JumpHost, tmp_path: Path) -> None:
    other = tmp_path / "other-key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(other))
    with pytest.raises(PermanentError, match=r"refused the key in .*other-key: add its public"):
        await probe_ssh_endpoint(GUEST, 22, settings_of(jump, key_file=str(other)))
    assert jump.requests == []


async def test_an_unknown_jump_host_key_is_refused(jump: JumpHost, tmp_path: Path) -> None:
    stranger = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{jump.port} {stranger}", encoding="utf-8")
    with pytest.raises(PermanentError, match="does not list: check it"):
        await probe_ssh_endpoint(GUEST, 22, settings_of(jump, known_hosts=str(known)))
    assert jump.requests == []


async def test_a_jump_host_that_does_not_answer_may_later(jump: JumpHost) -> None:
    await jump.close()
    down = r"jump host deploybot@127\.0\.0\.1:\d+ does not answer"
    with pytest.raises(Unreachable, match=down):
        await probe_ssh_endpoint(GUEST, 22, settings_of(jump))


async def test_checks_share_one_login_to_the_jump_host(
    jump: JumpHost, sshd: tuple[int, str]
) -> None:
    check = SshCheck(settings_of(jump))
    try:
        for _ in range(3):
            assert await check.probe(GUEST, 22) == sshd[1]
        with pytest.raises(RetryableError, match="does not answer yet"):
            await check.probe(ipaddress.IPv4Address("10.0.0.51"), 22)
        assert await check.probe(GUEST, 22) == sshd[1]
    finally:
        await check.close()
    assert jump.logins == 1  # one SSH connection, many direct-tcpip channels
    assert len(jump.requests) == 9


async def test_a_jump_host_that_forbids_forwarding_says_so(jump: JumpHost) -> None:
    jump.prohibited.add(str(GUEST))
    with pytest.raises(PermanentError, match=r"will not connect to 10\.0\.0\.50:22 .*AllowTcp"):
        await probe_ssh_endpoint(GUEST, 22, settings_of(jump))


async def test_a_key_file_that_holds_no_key_stops_the_start(jump: JumpHost, tmp_path: Path) -> None:
    garbage = tmp_path / "not-a-key"
    garbage.write_text("hello\n", encoding="utf-8")
    with pytest.raises(ValidationError, match="holds no SSH private key deploybot can use"):
        settings_of(jump, key_file=str(garbage))


def test_an_unreadable_key_file_stops_the_start(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("", encoding="utf-8")
    with pytest.raises(ValidationError, match="does not exist or is not a file"):
        SshJump(host="bastion", user="deploybot", key_file=tmp_path / "nope", known_hosts=known)
    config = tmp_path / "deploybot.toml"
    config.write_text(
        f"""
[[backends]]
kind = "sim"
name = "sim"
[backends.ssh_jump]
host = "bastion.example"
user = "deploybot"
key_file = "{tmp_path / "missing-key"}"
known_hosts = "{known}"
""",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"backends\.0\.ssh_jump\.key_file.*missing-key"):
        load_settings(config)
