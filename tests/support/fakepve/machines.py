"""What the fake's VMs are underneath: the hook the endpoints call for a VM's disk, its
power and its guest agent, and the default one, which simulates the guests.

`Simulated` (the default): a clone has no disk; a started guest's agent answers
`Timings.agent_after_s` later with the interfaces a booted cloud image would report
(`guest.interfaces`), and its sshd (`guest.Guest`) listens from `sshd_after_s`.
`realvm.RealMachines` boots real guests under QEMU instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tests.support.fakepve import guest, guestfiles
from tests.support.fakepve.errors import ApiError

if TYPE_CHECKING:
    from tests.support.fakepve.cluster import VM, Cluster

Endpoint = tuple[str, int]


class Machines(Protocol):
    """Called from the tasks (after their checks and duration; a `TaskError` fails the
    task) and from the agent endpoints (an `ApiError` is the HTTP answer)."""

    # Its SSH endpoints may accept a connection before the guest's sshd listens (QEMU's
    # port forwards do): the jump host then waits for the SSH banner before forwarding.
    accepts_early: bool

    async def cloned(self, source: VM, clone: VM, *, full: bool) -> None:
        """The clone task's end: give `clone` its disk, a linked or a full copy."""

    async def imported(self, vm: VM, disk: str, source: Path) -> None:
        """The create task's end: `vm`'s drive `disk` is a copy of the file `source`
        (`import-from`)."""

    async def started(self, vm: VM) -> None:
        """The start task's end: power the VM on (sets `vm.running`)."""

    async def halted(self, vm: VM, *, graceful: bool, timeout_s: float, force: bool) -> None:
        """A stop (`graceful` False: at once) or shutdown task's end: power it off."""

    async def destroyed(self, vm: VM) -> None:
        """The destroy task removed `vm`: remove its disks."""

    async def agent(self, vm: VM, command: str) -> Any:
        """The `return` of a guest-agent command of a running VM with the agent enabled."""

    async def qga(self, vm: VM, command: str, arguments: dict[str, Any]) -> Any:
        """The `return` of a guest-agent command with arguments (guest-file-open, ...);
        `guestfiles.AgentError` with the agent's `error` text when it refuses, ApiError
        500 "QEMU guest agent is not running" when it does not answer."""

    def route(self, host: str, port: int) -> Endpoint | None:
        """For the jump host: the loopback endpoint of the guest's `host:port`."""

    async def close(self) -> None:
        """Power everything off (the fake is closing)."""


class Simulated:
    accepts_early = False

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.agents: dict[int, guestfiles.SimulatedAgent] = {}  # vmid -> its agent's state

    async def cloned(self, source: VM, clone: VM, *, full: bool) -> None:
        return None

    async def imported(self, vm: VM, disk: str, source: Path) -> None:
        return None

    async def started(self, vm: VM) -> None:
        vm.running = True
        guestfiles.ensure_host_keys(vm)  # cloud-init's first boot (kept on the disk)
        vm.started_at = asyncio.get_running_loop().time()
        vm.boot = asyncio.create_task(self._boot(vm))

    async def _boot(self, vm: VM) -> None:
        """The guest agent answers some time after start; sshd comes up with it."""
        t = self.cluster.timings
        sshd_s = t.agent_after_s if t.sshd_after_s is None else t.sshd_after_s
        for delay, what in sorted([(t.agent_after_s, "agent"), (sshd_s, "sshd")]):
            await asyncio.sleep(
                max(0.0, delay - (asyncio.get_running_loop().time() - (vm.started_at or 0)))
            )
            if what == "agent":
                vm.agent_up = vm.agent_installed
            else:
                await self._sshd(vm)

    async def _sshd(self, vm: VM) -> None:
        key, certificates = guestfiles.sshd_key(vm), guestfiles.host_certificates(vm)
        await self.cluster.guest.boot(vm.vmid, vm.config, key, certificates)

    async def _reload(self, vm: VM) -> None:
        """sshd reloaded in the guest: it reads its config and certificates again."""
        if self.cluster.guest.listening(vm.vmid):
            await self.cluster.guest.shutdown(vm.vmid)
            await self._sshd(vm)

    async def halted(self, vm: VM, *, graceful: bool, timeout_s: float, force: bool) -> None:
        vm.running = False
        vm.agent_up = False
        self.agents.pop(vm.vmid, None)  # the agent restarts with the guest
        vm.started_at = None
        if vm.boot is not None:
            vm.boot.cancel()
        await self.cluster.guest.shutdown(vm.vmid)

    async def destroyed(self, vm: VM) -> None:
        return None

    async def agent(self, vm: VM, command: str) -> Any:
        if not vm.agent_up:
            raise ApiError(500, "QEMU guest agent is not running")
        if command == "guest-ping":
            return {}
        return guest.interfaces(vm.config, vm.vmid, vm.leases)

    async def qga(self, vm: VM, command: str, arguments: dict[str, Any]) -> Any:
        if not vm.agent_up:
            raise ApiError(500, "QEMU guest agent is not running")
        guestfiles.ensure_host_keys(vm)  # a VM added as running (`add_vm`) booted before
        return await self.guest_agent(vm.vmid).ask(vm, command, arguments)

    def guest_agent(self, vmid: int) -> guestfiles.SimulatedAgent:
        """The state of VM `vmid`'s guest agent (a test may change its guest's units)."""
        return self.agents.setdefault(vmid, guestfiles.SimulatedAgent(on_reload=self._reload))

    def route(self, host: str, port: int) -> Endpoint | None:
        return self.cluster.guest.route(host, port)

    async def close(self) -> None:
        for vm in self.cluster.vms.values():
            if vm.boot is not None:
                vm.boot.cancel()
        await self.cluster.guest.close()
