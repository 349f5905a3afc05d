"""Real guests for the fake Proxmox: its VMs' disks, power and guest agent are QEMU's.

`RealMachines` is the fake's `machines.Machines` when a test (or `python -m tests.support.fakepve
--real-guests`) asks for it:

* every template's disk is the guest image (`make guest-image`); a linked clone gets a
  qcow2 overlay of its source's disk, a full clone a copy (`qemu-img convert`);
* start renders the NoCloud seed from the VM's cloud-init fields as Proxmox does
  (`tests/support/realguest/nocloud.py`, instance-id and all) and launches QEMU daemonized, as
  `qm start` does, with the VM's MAC; the task ends once QEMU is up (or fails with its
  error). The guest's static address (ipconfig0) lives in QEMU's user-mode network with
  `restrict=on`, whose host address is the ipconfig0 gateway: nothing leaves QEMU; each
  further `netN` with a static `ipconfigN` is a NIC with its MAC on a restricted
  user-mode network of its own (`more_lans`);
* a VM is running exactly while its QEMU process lives (a pidfd says when it ends);
  stop kills QEMU (SIGTERM, then SIGKILL); shutdown asks the guest agent
  (guest-shutdown) when the VM has it enabled and it answers, else presses the ACPI
  power button (QMP system_powerdown), and waits for QEMU to exit; destroy removes the
  VM's folder (disk, seed, sockets, logs);
* `agent/ping`, `agent/network-get-interfaces` and the agent's file-read, file-write,
  exec and exec-status are answered by the real qemu-guest-agent; until it answers a
  guest-ping within 3 s (qemu-server's check), "QEMU guest agent is not running", as
  Proxmox says;
* `faults` (by VM name) breaks a guest on purpose at its next start: a cloud-init seed
  whose user-data and network-config do not parse (`broken_cloud_init`), or the guest
  agent masked inside the guest (`no_agent`: `systemd.mask=` on the kernel command line,
  as a template without qemu-guest-agent);
* the jump host leads `ADDRESS:22` to the VM's SSH forward on 127.0.0.1 (QEMU accepts
  there before sshd listens, so the jump host waits for the SSH banner: `accepts_early`).

Each VM's files are in `workdir/VMID/`; keep `workdir` short (a unix socket's path must
stay under 108 bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.fakepve.errors import ApiError, TaskError
from tests.support.fakepve.guestfiles import AgentError
from tests.support.fakepve.machines import Endpoint
from tests.support.realguest import nocloud, qemu

if TYPE_CHECKING:
    from tests.support.fakepve.cluster import VM, Cluster
    from tests.support.fakepve.machines import Machines

AGENT_PING_S = 3.0  # qemu-server's qga_check_running: guest-ping with a 3 s timeout
AGENT_COMMAND_S = 10.0
KILL_WAIT_S = 10.0
NOT_RUNNING = "QEMU guest agent is not running"


@dataclass(frozen=True)
class Lan:
    """The guest's place in QEMU's user-mode network: its address, the network, QEMU's
    own address there (the guest's gateway) and QEMU's resolver address."""

    address: str
    network: str
    gateway: str
    dns: str
    static: bool = True  # the address is ipconfig0's (else QEMU's DHCP gives it)


def more_lans(config: dict[str, str]) -> tuple[qemu.MoreNic, ...]:
    """`net1`, `net2`, ... with a static `ipconfigN`, in order: each on a user-mode
    network of its own, QEMU there at `gw` (or, without one, an address of the
    network that is not the guest's: QEMU must have one)."""
    found = []
    for n in range(1, 32):
        net, ip = config.get(f"net{n}"), nocloud.property_string(config.get(f"ipconfig{n}", ""))
        if not net or "/" not in ip.get("ip", ""):
            continue
        address = ipaddress.IPv4Interface(ip["ip"])
        hosts = (str(h) for h in address.network.hosts() if h != address.ip)
        host = ip.get("gw") or next(hosts)
        found.append(qemu.MoreNic(nocloud.mac_of(net), str(address.network), host))
    return tuple(found)


# QEMU's defaults, where a guest without a static address gets its first DHCP lease.
DEFAULT_LAN = Lan("10.0.2.15", "10.0.2.0/24", "10.0.2.2", "10.0.2.3", static=False)


def lan(config: dict[str, str]) -> Lan:
    """From ipconfig0 (`ip=10.0.0.50/24,gw=10.0.0.1`) and `nameserver`: QEMU needs its
    own address and the resolver inside the network, so an address outside it (or the
    guest's own) is replaced by a free one of the network."""
    ip = nocloud.property_string(config.get("ipconfig0", "")).get("ip", "dhcp")
    if ip == "dhcp":
        return DEFAULT_LAN
    guest = ipaddress.IPv4Interface(ip)
    net = guest.network
    spare = (h for h in net.hosts() if h != guest.ip)
    gw = nocloud.property_string(config.get("ipconfig0", "")).get("gw")
    gateway = ipaddress.IPv4Address(gw) if gw else next(spare)
    if gateway not in net or gateway == guest.ip:
        gateway = next(spare)
    taken = {guest.ip, gateway}
    servers = [ipaddress.IPv4Address(s) for s in config.get("nameserver", "").split()]
    usable = [s for s in servers if s in net and s not in taken]
    dns = usable[0] if usable else next(h for h in net.hosts() if h not in taken)
    return Lan(str(guest.ip), str(net), str(gateway), str(dns))


@dataclass(frozen=True)
class GuestFault:
    """What one guest gets wrong on purpose (`RealMachines.faults`)."""

    broken_cloud_init: bool = False  # its seed's user-data and network-config are not YAML
    no_agent: bool = False  # qemu-guest-agent is masked in the guest: it never answers


AGENT_UNIT = "qemu-guest-agent.service"
# A snippet with a tab in its indentation (YAML forbids tabs there), as a hand-written
# cicustom file might have: neither file parses.
_UNPARSABLE = "runcmd:\n\t- [ echo, broken\n"


def broken(seed: nocloud.Seed) -> nocloud.Seed:
    """The seed with user-data and network-config that do not parse; its instance-id
    stays the one Proxmox derived."""
    return dataclasses.replace(
        seed,
        user_data=seed.user_data + _UNPARSABLE,
        network_config=seed.network_config + _UNPARSABLE,
    )


@dataclass
class Machine:
    """One running QEMU: its guest (argv, agent socket, SSH forward), pid and pidfd."""

    guest: qemu.Guest
    pid: int
    pidfd: int
    address: str | None  # the static address its jump-host route answers for
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    agent_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one client at a time


class RealMachines:
    accepts_early = True

    def __init__(
        self,
        image: Path,
        workdir: Path,
        *,
        memory_mib_max: int = 2048,
        cpus_max: int = 2,
        host_dns: nocloud.HostDns | None = None,
    ) -> None:
        self.image = image.resolve()
        self.workdir = workdir.resolve()  # QEMU -daemonize changes to /: absolute paths
        self.memory_mib_max = memory_mib_max  # the VM's `memory`, at most this
        self.cpus_max = cpus_max  # the VM's `cores`, at most this
        # The node's resolv.conf, for VMs without nameserver and searchdomain.
        self.host_dns = host_dns or nocloud.HostDns()
        self.machines: dict[int, Machine] = {}  # running, by vmid
        self.seeds: dict[int, nocloud.Seed] = {}  # each VM's last boot's seed
        self.pids: dict[int, int] = {}  # each VM's last QEMU process
        self.faults: dict[str, GuestFault] = {}  # by VM name, applied at its start
        self.accel = ""  # "kvm" or "tcg", once a guest started
        self._probe = asyncio.Lock()  # one KVM probe, not one per concurrent start

    @classmethod
    def factory(cls, image: Path, workdir: Path, **options: Any) -> Callable[[Cluster], Machines]:
        """For `FakePVE(machines=...)`."""
        return lambda _cluster: cls(image, workdir, **options)

    def folder(self, vmid: int) -> Path:
        return self.workdir / str(vmid)

    def disk(self, vmid: int) -> Path:
        return self.folder(vmid) / "disk.qcow2"  # where qemu.Guest looks for it

    # --- disks ------------------------------------------------------------------------

    async def cloned(self, source: VM, clone: VM, *, full: bool) -> None:
        own = self.disk(source.vmid)
        base = own if own.exists() else self.image / "disk.qcow2"  # a template: the image
        folder = self.folder(clone.vmid)
        if len(str(folder / "qga.sock")) >= 108:
            raise TaskError(f"clone failed: {folder} is too long for QEMU's sockets")
        folder.mkdir(parents=True, exist_ok=True)
        target = str(self.disk(clone.vmid))
        if full:
            argv = ["qemu-img", "convert", "-q", "-O", "qcow2", str(base), target]
        else:
            argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2"]
            argv.append(target)
        try:
            await _run(argv, "clone failed: ")
        except TaskError:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    async def imported(self, vm: VM, disk: str, source: Path) -> None:
        """`import-from`: the VM's disk is a copy of the uploaded file (qcow2, or raw
        from an ISO store), as qemu-server's import converts it."""
        folder = self.folder(vm.vmid)
        folder.mkdir(parents=True, exist_ok=True)
        argv = ["qemu-img", "convert", "-q", "-O", "qcow2", str(source), str(self.disk(vm.vmid))]
        await _run(argv, f"import of {disk} failed: ")

    async def destroyed(self, vm: VM) -> None:
        machine = self.machines.get(vm.vmid)
        if machine is not None:  # never while running (destroy refuses that), but still
            await self._kill(machine)
        shutil.rmtree(self.folder(vm.vmid), ignore_errors=True)

    # --- power ------------------------------------------------------------------------

    async def started(self, vm: VM) -> None:
        if vm.template:
            raise TaskError("you can't start a vm if it's a template")
        folder = self.folder(vm.vmid)
        if not self.disk(vm.vmid).exists():
            raise TaskError(f"VM {vm.vmid} has no disk in {folder}")
        async with self._probe:
            accel = await asyncio.to_thread(qemu.accelerator, self.image, self.workdir)
        self.accel = "kvm" if accel == qemu.KVM else "tcg"
        seed = nocloud.render(vm.config, vm.vmid, self.host_dns)
        fault = self.faults.get(vm.config.get("name", ""), GuestFault())
        if fault.broken_cloud_init:
            seed = broken(seed)
        try:
            iso = await asyncio.to_thread(nocloud.write_iso, seed, folder / "seed.iso")
        except (OSError, subprocess.SubprocessError) as exc:
            raise TaskError(f"start failed: cloud-init drive: {exc}") from exc
        net = lan(vm.config)
        guest = qemu.Guest(
            image=self.image,
            workdir=folder,
            seed=iso,
            mac=nocloud.mac_of(vm.config["net0"]),
            address=net.address,
            network=net.network,
            gateway=net.gateway,
            dns=net.dns,
            memory_mib=min(int(vm.config.get("memory", "1024")), self.memory_mib_max),
            cpus=min(int(vm.config.get("cores", "1")), self.cpus_max),
            append=f"systemd.mask={AGENT_UNIT}" if fault.no_agent else "",
            more_nics=more_lans(vm.config),
        )
        pidfile, stderr = folder / "qemu.pid", folder / "qemu.stderr"
        pidfile.unlink(missing_ok=True)
        argv = [*guest.argv(accel), "-daemonize", "-pidfile", str(pidfile)]
        argv += ["-qmp", f"unix:{folder / 'qmp.sock'},server=on,wait=off"]
        with stderr.open("wb") as err:  # the launcher returns once QEMU is up, or failed
            launcher = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )
            code = await launcher.wait()
        said = stderr.read_text(errors="replace").strip()
        if code != 0:
            raise TaskError(f"start failed: QEMU exited with code {code}: {said}")
        pid = int(pidfile.read_text().strip())
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise TaskError(f"start failed: QEMU ended at once: {said}") from None
        machine = Machine(guest, pid, pidfd, net.address if net.static else None)
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, self._ended, vm, machine)
        self.machines[vm.vmid], self.seeds[vm.vmid], self.pids[vm.vmid] = machine, seed, pid
        vm.running, vm.agent_up, vm.started_at = True, False, loop.time()

    def _ended(self, vm: VM, machine: Machine) -> None:
        """QEMU's process ended (killed, powered off from inside, crashed)."""
        asyncio.get_running_loop().remove_reader(machine.pidfd)
        os.close(machine.pidfd)
        machine.exited.set()
        if self.machines.get(vm.vmid) is machine:
            del self.machines[vm.vmid]
            vm.running, vm.agent_up, vm.started_at = False, False, None

    async def halted(self, vm: VM, *, graceful: bool, timeout_s: float, force: bool) -> None:
        machine = self.machines.get(vm.vmid)
        if machine is None:  # a VM the fake set running without a QEMU
            vm.running, vm.agent_up, vm.started_at = False, False, None
            return
        if graceful:
            await self._power_button(vm, machine)
            try:
                async with asyncio.timeout(timeout_s):
                    await machine.exited.wait()
                return
            except TimeoutError:
                if not force:
                    raise TaskError("VM quit/powerdown failed - got timeout") from None
        await self._kill(machine)

    async def _power_button(self, vm: VM, machine: Machine) -> None:
        """qemu-server's vm_shutdown: guest-shutdown with the agent, else ACPI."""
        if vm.config.get("agent", "0")[:1] == "1":
            async with machine.agent_lock:
                with contextlib.suppress(TimeoutError, OSError, ValueError, RuntimeError):
                    await machine.guest.qga("guest-ping", wait=AGENT_PING_S)
                    await machine.guest.qga("guest-shutdown", wait=AGENT_PING_S, reply=False)
                    return
        with contextlib.suppress(TimeoutError, OSError, ValueError):
            await _qmp(machine.guest.workdir / "qmp.sock", "system_powerdown")

    async def _kill(self, machine: Machine) -> None:
        """As `qm stop` ends a VM that will not quit: SIGTERM, then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if machine.exited.is_set():
                return
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(machine.pidfd, sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KILL_WAIT_S):
                    await machine.exited.wait()
        if not machine.exited.is_set():
            raise TaskError(f"QEMU process {machine.pid} does not end")

    # --- guest agent and SSH ----------------------------------------------------------

    async def agent(self, vm: VM, command: str) -> Any:
        machine = self.machines.get(vm.vmid)
        if machine is None:
            raise ApiError(500, NOT_RUNNING)
        async with machine.agent_lock:
            try:
                await machine.guest.qga("guest-ping", wait=AGENT_PING_S)
            except (TimeoutError, OSError, ValueError, RuntimeError):
                vm.agent_up = False
                raise ApiError(500, NOT_RUNNING) from None
            vm.agent_up = True
            if command == "guest-ping":
                return {}
            try:
                return await machine.guest.qga(command, wait=AGENT_COMMAND_S)
            except (TimeoutError, OSError, ValueError):
                what = "got timeout"
            except RuntimeError as exc:
                what = str(exc)
        raise ApiError(500, f"VM {vm.vmid} qmp command '{command}' failed - {what}")

    async def qga(self, vm: VM, command: str, arguments: dict[str, Any]) -> Any:
        """The real agent's answer; its `error` as `AgentError`, as Proxmox's
        check_agent_error reports it."""
        machine = self.machines.get(vm.vmid)
        if machine is None:
            raise ApiError(500, NOT_RUNNING)
        async with machine.agent_lock:
            try:
                await machine.guest.qga("guest-ping", wait=AGENT_PING_S)
            except (TimeoutError, OSError, ValueError, RuntimeError):
                vm.agent_up = False
                raise ApiError(500, NOT_RUNNING) from None
            vm.agent_up = True
            try:
                return await machine.guest.qga(command, arguments, wait=AGENT_COMMAND_S)
            except qemu.QgaError as exc:
                raise AgentError(exc.desc) from None
            except (TimeoutError, OSError, ValueError):
                raise ApiError(
                    500, f"VM {vm.vmid} qmp command '{command}' failed - got timeout"
                ) from None

    def route(self, host: str, port: int) -> Endpoint | None:
        if port != 22:
            return None
        for machine in self.machines.values():
            if machine.address == host:
                return "127.0.0.1", machine.guest.ssh_port
        return None

    async def close(self) -> None:
        await asyncio.gather(*(self._kill(m) for m in list(self.machines.values())))


async def _run(argv: list[str], failure: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _out, err = await process.communicate()
    if process.returncode != 0:
        raise TaskError(failure + err.decode(errors="replace").strip())


async def _qmp(socket: Path, command: str, timeout_s: float = 5.0) -> None:
    """One QMP command (after the greeting and qmp_capabilities), events skipped."""
    reader, writer = await asyncio.open_unix_connection(str(socket))
    try:
        async with asyncio.timeout(timeout_s):
            await reader.readline()  # {"QMP": {...}}
            for execute in ("qmp_capabilities", command):
                writer.write(json.dumps({"execute": execute}).encode() + b"\n")
                await writer.drain()
                while not {"return", "error"} & json.loads(await reader.readline()).keys():
                    pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
