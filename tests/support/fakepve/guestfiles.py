"""The simulated guests' own files and the guest-agent commands that reach them.

A booted cloud image has SSH host keys that cloud-init generated at its first boot
(`/etc/ssh/ssh_host_{ed25519,ecdsa}_key` and `.pub`; this image has no RSA key, as a
guest whose cloud-config lists only those types). The simulated agent answers the
qemu-guest-agent commands Proxmox sends for file-read, file-write, exec and exec-status
(guest-file-open/read/write/close, guest-exec, guest-exec-status) from `VM.files`, with
qemu-guest-agent's own error texts (`AgentError`).

A command (guest-exec) really runs, with the host's /bin/sh and tools, in a mount and PID
namespace of its own (`tests.support.mountns`) where /etc/ssh and /run are the guest's
(its `VM.files` under them, written to a temporary folder before and read back after).
First on its PATH are the guest's `systemctl` (`SYSTEMCTL`, the guest's systemd: it knows
`SimulatedAgent.units`, logs each call to /run/systemctl.log, and a reload runs `sshd -t`
first as Debian's ssh.service does; a reload of sshd restarts the guest's sshd, which then
presents the certificates its `HostCertificate` lines name: `host_certificates`) and
`sshd` (`SSHD`: only `sshd -t`, which rejects a HostCertificate inside a Match block; the
guest has no real sshd binary, and this host may have none). The image's sshd_config is
Debian 12's: it includes /etc/ssh/sshd_config.d/*.conf first.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh

from tests.support import mountns

if TYPE_CHECKING:
    from tests.support.fakepve.cluster import VM

HOST_KEY_TYPES = {"ed25519": "ssh-ed25519", "ecdsa": "ecdsa-sha2-nistp256"}
SSHD_CONFIG = "/etc/ssh/sshd_config"
DEBIAN_SSHD_CONFIG = b"""Include /etc/ssh/sshd_config.d/*.conf

KbdInteractiveAuthentication no
UsePAM yes
X11Forwarding yes
PrintMotd no
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
"""
SYSTEMCTL_LOG = "/run/systemctl.log"
SSH_UNITS = ("ssh.service", "sshd.service")  # Debian: ssh.service, sshd.service its alias
# The guest's folders a command sees as its own (the rest is the host's, read-only use).
GUEST_FOLDERS = mountns.GUEST_TARGETS  # what mountns.unavailable() probes by default
# The guest's systemd, as a `systemctl` first on the command's PATH: it knows `units` (what
# its template fills in), logs each call to /run/systemctl.log, and reloads as Debian's
# ssh.service does (ExecReload: `sshd -t`, then SIGHUP): a configuration sshd rejects
# fails the reload.
SYSTEMCTL = """#!/bin/sh
echo "systemctl $*" >> /run/systemctl.log
for unit in "$@"; do last=$unit; done
case "$1" in reload|try-reload-or-restart) ;; *) echo "unknown command $1" >&2; exit 1;; esac
units="{units}"
for unit in $units; do
  if [ "$last" = "$unit" ] || [ "$last.service" = "$unit" ]; then
    sshd -t || {{ echo "Job for $unit failed (its ExecReload, sshd -t, failed)." >&2; exit 1; }}
    exit 0
  fi
done
echo "Failed to $1 $last: Unit $last not found." >&2
exit 5
"""
# The guest's sshd has no daemon here (the fake's `guest.Guest` is its listener), only the
# check a reload relies on: `sshd -t` reads sshd_config and the drop-ins it includes (in
# place of the Include) and rejects what OpenSSH's sshd rejects with these words, a
# HostCertificate inside a Match block; it knows nothing else of sshd's grammar.
SSHD = r"""#!/bin/sh
[ "${1:-}" = -t ] || { echo "the fake guest's sshd only does -t" >&2; exit 255; }
exec awk '
function check(file,   line, n, words, key, include, found, rule) {
  n = 0; inmatch = 0
  while ((getline line < file) > 0) {
    n++
    sub(/^[ \t]+/, "", line)
    if (line == "" || line ~ /^#/) continue
    split(line, words, /[ \t=]+/)
    key = tolower(words[1])
    if (key == "match") inmatch = 1
    else if (key == "hostcertificate" && inmatch) {
      rule = "Directive \047HostCertificate\047 is not allowed within a Match block"
      printf "%s line %d: %s\n", file, n, rule > "/dev/stderr"
      bad++
    } else if (key == "include" && !inmatch) {
      include = "ls -1 " words[2] " 2>/dev/null"
      while ((include | getline found) > 0) { check(found); inmatch = 0 }
      close(include)
    }
  }
  close(file)
}
BEGIN {
  check("/etc/ssh/sshd_config")
  if (bad) {
    printf "/etc/ssh/sshd_config: terminating, %d bad configuration options\n", bad > "/dev/stderr"
    exit 255
  }
}'
"""


class AgentError(Exception):
    """A guest-agent command's `error`; `desc` is qemu-guest-agent's own text."""

    def __init__(self, desc: str) -> None:
        super().__init__(desc)
        self.desc = desc


def host_key_path(kind: str, public: bool = True) -> str:
    return f"/etc/ssh/ssh_host_{kind}_key" + (".pub" if public else "")


def ensure_host_keys(vm: VM) -> None:
    """cloud-init's first boot: generate the host keys the guest does not have yet (the
    image's sshd_config comes with the first)."""
    name = vm.config.get("name", f"vm{vm.vmid}")
    for kind, algorithm in HOST_KEY_TYPES.items():
        if host_key_path(kind, public=False) in vm.files:
            continue
        key = asyncssh.generate_private_key(algorithm, comment=f"root@{name}")
        vm.files[host_key_path(kind, public=False)] = key.export_private_key("openssh")
        vm.files[host_key_path(kind)] = key.export_public_key("openssh")
        if kind == "ed25519":  # the first boot of the image: its sshd_config too
            vm.files.setdefault(SSHD_CONFIG, DEBIAN_SSHD_CONFIG)


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
class Process:
    """A command the agent started: its run in the confined guest, then its answer."""

    task: asyncio.Task[dict[str, Any]]


def host_certificates(vm: VM) -> list[str]:
    """The certificates sshd presents with its key: the files its `HostCertificate` lines
    name (sshd_config, and the drop-ins it includes first) that exist."""
    config = vm.files.get(SSHD_CONFIG, b"").decode()
    texts = [config]
    if re.search(r"(?mi)^\s*Include\s+/etc/ssh/sshd_config\.d/", config):
        drop_ins = sorted(
            p for p in vm.files if re.fullmatch(r"/etc/ssh/sshd_config\.d/.+\.conf", p)
        )
        texts = [vm.files[p].decode() for p in drop_ins] + texts
    found = []
    for text in texts:
        for path in re.findall(r"(?mi)^\s*HostCertificate\s+(\S+)", text):
            if path in vm.files and path not in found:
                found.append(path)
    return [vm.files[p].decode().strip() for p in found]


@dataclass
class SimulatedAgent:
    """One guest's agent state: open file handles and started processes.
    `on_reload`: what a command that reloaded sshd (its systemctl) makes happen."""

    handles: dict[int, OpenFile] = field(default_factory=dict)
    processes: dict[int, Process] = field(default_factory=dict)
    executed: list[list[str]] = field(default_factory=list)  # every exec, for tests
    on_reload: Callable[[VM], Awaitable[None]] | None = None
    units: tuple[str, ...] = SSH_UNITS  # the guest's systemd knows these (a test may change)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))

    async def ask(self, vm: VM, command: str, arguments: dict[str, Any]) -> Any:
        """A command's `return`; guest-exec starts the program, guest-exec-status says
        whether it ended (and how)."""
        if command == "guest-exec":
            argv = [str(arguments["path"]), *(str(a) for a in arguments.get("arg", []))]
            if (reason := mountns.unavailable()) is not None:
                raise AgentError(f"Failed to execute child process: {reason}")
            pid = next(self._ids)
            stdin = base64.b64decode(str(arguments.get("input-data", "")))
            self.processes[pid] = Process(asyncio.create_task(self._run(vm, argv, stdin)))
            self.executed.append(argv)
            return {"pid": pid}
        if command == "guest-exec-status":
            process = self.processes.get(int(arguments["pid"]))
            if process is None:
                raise AgentError("Invalid parameter 'pid'")
            if not process.task.done():
                return {"exited": False}
            del self.processes[int(arguments["pid"])]  # qemu-ga forgets it once told
            return process.task.result()
        return self.run(vm, command, arguments)

    async def _run(self, vm: VM, argv: list[str], stdin: bytes) -> dict[str, Any]:
        before = vm.files.get(SYSTEMCTL_LOG, b"")
        answer = await run_in_guest(vm, argv, stdin, self.units)
        calls = vm.files.get(SYSTEMCTL_LOG, b"").removeprefix(before).decode()
        if self.on_reload is not None and re.search(r"(?m)reload.* sshd?(\.service)?$", calls):
            await self.on_reload(vm)
        return answer

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
        raise AgentError(f"The command {command} has not been found")

    def _handle(self, arguments: dict[str, Any]) -> OpenFile:
        opened = self.handles.get(int(arguments["handle"]))
        if opened is None:
            raise AgentError(f"handle '{arguments['handle']}' has not been found")
        return opened


async def run_in_guest(
    vm: VM, argv: list[str], stdin: bytes, units: tuple[str, ...] = SSH_UNITS
) -> dict[str, Any]:
    """Run `argv` confined to the guest's folders (see the module doc), with systemd
    knowing `units`; what
    guest-exec-status answers once it ended (its output base64, as qemu-ga sends it).
    The guest's files under those folders are what the command left there."""
    with tempfile.TemporaryDirectory(prefix="fakepve-guest-") as folder:
        root = Path(folder)
        binds = {where: _materialize(vm, root, where) for where in GUEST_FOLDERS}
        (root / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)  # as openssh-server ships it
        tools = root / "guest-bin"  # first on PATH: the guest's systemctl and sshd
        tools.mkdir()
        for name, text in (("systemctl", SYSTEMCTL.format(units=" ".join(units))), ("sshd", SSHD)):
            (tools / name).write_text(text)
            (tools / name).chmod(0o755)
        env = {"PATH": f"{tools}:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
        process = await asyncio.create_subprocess_exec(
            *mountns.confined(binds, argv),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await process.communicate(stdin)
        for where in GUEST_FOLDERS:
            _read_back(vm, root, where)
    answer: dict[str, Any] = {"exited": True, "exitcode": process.returncode}
    for stream, data in (("out-data", out), ("err-data", err)):
        if data:
            answer[stream] = base64.b64encode(data).decode()
    return answer


def _materialize(vm: VM, root: Path, where: str) -> Path:
    """The guest's files under `where`, written below `root`; that folder."""
    into = root / where.strip("/")
    into.mkdir(parents=True)
    for path, data in vm.files.items():
        if path.startswith(where + "/"):
            target = into / path.removeprefix(where + "/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return into


def _read_back(vm: VM, root: Path, where: str) -> None:
    folder = root / where.strip("/")
    for path in [p for p in vm.files if p.startswith(where + "/")]:
        del vm.files[path]
    for found in sorted(folder.rglob("*")):
        if found.is_file():
            vm.files[f"{where}/{found.relative_to(folder)}"] = found.read_bytes()
    shutil.rmtree(folder, ignore_errors=True)
