"""The optional reachability probe of `[ipam] probe`: does anything answer on an address?

A TCP connection to a few ports, from the bot or, for a backend whose guests it reaches
only through a jump host (`ssh_jump`), from that jump host (`direct-tcpip`, as `ssh -J`
does). A host that accepts or refuses the connection holds the address: a refusal is
an answer (a host sent it). Silence, an unreachable network or a jump host that will not
forward there says nothing either way. Callers probe only inside the configured subnets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging

import asyncssh

from backends.config import SshJump
from backends.sshcheck import jump_connection
from bot.models.errors import BackendError

log = logging.getLogger(__name__)


async def answers(
    ip: ipaddress.IPv4Address, ports: tuple[int, ...], timeout_s: float, jump: SshJump | None
) -> bool:
    if jump is not None:
        return await _through(jump, ip, ports, timeout_s)
    for port in ports:
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(str(ip), port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return True
        except ConnectionRefusedError:
            return True
        except (OSError, TimeoutError):
            continue
    return False


async def _through(
    jump: SshJump, ip: ipaddress.IPv4Address, ports: tuple[int, ...], timeout_s: float
) -> bool:
    try:
        conn = await jump_connection(jump, timeout_s=max(timeout_s, 5.0))
    except BackendError as exc:  # the probe is an extra check: said in the log, not fatal
        log.warning("probe of %s through jump host %s not done: %s", ip, jump, exc.message)
        return False
    try:
        for port in ports:
            try:
                async with asyncio.timeout(timeout_s):
                    _, writer = await conn.open_connection(str(ip), port)
                writer.close()
                return True
            except asyncssh.ChannelOpenError as exc:
                # OpenSSH passes connect(2)'s error on as the reason.
                if "refused" in exc.reason.lower():
                    return True
            except TimeoutError:
                continue
        return False
    finally:
        conn.close()
        with contextlib.suppress(OSError, asyncssh.Error):
            await conn.wait_closed()
