"""What the simulator's guests report: their addresses (the guest agent's view and the
conflict check's) and their SSH port (split from backends/sim.py)."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING

from backends.base import AddressUse, PermanentError, RetryableError, VMRef
from backends.guestaddr import listable, pick_address
from backends.simvm import SimTiming, SimVM, fake_fingerprint
from backends.sshcheck import SshCheck


class SimGuests:
    """Mixed into `SimBackend`: the attributes below are the simulator's."""

    vms: dict[str, SimVM]
    timing: SimTiming
    _ssh: SshCheck

    if TYPE_CHECKING:  # provided by SimBackend and SimTasks

        def _answer(self) -> None: ...
        def _vm(self, ref: VMRef, *, change: bool = True) -> SimVM: ...
        async def _query_fault(self, op: str, vm_id: str = "") -> None: ...
        async def _sleep(self, seconds: float) -> None: ...
        async def _either(
            self, first: asyncio.Event, second: asyncio.Event, seconds: float
        ) -> None: ...

    async def addresses_in_use(self, ours: str | None = None) -> list[AddressUse]:
        """The identity address of each of deploybot's VMs and the address of each VM
        built by hand, running or not (the simulator has no templates among its VMs)."""
        self._answer()
        await self._query_fault("addresses_in_use")
        found: dict[tuple[str, ipaddress.IPv4Address], AddressUse] = {}
        for vm in self.vms.values():
            seen = [(vm.address, "configured")]
            if vm.identity is not None:
                seen.insert(0, (vm.identity.address.ip, "identity"))
            for ip, source in seen:
                if ip is not None and listable(ip):
                    found.setdefault((vm.vm_id, ip), AddressUse(ip, vm.vm_id, vm.name, source))
        return list(found.values())

    def _guest_interfaces(self, vm: SimVM) -> list[tuple[str, str]]:
        interfaces = [("lo", "127.0.0.1"), ("ens18", "fe80::be24:11ff:fe4c:1a2b")]
        if vm.identity is not None:
            interfaces.append(("ens18", str(vm.identity.address.ip)))
        interfaces.append(("docker0", "172.17.0.1"))
        return interfaces

    async def wait_for_address(
        self, ref: VMRef, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        self._answer()
        vm = self._vm(ref, change=False)
        await self._query_fault("wait_for_address", vm.vm_id)
        while True:
            self._answer()
            if not vm.running:
                raise PermanentError(f"VM {vm.vm_id} is not running", vm_id=vm.vm_id)
            if vm.booted.is_set():
                address = pick_address(self._guest_interfaces(vm), expected)
                if address is not None:
                    return address
            await self._either(vm.booted, vm.stopped, self.timing.poll_s)

    async def probe_ssh(self, ref: VMRef, address: ipaddress.IPv4Address, port: int) -> str | None:
        self._answer()
        vm = self._vm(ref, change=False)
        await self._query_fault("probe_ssh", vm.vm_id)
        if address.is_loopback:
            return await self._ssh.probe(address, port)
        if not (vm.running and vm.booted.is_set()):
            raise RetryableError(f"{address}:{port} does not answer yet")
        await self._sleep(self.timing.sshd_s)
        return fake_fingerprint(vm.vm_id)
