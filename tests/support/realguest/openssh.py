"""A login with the real OpenSSH client (/usr/bin/ssh), as a user would make it: through
the fake's jump host (or straight to a guest's forwarded port), the guest's host key
checked strictly against a known_hosts file the test writes (a deploy's known_hosts line,
or deploybot's `@cert-authority` line).

Nothing from the user's own ssh set-up takes part (`-F /dev/null`, no agent, no global
known_hosts), and nothing asks: BatchMode makes a key ssh cannot verify a failure
(exit code 255, "Host key verification failed.") instead of a prompt. The jump host's
own key is checked the same way, through its known_hosts file, in the ProxyCommand
(`ssh -W ADDRESS:22`), so the host ssh is told (a name, for a certificate's principals)
and the address the jump host leads to may differ. Without a jump host ssh connects to
ADDRESS:PORT and checks the key as HOST's (`HostKeyAlias`: known_hosts and a
certificate's principals are matched against it).
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
from pathlib import Path

from tests.support.jumphost import JumpHost

SSH = "/usr/bin/ssh"
TIMEOUT_S = 120.0  # a TCG guest answers a login in seconds; this only bounds a hang


def available() -> bool:
    return shutil.which(SSH) is not None


def _strict(known_hosts: Path, identity: Path) -> list[str]:
    """The options both connections share: this file's keys only, no prompt, no agent."""
    return [
        "-F", "/dev/null",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "UpdateHostKeys=no",
        "-o", "IdentityAgent=none",
        "-o", "IdentitiesOnly=yes",
        "-o", "ConnectTimeout=30",
        "-i", str(identity),
    ]  # fmt: skip


def argv(
    jump: JumpHost | None,
    *,
    user: str,
    host: str,
    address: str,
    port: int,
    identity: Path,
    known_hosts: Path,
    command: str,
) -> list[str]:
    """`ssh USER@HOST COMMAND`, HOST reached as ADDRESS:PORT through the jump host, or
    directly without one."""
    if jump is None:
        return [
            SSH, *_strict(known_hosts, identity),
            "-o", f"HostKeyAlias={host}", "-p", str(port),
            f"{user}@{address}", command,
        ]  # fmt: skip
    proxy = [
        SSH, *_strict(jump.known_hosts, jump.key_file),
        "-p", str(jump.port), "-W", f"{address}:{port}", f"{jump.user}@{jump.host}",
    ]  # fmt: skip
    # ssh expands %-tokens in a ProxyCommand: none of these words holds one.
    assert not any("%" in word for word in proxy), proxy
    return [
        SSH, *_strict(known_hosts, identity),
        "-o", f"ProxyCommand={shlex.join(proxy)}",
        f"{user}@{host}", command,
    ]  # fmt: skip


async def login(
    jump: JumpHost | None,
    *,
    user: str,
    host: str,
    address: str,
    port: int = 22,
    identity: Path,
    known_hosts: Path,
    command: str = "true",
) -> tuple[int, str]:
    """Run COMMAND as USER on HOST with the real ssh client: (exit code, stderr)."""
    words = argv(
        jump,
        user=user,
        host=host,
        address=address,
        port=port,
        identity=identity,
        known_hosts=known_hosts,
        command=command,
    )
    process = await asyncio.create_subprocess_exec(
        *words,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(TIMEOUT_S):
            _out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"ssh did not end within {TIMEOUT_S} s: {shlex.join(words)}") from None
    assert process.returncode is not None
    return process.returncode, err.decode(errors="replace")
