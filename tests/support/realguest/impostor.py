"""An SSH server that is not the guest: what a stale VM with the same address, a host on a
mis-tagged VLAN or an interceptor would be to a deploy's SSH check.

A real SSH server (asyncssh) on 127.0.0.1 with a host key of its own that lets nobody in:
the fake's jump host leads a guest's address here instead of to its guest
(`JumpHost.redirected`), and the deploy must refuse the key it presents.
"""

from __future__ import annotations

import asyncssh

from backends.sshcheck import public_line


class Impostor:
    def __init__(self) -> None:
        self.key = asyncssh.generate_private_key("ssh-ed25519")
        self.public = public_line(self.key)
        self.fingerprint = self.key.get_fingerprint("sha256")
        self.connections = 0  # key exchanges begun (each SSH check is one)
        self.port = 0
        self._server: asyncssh.SSHAcceptor | None = None

    async def start(self) -> Impostor:
        self._server = await asyncssh.create_server(
            lambda: _Server(self), "127.0.0.1", 0, server_host_keys=[self.key]
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class _Server(asyncssh.SSHServer):
    def __init__(self, impostor: Impostor) -> None:
        self.impostor = impostor

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.impostor.connections += 1

    def begin_auth(self, username: str) -> bool:
        return True  # and no way to authenticate is offered: nobody gets in
