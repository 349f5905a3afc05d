"""What the real-guest tests share: the skip-or-fail rule, the image they need, the SSH
login that waits for the guest, and reading the guest's own view of itself over SSH.

Nothing here waits by sleeping for a set time: every loop polls a condition and ends at
its deadline (a TCG guest on busy cores takes from one to several minutes).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import asyncssh
import pytest

from tests.support.realguest import image, qemu


def unavailable(reason: str) -> NoReturn:
    """Skip saying why; under DEPLOYBOT_REQUIRE_REALGUEST=1 (CI) fail instead."""
    if os.environ.get("DEPLOYBOT_REQUIRE_REALGUEST") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_REALGUEST=1 forbids skipping this test")
    pytest.skip(reason)


def require_image(variant: image.Variant = image.ENI) -> Path:
    """The built image of `variant`, or a skip (a failure in CI) naming what is missing."""
    if missing := qemu.missing_tools():
        unavailable(f"missing {', '.join(missing)} (apt-get install qemu-system-x86 ...)")
    path = image.built(variant)
    if path is None:
        unavailable(
            f"no {variant.name} guest image in {image.image_dir(variant)}: run `make guest-image`"
        )
    return path


async def ssh_login(
    guest: qemu.Guest, user: str, key: asyncssh.SSHKey, deadline: float
) -> asyncssh.SSHClientConnection:
    """Log in as `user` with the key once the guest lets us (QEMU accepts on the forwarded
    port before sshd listens, and the key is there only once cloud-init wrote it)."""
    while True:
        try:
            return await asyncssh.connect(
                "127.0.0.1",
                guest.ssh_port,
                username=user,
                client_keys=[key],
                known_hosts=None,  # the guest's key is new; the tests compare it
                server_host_key_algs=["ssh-ed25519"],
                connect_timeout=10,
            )
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            if time.monotonic() > deadline or not guest.running():
                raise AssertionError(f"no SSH ({exc!r}): {guest.failure()}") from exc
        await asyncio.sleep(2.0)  # between polls of a condition bound by `deadline`


async def out(conn: asyncssh.SSHClientConnection, command: str, check: bool = True) -> str:
    result = await conn.run(command, check=check, timeout=120)
    return str(result.stdout)


@dataclass(frozen=True)
class NetView:
    """The guest's network as it sees it: the NIC with the MAC and what is on it."""

    nic: str  # the name of the NIC whose MAC was asked for
    addresses: str  # `ip -o -4 addr show dev NIC`
    routes: str  # `ip route`
    resolv: list[str]  # /etc/resolv.conf, line by line


async def net_view(conn: asyncssh.SSHClientConnection, mac: str) -> NetView:
    links = await out(conn, "ip -o link show")
    nic = next(line.split(": ")[1] for line in links.splitlines() if mac.lower() in line)
    return NetView(
        nic=nic,
        addresses=await out(conn, f"ip -o -4 addr show dev {nic}"),
        routes=await out(conn, "ip route"),
        resolv=(await out(conn, "cat /etc/resolv.conf")).splitlines(),
    )
