"""Run one real guest under QEMU: overlay disk, NoCloud seed, user-mode network, guest agent.

Each guest boots the image's own kernel and initrd directly from a qcow2 overlay of the
image (a linked clone: its writes stay in the overlay), with the NoCloud seed as a
read-only virtio disk, or with no seed and its data on the kernel command line
(`append`: the vSphere test's guestinfo as `systemd.setenv=` variables). Its NIC is on
QEMU's user-mode network with `restrict=on`, so nothing the guest sends leaves QEMU;
the guest's SSH port is forwarded from a port on 127.0.0.1. More NICs (`more_nics`)
each get a restricted user-mode network of their own. The serial console is
written to a file (what went wrong at boot is there) and qemu-guest-agent is reachable
on a unix socket (`Guest.qga`).

KVM is used only where it really runs a Debian kernel (`accelerator`): the machines
here expose a nested /dev/kvm that cannot, and QEMU does not fall back by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QEMU = "qemu-system-x86_64"
TCG = ["-accel", "tcg,tb-size=256"]
KVM = ["-accel", "kvm"]
PROBE_SECONDS = 20.0
# The kernel command line every guest boots with; `Guest.append` comes after it.
# no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer test can time out
# and panic ("IO-APIC + timer doesn't work!", seen in CI with four guests on 2 cores);
# the check is for real hardware, and virtual machines are commonly booted without it.
BASE_CMDLINE = "root=/dev/vda rw console=ttyS0 panic=-1 no_timer_check"


def missing_tools() -> list[str]:
    tools = (QEMU, "qemu-img", "genisoimage")
    return [tool for tool in tools if shutil.which(tool) is None]


def kernel_args(image: Path, append: str) -> list[str]:
    return [
        "-kernel",
        str(image / "vmlinuz"),
        "-initrd",
        str(image / "initrd.img"),
        "-append",
        append,
    ]


_accel: list[str] | None = None


def accelerator(image: Path, workdir: Path) -> list[str]:
    """KVM when the guest's kernel gets as far as printing its banner under it, else TCG.

    Probed once per process. DEPLOYBOT_QEMU_ACCEL=tcg|kvm skips the probe.
    """
    global _accel
    forced = os.environ.get("DEPLOYBOT_QEMU_ACCEL")
    if forced:
        return KVM if forced == "kvm" else TCG
    if _accel is not None:
        return _accel
    _accel = TCG
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return _accel
    log = workdir / "kvm-probe.log"
    log.unlink(missing_ok=True)
    argv = [QEMU, *KVM, "-nodefaults", "-no-user-config", "-display", "none", "-m", "256"]
    argv += [*kernel_args(image, "console=ttyS0 panic=-1"), "-serial", f"file:{log}"]
    probe = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + PROBE_SECONDS
        while time.monotonic() < deadline and probe.poll() is None:
            if log.exists() and b"Linux version" in log.read_bytes():
                _accel = KVM
                break
            # Polling a file QEMU writes: nothing to wait on but the clock.
            time.sleep(0.2)
    finally:
        probe.kill()
        probe.wait(timeout=10)
    return _accel


def cmdline_size(image: Path) -> int:
    """The longest kernel command line the image's kernel takes, in bytes without the
    final NUL: `cmdline_size` of its x86 boot header (boot protocol >= 2.06), which is
    COMMAND_LINE_SIZE - 1 (2047 for Debian 12's kernel). QEMU refuses a longer one."""
    header = (image / "vmlinuz").read_bytes()[:0x23C]
    if header[0x202:0x206] != b"HdrS" or int.from_bytes(header[0x206:0x208], "little") < 0x206:
        raise ValueError(f"{image / 'vmlinuz'}: no x86 boot header of protocol >= 2.06")
    return int.from_bytes(header[0x238:0x23C], "little")


def free_port() -> int:
    """A port free on 127.0.0.1 now (QEMU fails to start should another take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class MoreNic:
    """A NIC after the first, on a restricted user-mode network of its own: `network`,
    where QEMU answers as `host` (the guest's gateway there, if it has one)."""

    mac: str
    network: str
    host: str

    def args(self, index: int) -> list[str]:
        net = ipaddress.IPv4Network(self.network)
        netdev = f"user,id=n{index},restrict=on,ipv6=off,net={net},host={self.host}"
        return ["-netdev", netdev, "-device", f"virtio-net-pci,netdev=n{index},mac={self.mac}"]


class QgaError(RuntimeError):
    """The guest agent's `error` answer; `desc` is its text."""

    def __init__(self, command: str, error: Any) -> None:
        super().__init__(f"qga {command}: {error}")
        self.desc = str(error.get("desc", error) if isinstance(error, dict) else error)


@dataclass
class Guest:
    """One guest. `address` lives in QEMU's user-mode network `network`, where QEMU
    answers as the `gateway` and as the resolver on `dns` (restricted: it resolves and
    forwards nothing outside). The qga socket's path must stay under 108 bytes."""

    image: Path  # the folder image.build() made
    workdir: Path  # overlay, serial log and sockets go here
    seed: Path | None  # the NoCloud ISO; None: no seed disk
    mac: str
    address: str
    network: str = "10.0.0.0/24"
    gateway: str = "10.0.0.1"
    dns: str = "10.0.0.3"
    memory_mib: int = 1024
    cpus: int = 2
    # More kernel command line after the root and console settings (the vSphere test's
    # guestinfo; `systemd.mask=UNIT` for a fault).
    append: str = ""
    more_nics: tuple[MoreNic, ...] = ()  # net1, net2, ...: each on a network of its own
    ssh_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    accel_args: list[str] = field(default_factory=list)

    @property
    def serial_log(self) -> Path:
        return self.workdir / "serial.log"

    @property
    def qga_socket(self) -> Path:
        return self.workdir / "qga.sock"

    @property
    def overlay(self) -> Path:
        return self.workdir / "disk.qcow2"

    @property
    def cmdline(self) -> str:
        return " ".join(filter(None, [BASE_CMDLINE, self.append]))

    def argv(self, accel: list[str]) -> list[str]:
        net = ipaddress.IPv4Network(self.network)
        seed = (
            []
            if self.seed is None
            else ["-drive", f"file={self.seed},if=virtio,format=raw,readonly=on"]
        )
        netdev = (
            f"user,id=n0,restrict=on,ipv6=off,net={net},host={self.gateway},"
            f"dns={self.dns},hostfwd=tcp:127.0.0.1:{self.ssh_port}-{self.address}:22"
        )
        qga = f"socket,id=qga0,path={self.qga_socket},server=on,wait=off"
        return [
            QEMU,
            *accel,
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-smp",
            str(self.cpus),
            "-m",
            str(self.memory_mib),
            *kernel_args(self.image, self.cmdline),
            "-drive",
            f"file={self.overlay},if=virtio,format=qcow2",
            *seed,
            "-netdev",
            netdev,
            "-device",
            f"virtio-net-pci,netdev=n0,mac={self.mac}",
            *(arg for i, nic in enumerate(self.more_nics, 1) for arg in nic.args(i)),
            "-device",
            "virtio-serial",
            "-chardev",
            qga,
            "-device",
            "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
            "-serial",
            f"file:{self.serial_log}",
            "-no-reboot",
        ]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        disk = self.image / "disk.qcow2"
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(disk), "-F", "qcow2"]
        subprocess.run([*argv, str(self.overlay)], check=True, timeout=30)
        accel = self.accel_args = accelerator(self.image, self.workdir)
        self.started = time.monotonic()
        stderr = (self.workdir / "qemu.stderr").open("wb")
        with stderr:
            self.process = subprocess.Popen(
                self.argv(accel), stdout=subprocess.DEVNULL, stderr=stderr
            )

    @property
    def accel(self) -> str:
        return "kvm" if self.accel_args == KVM else "tcg"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (QEMU exits at once, as on a power cut), SIGKILL if it lingers."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)

    def failure(self) -> str:
        """What to tell when the guest did not get somewhere: QEMU's stderr, serial tail."""
        err = (self.workdir / "qemu.stderr").read_text(errors="replace")
        tail = (
            self.serial_log.read_text(errors="replace")[-3000:] if self.serial_log.exists() else ""
        )
        state = "running" if self.running() else f"exited {self.process and self.process.poll()}"
        return f"QEMU {state}; stderr: {err.strip()!r}\n--- serial (tail) ---\n{tail}"

    async def qga(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        wait: float = 5.0,
        *,
        reply: bool = True,
    ) -> Any:
        """One guest-agent command's `return`, or TimeoutError when no agent answers.
        With `reply` False, None once the agent took it (guest-shutdown never answers).

        The socket holds no framing of its own and a previous client's answer may still
        be in the port, so each call first syncs with a fresh id (guest-sync) and skips
        lines until that id comes back.
        """
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(self.qga_socket)), wait
        )
        try:
            sync = random.randrange(1, 2**31)
            request = {"execute": "guest-sync", "arguments": {"id": sync}}
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            async with asyncio.timeout(wait):
                while json.loads(await reader.readline() or b"{}").get("return") != sync:
                    pass
                message: dict[str, Any] = {"execute": command}
                if arguments is not None:
                    message["arguments"] = arguments
                writer.write(json.dumps(message).encode() + b"\n")
                await writer.drain()
                if not reply:
                    return None
                answer = json.loads(await reader.readline())
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if "error" in answer:
            raise QgaError(command, answer["error"])
        return answer["return"]

    async def wait_qga(self, deadline: float) -> float:
        """Seconds from start until the guest agent answers guest-ping."""
        while True:
            if not self.running():
                raise RuntimeError(f"guest stopped before its agent answered: {self.failure()}")
            try:
                await self.qga("guest-ping", wait=3.0)
                return time.monotonic() - self.started
            except (TimeoutError, OSError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no guest agent: {self.failure()}") from None
            await asyncio.sleep(1.0)  # between polls of a condition bound by `deadline`
