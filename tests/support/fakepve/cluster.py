"""The state of the fake Proxmox cluster: nodes, storages, VMs, tasks and faults.

Tasks run as asyncio tasks on the server's loop, take their configured time, hold the
VM's file lock (another task waiting too long fails `can't lock file ... got timeout`)
and end `OK` or with the error text, exactly as the task status endpoint reports them.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tests.support.fakepve.errors import ApiError, TaskError
from tests.support.fakepve.guest import Guest
from tests.support.fakepve.machines import Machines, Simulated

FaultKind = Literal[
    "error", "task_error", "task_warnings", "lock_timeout", "task_lock_timeout", "delay", "race"
]
GIB = 1024**3


TASK_FAULTS: tuple[FaultKind, ...] = ("task_error", "task_warnings", "task_lock_timeout")


@dataclass
class Timings:
    """Seconds each task takes; the guest agent and sshd answer some time after start."""

    clone_s: float = 2.0
    clone_full_s: float = 6.0
    config_s: float = 0.2
    resize_s: float = 0.3
    start_s: float = 1.0
    stop_s: float = 0.5
    destroy_s: float = 0.3
    agent_after_s: float = 3.0
    sshd_after_s: float | None = None  # None: together with the agent
    lock_wait_s: float = 10.0  # how long a task waits for a VM's file lock


@dataclass
class Fault:
    endpoint: str
    kind: FaultKind
    times: int = 1
    message: str | None = None
    status: int = 500
    delay_s: float = 0.0
    errors: dict[str, str] | None = None  # with status 400: the per-parameter messages
    # Instead of `times`: every call for this long, from the first one it answered
    # ("the task list answers 500 for 6 s"; with status 595: the node out of reach).
    for_s: float | None = None
    first_s: float | None = None  # loop time of that first call

    def applies(self) -> bool:
        """Whether it answers this call (and counts it)."""
        if self.times <= 0:
            return False
        if self.for_s is None:
            self.times -= 1
            return True
        now = asyncio.get_running_loop().time()
        self.first_s = now if self.first_s is None else self.first_s
        if now - self.first_s < self.for_s:
            return True
        self.times = 0  # over
        return False


@dataclass
class Node:
    name: str
    cpu_model: str
    flags: frozenset[str] | None  # None: status without `flags`, as the schema allows
    bridges: tuple[str, ...] = ("vmbr0", "vmbr1")
    # Those with `bridge_vlan_aware` (and their `bridge_vids`, as the PVE installer's
    # VLAN-aware bridge has them): a NIC may carry a VLAN tag only there.
    vlan_aware: dict[str, str] = field(default_factory=lambda: {"vmbr0": "2-4094"})


@dataclass
class StorageDef:
    name: str
    type: str
    shared: bool = False
    total_bytes: int = 512 * GIB
    used_bytes: int = 100 * GIB
    content: str = "images,rootdir"


@dataclass
class VM:
    vmid: int
    node: str
    config: dict[str, str]
    running: bool = False
    agent_installed: bool = True
    ha_managed: bool = False
    agent_up: bool = False
    # Addresses the guest has besides its ipconfig0 one (a DHCP lease, one set by hand
    # inside it): only its agent reports them.
    leases: tuple[str, ...] = ()
    # The simulated guest's files its agent reads and writes (`guestfiles`): the SSH
    # host keys cloud-init generates at first boot, and whatever was written.
    files: dict[str, bytes] = field(default_factory=dict)
    started_at: float | None = None
    boot: asyncio.Task[None] | None = None

    @property
    def template(self) -> bool:
        return self.config.get("template") == "1"

    def digest(self) -> str:
        text = "\n".join(f"{k}: {v}" for k, v in sorted(self.config.items()))
        return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class Task:
    upid: str
    node: str
    type: str
    id: str
    user: str
    pid: int
    pstart: int
    starttime: int
    began_s: float
    ended_s: float | None = None
    exitstatus: str | None = None
    log: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    vmid: int | None = None  # the VM whose file lock it holds (a clone: the new VM)

    def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "upid": self.upid,
            "node": self.node,
            "pid": self.pid,
            "pstart": self.pstart,
            "starttime": self.starttime,
            "type": self.type,
            "id": self.id,
            "user": self.user,
            "status": "running" if self.exitstatus is None else "stopped",
        }
        if self.exitstatus is not None:
            answer["exitstatus"] = self.exitstatus
        return answer


_V2 = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
_V2 += "sse sse2 ht syscall nx lm constant_tsc rep_good nopl pni pclmulqdq ssse3 cx16 sse4_1 "
_V2 += "sse4_2 popcnt aes xsave avx lahf_lm"
_V3 = _V2 + " avx2 bmi1 bmi2 f16c fma abm movbe"


class Cluster:
    def __init__(
        self,
        *,
        timings: Timings | None = None,
        release: str = "8.2",
        cluster_name: str | None = "lab",
        guest: Guest | None = None,
        machines: Machines | None = None,
    ) -> None:
        self.timings = timings or Timings()
        self.release = release
        self.cluster_name = cluster_name
        self.guest = guest or Guest(None)  # the simulated guests' sshds
        # What the VMs are: simulated (default) or real guests under QEMU (`realvm`).
        self.machines: Machines = machines or Simulated(self)
        self.nodes: dict[str, Node] = {}
        self.storages: dict[str, StorageDef] = {}
        self.vms: dict[int, VM] = {}
        self.tasks: dict[str, Task] = {}
        self.unlisted: set[str] = set()  # running tasks `GET /nodes/{node}/tasks` omits
        # VMs the API user may not see (a token limited to a pool): left out of
        # /cluster/resources, 403 on their paths; `nextid` still knows them.
        self.hidden: set[int] = set()
        # Nodes that are down: 595 on their paths; their VMs listed with status unknown.
        self.offline: set[str] = set()
        self.faults: list[Fault] = []
        self._pids = itertools.count(random.randint(0x1000, 0xFFFF))
        self._locks: dict[int, asyncio.Lock] = {}
        self._running: set[asyncio.Task[None]] = set()
        self._macs = itertools.count(0x100)
        # Uploaded files (`<storage>:import/<name>`, `<storage>:iso/<name>`) -> where they
        # are, under `state_dir` (FakePVE's, else a temporary folder of its own).
        self.volumes: dict[str, Path] = {}
        self.state_dir: Path | None = None
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None

    def files(self) -> Path:
        """The folder the fake keeps uploaded files in."""
        if self.state_dir is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="fakepve-files-")
            self.state_dir = Path(self._own_dir.name)
        return self.state_dir

    @property
    def release_tuple(self) -> tuple[int, int]:
        major, minor = self.release.split(".")[:2]
        return int(major), int(minor)

    # --- scenery ----------------------------------------------------------------------

    @classmethod
    def standard(cls, **kwargs: Any) -> Cluster:
        """Two nodes (pve2 without avx2), four storages, six templates, one foreign VM."""
        cluster = cls(**kwargs)
        cluster.nodes = {
            "pve1": Node("pve1", "AMD EPYC 7302P 16-Core Processor", frozenset(_V3.split())),
            "pve2": Node(
                "pve2", "Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz", frozenset(_V2.split())
            ),
        }
        for storage in (
            StorageDef("local-lvm", "lvmthin", total_bytes=900 * GIB, used_bytes=300 * GIB),
            StorageDef("thick-lvm", "lvm", total_bytes=400 * GIB, used_bytes=50 * GIB),
            StorageDef(
                "bulk-nfs", "nfs", shared=True, total_bytes=4096 * GIB, used_bytes=1200 * GIB
            ),
            StorageDef("local", "dir", content="iso,vztmpl,backup"),
        ):
            cluster.storages[storage.name] = storage
        cluster.add_template(9000, "ubuntu-24.04")
        cluster.add_template(9001, "debian-12", size="3G")
        cluster.add_template(9002, "rocky-9", tags="os-el9", size="10G")
        cluster.add_template(9003, "rocky-10", size="10G")
        cluster.add_template(9004, "ubuntu-thick", storage="thick-lvm")
        cluster.add_template(9005, "bare-ubuntu", agent=False)
        cluster.add_vm(100, "web-template", running=True)  # a name is not a template flag
        return cluster

    def add_template(
        self,
        vmid: int,
        name: str,
        *,
        node: str = "pve1",
        storage: str = "local-lvm",
        size: str = "4G",
        tags: str | None = None,
        agent: bool = True,
    ) -> VM:
        config = {
            "name": name,
            "template": "1",
            "boot": "order=scsi0",
            "scsi0": f"{storage}:base-{vmid}-disk-0,size={size}",
            "ide2": f"{storage}:vm-{vmid}-cloudinit,media=cdrom",
            "scsihw": "virtio-scsi-single",
            "net0": f"virtio={self._mac()},bridge=vmbr0",
            "ostype": "l26",
            "cores": "1",
            "memory": "1024",
            "serial0": "socket",
            "vga": "serial0",
        }
        if tags:
            config["tags"] = tags
        vm = VM(vmid, node, config, agent_installed=agent)
        self.vms[vmid] = vm
        return vm

    def add_vm(
        self,
        vmid: int,
        name: str,
        *,
        node: str = "pve1",
        running: bool = False,
        tags: str | None = None,
        ipconfig0: str | None = None,
        agent: bool = False,
        agent_up: bool = False,
        leases: tuple[str, ...] = (),
    ) -> VM:
        """A VM deploybot did not make (or an intruder that won a vmid race): its
        cloud-init `ipconfig0`, `agent: 1` with an agent that answers (`agent_up`, a
        running VM only) or not, and addresses only that agent reports (`leases`)."""
        config = {
            "name": name,
            "scsi0": f"local-lvm:vm-{vmid}-disk-0,size=8G",
            "net0": f"virtio={self._mac()},bridge=vmbr0",
            "cores": "2",
            "memory": "2048",
        }
        if tags:
            config["tags"] = tags
        if ipconfig0:
            config["ipconfig0"] = ipconfig0
        if agent:
            config["agent"] = "1"
        vm = VM(
            vmid,
            node,
            config,
            running=running,
            agent_up=agent_up and running,
            leases=leases,
            started_at=time.monotonic() if running else None,
        )
        self.vms[vmid] = vm
        return vm

    def _mac(self) -> str:
        n = next(self._macs)
        return f"BC:24:11:{(n >> 16) & 0xFF:02X}:{(n >> 8) & 0xFF:02X}:{n & 0xFF:02X}"

    def fresh_mac(self) -> str:
        return self._mac()

    # --- faults -----------------------------------------------------------------------

    def inject(self, endpoint: str, kind: FaultKind, times: int = 1, **options: Any) -> Fault:
        fault = Fault(endpoint, kind, times, **options)
        self.faults.append(fault)
        return fault

    def take(self, endpoint: str, kinds: tuple[FaultKind, ...]) -> Fault | None:
        for fault in self.faults:
            if fault.endpoint == endpoint and fault.kind in kinds and fault.applies():
                return fault
        return None

    # --- lookups ----------------------------------------------------------------------

    def node(self, name: str) -> Node:
        if name not in self.nodes:
            raise ApiError(595, f"no such node '{name}'")
        return self.nodes[name]

    def vm(self, node: str, vmid: int) -> VM:
        if vmid in self.hidden:
            raise ApiError(403, f"Permission check failed (/vms/{vmid}, VM.Audit)")
        vm = self.vms.get(vmid)
        if vm is None or vm.node != node:
            raise ApiError(
                500, f"Configuration file 'nodes/{node}/qemu-server/{vmid}.conf' does not exist"
            )
        return vm

    def task(self, upid: str) -> Task:
        if upid not in self.tasks:
            raise ApiError(500, f"no such task '{upid}'")
        return self.tasks[upid]

    # --- tasks ------------------------------------------------------------------------

    def spawn(
        self,
        node: str,
        kind: str,
        obj: str,
        user: str,
        *,
        lock_vmid: int | None,
        duration_s: float,
        precheck: Callable[[], None] = lambda: None,
        effect: Callable[[], Awaitable[None] | None] = lambda: None,
        on_fail: Callable[[], None] = lambda: None,
        fault: Fault | None = None,
        error_prefix: str = "",
        log: tuple[str, ...] = (),
    ) -> str:
        """Start a task; return its UPID at once, as the API does."""
        loop = asyncio.get_running_loop()
        pid, now = next(self._pids), int(time.time())
        pstart = int(loop.time() * 100) & 0xFFFFFFFF
        upid = f"UPID:{node}:{pid:08X}:{pstart:08X}:{now:08X}:{kind}:{obj}:{user}:"
        task = Task(upid, node, kind, obj, user, pid, pstart, now, loop.time(), vmid=lock_vmid)
        self.tasks[upid] = task

        async def run() -> None:
            try:
                async with self._flock(lock_vmid, error_prefix):
                    precheck()
                    await asyncio.sleep(duration_s)
                    if fault is not None and fault.kind != "task_warnings":
                        raise TaskError(error_prefix + _fault_text(fault, lock_vmid))
                    done = effect()
                    if done is not None:
                        await done
            except TaskError as exc:
                task.log.append(f"TASK ERROR: {exc}")
                task.exitstatus = str(exc)
                on_fail()
            else:
                warned = fault is not None and fault.kind == "task_warnings"
                if fault is not None and warned:  # done, with a warning in the log
                    task.log.append(f"WARN: {fault.message or 'injected warning'}")
                task.log.append("TASK WARNINGS: 1" if warned else "TASK OK")
                task.exitstatus = "WARNINGS: 1" if warned else "OK"
            finally:
                task.ended_s = asyncio.get_running_loop().time()
                task.done.set()

        task.log.extend(log or (f"starting task {kind} {obj}",))
        runner = asyncio.create_task(run())
        self._running.add(runner)
        runner.add_done_callback(self._running.discard)
        return upid

    def _flock(self, vmid: int | None, prefix: str) -> _FileLock:
        lock = self._locks.setdefault(vmid, asyncio.Lock()) if vmid is not None else None
        return _FileLock(lock, vmid, self.timings.lock_wait_s, prefix)

    async def close(self) -> None:
        for runner in list(self._running):
            runner.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await self.machines.close()
        if self._own_dir is not None:
            self._own_dir.cleanup()


class _FileLock:
    """qemu-server's flock on `/var/lock/qemu-server/lock-<vmid>.conf`, with its timeout."""

    def __init__(
        self, lock: asyncio.Lock | None, vmid: int | None, wait_s: float, prefix: str
    ) -> None:
        self._lock, self._vmid, self._wait_s, self._prefix = lock, vmid, wait_s, prefix

    async def __aenter__(self) -> None:
        if self._lock is None:
            return
        try:
            await asyncio.wait_for(self._lock.acquire(), self._wait_s)
        except TimeoutError:
            lock = f"/var/lock/qemu-server/lock-{self._vmid}.conf"
            raise TaskError(f"{self._prefix}can't lock file '{lock}' - got timeout") from None

    async def __aexit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()


def _fault_text(fault: Fault, vmid: int | None) -> str:
    if fault.kind == "task_lock_timeout":
        return (
            fault.message
            or f"can't lock file '/var/lock/qemu-server/lock-{vmid}.conf' - got timeout"
        )
    return fault.message or "injected failure"
