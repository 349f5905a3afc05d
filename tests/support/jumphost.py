"""A jump host (bastion) for the tests and the fakes' labs.

A real SSH server (asyncssh) on 127.0.0.1 that lets in one user with one key and
forwards `direct-tcpip` requests, as `ssh -J` uses them, only where its owner's `route`
says: a guest address (10.0.0.50:22, say) maps to the loopback endpoint where that
simulated guest's sshd listens. Anything else is refused as a bastion without a route
would refuse it, so a check of a guest "on 10.0.0.50" never sends a packet beyond
loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncssh

Route = Callable[[str, int], tuple[str, int] | None]


class JumpHost:
    def __init__(
        self, state_dir: Path, route: Route, user: str = "deploybot", *, await_banner: bool = False
    ) -> None:
        self.state_dir = state_dir
        self.route = route
        # Endpoints that accept before the guest listens (QEMU's port forwards): a
        # forward is opened only once the SSH banner came, else refused as a real
        # network refuses a port nobody listens on.
        self.await_banner = await_banner
        self.user = user
        self.port = 0
        self.key_file = state_dir / "jump-client-key"
        self.known_hosts = state_dir / "jump-known-hosts"
        self.requests: list[tuple[str, int]] = []  # every direct-tcpip asked for
        self.logins = 0
        self.prohibited: set[str] = set()  # guest addresses it will not forward to
        # Guest addresses led elsewhere instead (a loopback endpoint: an impostor's sshd
        # standing in for a stale VM or an interceptor on that address).
        self.redirected: dict[str, tuple[str, int]] = {}
        self._host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.client_key = asyncssh.generate_private_key("ssh-ed25519")
        self._server: asyncssh.SSHAcceptor | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> JumpHost:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError("the jump host listens on 127.0.0.0/8 only")
        self._server = await asyncssh.create_server(
            lambda: _Server(self), host, port, server_host_keys=[self._host_key]
        )
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.client_key.write_private_key(str(self.key_file))
        os.chmod(self.key_file, 0o600)
        public = self._host_key.export_public_key().decode().strip()
        self.known_hosts.write_text(f"[{host}]:{self.port} {public}\n", encoding="utf-8")
        return self

    def config(self) -> dict[str, Any]:
        """The `ssh_jump` table of a backend whose guests sit behind this host."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "key_file": str(self.key_file),
            "known_hosts": str(self.known_hosts),
        }

    def toml(self) -> str:
        """The same as a `[backends.ssh_jump]` table, for a written deploybot.toml."""
        lines = [
            f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in self.config().items()
        ]
        return "[backends.ssh_jump]\n" + "\n".join(lines) + "\n"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class _Server(asyncssh.SSHServer):
    def __init__(self, jump: JumpHost) -> None:
        self.jump = jump
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn

    def begin_auth(self, username: str) -> bool:
        return True  # nobody gets in without the key

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        ours = self.jump.client_key.export_public_key()
        return username == self.jump.user and key.export_public_key() == ours

    def auth_completed(self) -> None:
        self.jump.logins += 1

    def connection_requested(
        self, dest_host: str, dest_port: int, orig_host: str, orig_port: int
    ) -> Any:
        self.jump.requests.append((dest_host, dest_port))
        if dest_host in self.jump.prohibited:  # AllowTcpForwarding no, or PermitOpen
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, "administratively prohibited"
            )
        target = self.jump.redirected.get(dest_host) or self.jump.route(dest_host, dest_port)
        if target is None or not ipaddress.ip_address(target[0]).is_loopback:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "Connection refused")
        return self._forward(target)

    async def _forward(self, target: tuple[str, int]) -> asyncssh.SSHForwarder:
        if self.jump.await_banner and not await _banner(target):
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "Connection refused")
        assert self.conn is not None
        return await self.conn.forward_connection(*target)


async def _banner(target: tuple[str, int], timeout_s: float = 10.0) -> bool:
    """Whether an SSH server answers at `target` with its version line (`SSH-2.0-...`)."""
    try:
        reader, writer = await asyncio.open_connection(*target)
    except OSError:
        return False
    try:
        async with asyncio.timeout(timeout_s):
            return (await reader.readexactly(4)) == b"SSH-"
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
