"""A guest's SSH host keys, read through the QEMU guest agent's file-read
(`GET /nodes/{node}/qemu/{vmid}/agent/file-read`), not through the network: what the
SSH check then requires the address to present (`backends.abilities.ReadsHostKeys`).

The privilege file-read needs depends on the release (qemu-server's Agent.pm):
`VM.Monitor` up to PVE 8, `VM.GuestAgent.FileRead` (or `VM.GuestAgent.Unrestricted`)
from PVE 9.0, which dropped `VM.Monitor`. The agent's other reads (ping,
network-get-interfaces, for the address) need `VM.Monitor`, then `VM.GuestAgent.Audit`.
"""

from __future__ import annotations

from typing import Any

import asyncssh

from backends.base import RetryableError
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import AgentNotRunning, Forbidden, GuestFileMissing

HOST_KEY_FILES = tuple(f"/etc/ssh/ssh_host_{kind}_key.pub" for kind in ("ed25519", "ecdsa", "rsa"))
GUEST_AGENT_PRIVILEGES_SINCE = (9, 0)
UNRESTRICTED = "VM.GuestAgent.Unrestricted"  # allows every agent command, on PVE 9


def file_read_privilege(release: tuple[int, int]) -> str:
    """The privilege the agent's file-read needs on /vms/<id> on this release."""
    return "VM.GuestAgent.FileRead" if release >= GUEST_AGENT_PRIVILEGES_SINCE else "VM.Monitor"


def agent_read_privilege(release: tuple[int, int]) -> str:
    """The privilege the agent's ping and network-get-interfaces need."""
    return "VM.GuestAgent.Audit" if release >= GUEST_AGENT_PRIVILEGES_SINCE else "VM.Monitor"


async def read(
    api: PveApi, node: str, vm_id: str, release: tuple[int, int], account: str
) -> list[str]:
    """The guest's public host keys as "type base64" lines, from the files that exist.
    RetryableError while the agent is not running; Forbidden (a PermanentError) naming
    the privilege
    when the API refuses (`account`: the user or token, no secret in it)."""
    path = f"nodes/{node}/qemu/{vm_id}/agent/file-read"
    keys: list[str] = []
    for name in HOST_KEY_FILES:
        what = f"reading {name} of VM {vm_id} through its guest agent"
        try:
            answer = await api.get(path, what, file=name)
        except GuestFileMissing:
            continue  # a key type the guest does not have
        except AgentNotRunning as exc:
            raise RetryableError(
                f"VM {vm_id}: its guest agent is not running (yet), so its SSH host keys "
                f"cannot be read through it ({exc.message})",
                vm_id=vm_id,
            ) from None
        except Forbidden as exc:
            raise Forbidden(_refused(vm_id, release, account, exc.message), vm_id=vm_id) from None
        keys += public_keys(answer)
    return keys


def _refused(vm_id: str, release: tuple[int, int], account: str, detail: str) -> str:
    privilege = file_read_privilege(release)
    other = f" (or {UNRESTRICTED})" if release >= GUEST_AGENT_PRIVILEGES_SINCE else ""
    return (
        f"VM {vm_id}: {account} may not read files through the QEMU guest agent, which "
        f"deploybot needs to confirm the new VM's SSH host key: grant {privilege}{other} "
        f"on /vms (PVE {release[0]}.{release[1]}), then deploy again; `deploybot check` "
        f"lists what is missing ({detail})"
    )


def public_keys(answer: Any) -> list[str]:
    """The OpenSSH public keys in a file-read answer's `content`, as "type base64"
    (comments dropped); lines that are not a key are skipped."""
    content = answer.get("content", "") if isinstance(answer, dict) else ""
    found: list[str] = []
    for line in str(content).splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        candidate = f"{parts[0]} {parts[1]}"
        try:
            asyncssh.import_public_key(candidate)
        except (asyncssh.KeyImportError, ValueError):
            continue
        found.append(candidate)
    return found
