"""The SSH check every real backend runs as `probe_ssh`: prove the guest's SSH port
answers, then read its host key, directly or through a jump host (`SshJump`).

Reachability is the question, not login: the check opens a TCP connection and closes
it, then reads the server's host key from a key exchange so the user can verify the
first connection instead of trusting it blindly. Through a jump host both go over one
SSH connection to it (`direct-tcpip`, as `ssh -J` does), so the bot never needs a route
to the guests' network.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging

import asyncssh

from backends.base import HostKeyPair, PermanentError, RetryableError, Unreachable
from backends.config import SshJump

log = logging.getLogger(__name__)


class SshCheck:
    """The SSH check of one backend's guests (its `probe_ssh`): direct, or through the
    backend's jump host over one SSH connection kept between checks (fifty deploys each
    logging in anew every tenth of a second would soon be refused by a real bastion).
    A broken connection is opened again at the next check."""

    def __init__(self, jump: SshJump | None) -> None:
        self.jump = jump
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()

    async def probe(self, address: ipaddress.IPv4Address, port: int) -> str | None:
        """One attempt: raise RetryableError while the port does not answer (Unreachable
        when the jump host does not); return the public host key the server presented
        as one OpenSSH line ("ssh-ed25519 AAAA...", no comment), or None when the port
        answered but no key could be read."""
        if self.jump is None:
            await tcp_probe(address, port)
            return await ssh_host_key(address, port)
        jump, tunnel = self.jump, await self._tunnel()
        try:
            _reader, writer = await tunnel.open_connection(str(address), port)
        except asyncssh.ChannelOpenError as exc:
            if exc.code == asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED:
                raise PermanentError(
                    f"jump host {jump} will not connect to {address}:{port} ({exc.reason}): "
                    f"allow TCP forwarding for {jump.user} there (AllowTcpForwarding, PermitOpen)"
                ) from None
            raise RetryableError(
                f"{address}:{port} does not answer yet (from {jump.host}: {exc.reason})"
            ) from None
        except (OSError, asyncssh.Error) as exc:  # the connection to the jump host broke
            await self._drop(tunnel)
            raise Unreachable(f"jump host {jump} dropped the connection ({exc})") from None
        writer.close()
        return await ssh_host_key(address, port, tunnel=tunnel)

    async def _tunnel(self) -> asyncssh.SSHClientConnection:
        assert self.jump is not None
        async with self._lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await jump_connection(self.jump)
            return self._conn

    async def _drop(self, conn: asyncssh.SSHClientConnection) -> None:
        if self._conn is conn:
            self._conn = None
        conn.close()
        with contextlib.suppress(OSError, asyncssh.Error):
            await conn.wait_closed()

    async def close(self) -> None:
        if self._conn is not None:
            await self._drop(self._conn)


async def tcp_probe(address: ipaddress.IPv4Address, port: int) -> None:
    """One TCP connect to address:port; a refused or unreachable port is retryable."""
    try:
        _reader, writer = await asyncio.open_connection(str(address), port)
    except OSError as exc:
        raise RetryableError(
            f"{address}:{port} does not answer yet ({exc.strerror or exc})"
        ) from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


# The plain host key algorithms in OpenSSH's default order (`ssh -G HOST`): the printed
# fingerprint is the one `ssh` shows at first contact (the ed25519 key when the guest has
# one), not the RSA key that asyncssh's own order would pick.
OPENSSH_HOST_KEY_ORDER = [
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "rsa-sha2-512",
    "rsa-sha2-256",
]


async def ssh_host_key(
    address: ipaddress.IPv4Address,
    port: int,
    timeout_s: float = 10.0,
    *,
    tunnel: asyncssh.SSHClientConnection | None = None,
) -> str | None:
    """The SSH server's public host key as one OpenSSH line (`ssh-ed25519 AAAA...`, no
    comment), read from its key exchange.

    None when the server answered TCP but no key could be read (an sshd still starting,
    a non-SSH listener): reachability is already proven.
    """
    try:
        async with asyncio.timeout(timeout_s):
            key = await asyncssh.get_server_host_key(
                str(address),
                port,
                tunnel=tunnel or (),
                config=None,
                server_host_key_algs=OPENSSH_HOST_KEY_ORDER,
            )
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        log.info("no SSH host key from %s:%s: %s", address, port, exc)
        return None
    return public_line(key) if key is not None else None


def public_line(key: asyncssh.SSHKey) -> str:
    """A public key as one OpenSSH line without its comment: "ssh-ed25519 AAAA..."."""
    algorithm, blob = key.export_public_key("openssh").decode().split()[:2]
    return f"{algorithm} {blob}"


def new_host_key() -> HostKeyPair:
    """A fresh ed25519 host key pair for a guest (deploybot chooses its host key)."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    return HostKeyPair(key.export_private_key("openssh").decode(), public_line(key))


def fingerprint(public: str) -> str:
    """The SHA256 fingerprint of an OpenSSH public key line, as `ssh` shows it
    ("SHA256:..."); a line that holds no key is shown as it is."""
    try:
        return asyncssh.import_public_key(public).get_fingerprint("sha256")
    except (asyncssh.KeyImportError, ValueError):
        return public


async def jump_connection(jump: SshJump, timeout_s: float = 15.0) -> asyncssh.SSHClientConnection:
    """An SSH connection to the jump host, its host key checked against `known_hosts`.

    A refused key or an unknown host key will not mend by waiting (PermanentError, with
    what to fix); a jump host that does not answer may (Unreachable).
    """
    try:
        return await asyncssh.connect(
            jump.host,
            jump.port,
            username=jump.user,
            client_keys=[str(jump.key_file)],
            known_hosts=str(jump.known_hosts),
            agent_path=None,
            config=None,
            connect_timeout=timeout_s,
        )
    except asyncssh.PermissionDenied:
        raise PermanentError(
            f"jump host {jump} refused the key in {jump.key_file}: add its public key to "
            f"~{jump.user}/.ssh/authorized_keys there"
        ) from None
    except asyncssh.HostKeyNotVerifiable:
        raise PermanentError(
            f"jump host {jump.host}:{jump.port} showed a host key that {jump.known_hosts} "
            "does not list: check it, then add it there (ssh-keyscan)"
        ) from None
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        raise Unreachable(f"jump host {jump} does not answer ({exc})") from None
