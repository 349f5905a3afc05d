"""The simulated guests' own files and the guest-agent commands that reach them.

A booted cloud image has SSH host keys that cloud-init generated at its first boot
(`/etc/ssh/ssh_host_{ed25519,ecdsa}_key` and `.pub`; this image has no RSA key, as a
guest whose cloud-config lists only those types). The simulated agent answers the
qemu-guest-agent commands Proxmox sends for file-read, file-write, exec and exec-status
(guest-file-open/read/write/close, guest-exec, guest-exec-status) from `VM.files`, with
qemu-guest-agent's own error texts (`AgentError`).
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncssh

if TYPE_CHECKING:
    from tests.support.fakepve.cluster import VM

HOST_KEY_TYPES = {"ed25519": "ssh-ed25519", "ecdsa": "ecdsa-sha2-nistp256"}


class AgentError(Exception):
    """A guest-agent command's `error`; `desc` is qemu-guest-agent's own text."""

    def __init__(self, desc: str) -> None:
        super().__init__(desc)
        self.desc = desc


def host_key_path(kind: str, public: bool = True) -> str:
    return f"/etc/ssh/ssh_host_{kind}_key" + (".pub" if public else "")


def ensure_host_keys(vm: VM) -> None:
    """cloud-init's first boot: generate the host keys the guest does not have yet."""
    name = vm.config.get("name", f"vm{vm.vmid}")
    for kind, algorithm in HOST_KEY_TYPES.items():
        if host_key_path(kind, public=False) in vm.files:
            continue
        key = asyncssh.generate_private_key(algorithm, comment=f"root@{name}")
        vm.files[host_key_path(kind, public=False)] = key.export_private_key("openssh")
        vm.files[host_key_path(kind)] = key.export_public_key("openssh")


def sshd_key(vm: VM) -> asyncssh.SSHKey:
    """The key the guest's sshd presents: its ed25519 host key."""
    ensure_host_keys(vm)
    return asyncssh.import_private_key(vm.files[host_key_path("ed25519", public=False)])


@dataclass
class OpenFile:
    path: str
    mode: str
    position: int = 0
    written: bytearray = field(default_factory=bytearray)


@dataclass
class SimulatedAgent:
    """One guest's agent state: open file handles and started processes."""

    handles: dict[int, OpenFile] = field(default_factory=dict)
    processes: dict[int, list[str]] = field(default_factory=dict)
    executed: list[list[str]] = field(default_factory=list)  # every exec, for tests
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))

    def run(self, vm: VM, command: str, arguments: dict[str, Any]) -> Any:
        if command == "guest-file-open":
            path, mode = str(arguments["path"]), str(arguments.get("mode", "r"))
            if mode.startswith("r") and path not in vm.files:
                raise AgentError(
                    f"failed to open file '{path}' (mode: '{mode}'): No such file or directory"
                )
            handle = next(self._ids)
            self.handles[handle] = OpenFile(path, mode)
            return handle
        if command == "guest-file-read":
            opened = self._handle(arguments)
            data = vm.files.get(opened.path, b"")
            chunk = data[opened.position : opened.position + int(arguments.get("count", 4096))]
            opened.position += len(chunk)
            eof = opened.position >= len(data)
            return {"count": len(chunk), "buf-b64": base64.b64encode(chunk).decode(), "eof": eof}
        if command == "guest-file-seek":
            opened = self._handle(arguments)
            opened.position = int(arguments["offset"])
            return {"position": opened.position, "eof": False}
        if command == "guest-file-write":
            opened = self._handle(arguments)
            data = base64.b64decode(str(arguments["buf-b64"]))
            opened.written += data
            return {"count": len(data), "eof": False}
        if command == "guest-file-close":
            opened = self._handle(arguments)
            del self.handles[int(arguments["handle"])]
            if "w" in opened.mode:
                vm.files[opened.path] = bytes(opened.written)
            return {}
        if command == "guest-exec":
            pid = next(self._ids)
            argv = [str(arguments["path"]), *(str(a) for a in arguments.get("arg", []))]
            self.processes[pid] = argv
            self.executed.append(argv)
            return {"pid": pid}
        if command == "guest-exec-status":
            if int(arguments["pid"]) not in self.processes:
                raise AgentError("Invalid parameter 'pid'")
            return {"exited": True, "exitcode": 0}
        raise AgentError(f"The command {command} has not been found")

    def _handle(self, arguments: dict[str, Any]) -> OpenFile:
        opened = self.handles.get(int(arguments["handle"]))
        if opened is None:
            raise AgentError(f"handle '{arguments['handle']}' has not been found")
        return opened
