"""What the simulator's guests report: their addresses (the guest agent's view and the
conflict check's), their SSH port and host keys."""

from __future__ import annotations

import ipaddress

import asyncssh

from backends.base import (
    AddressUse,
    PermanentError,
    RetryableError,
    VMRef,
)
from backends.config import SshJump
from backends.guestaddr import listable, pick_address
from backends.sim.inventory import Inventory
from backends.sim.tasks import Tasks
from backends.sim.vm import Effect, SimTiming, SimVM
from backends.sshcheck import SshCheck, new_host_key


class Guests:
    """The guests of the VMs in `inventory`, answering through `tasks`."""

    def __init__(
        self, inventory: Inventory, tasks: Tasks, timing: SimTiming, ssh_jump: SshJump | None
    ) -> None:
        self._inventory = inventory
        self._tasks = tasks
        self._timing = timing
        self._ssh = SshCheck(ssh_jump)  # for the guests the check really connects to

    async def addresses_in_use(self, ours: str | None = None) -> list[AddressUse]:
        """The identity address of each of deploybot's VMs and the address of each VM
        built by hand, running or not (the simulator has no templates among its VMs)."""
        self._tasks.answer()
        await self._tasks.query_fault("addresses_in_use")
        found: dict[tuple[str, ipaddress.IPv4Address], AddressUse] = {}
        for vm in self._inventory.vms.values():
            seen = [(vm.address, "configured")]
            if vm.identity is not None:
                seen.insert(0, (vm.identity.address.ip, "identity"))
                more = vm.identity.more_nics
                seen[1:1] = [(n.address.ip, f"identity, NIC {i}") for i, n in enumerate(more, 2)]
            for ip, source in seen:
                if ip is not None and listable(ip):
                    found.setdefault((vm.vm_id, ip), AddressUse(ip, vm.vm_id, vm.name, source))
        return list(found.values())

    def _interfaces(self, vm: SimVM) -> list[tuple[str, str]]:
        interfaces = [("lo", "127.0.0.1"), ("ens18", "fe80::be24:11ff:fe4c:1a2b")]
        if vm.identity is not None:
            interfaces.append(("ens18", str(vm.identity.address.ip)))
            more = vm.identity.more_nics
            interfaces += [(f"ens{19 + i}", str(n.address.ip)) for i, n in enumerate(more)]
        interfaces.append(("docker0", "172.17.0.1"))
        return interfaces

    async def wait_for_address(
        self, ref: VMRef, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        self._tasks.answer()
        vm = self._inventory.vm(ref, change=False)
        await self._tasks.query_fault("wait_for_address", vm.vm_id)
        with self._tasks.watching(vm.booted, vm.stopped) as changed:
            while True:
                self._tasks.answer()
                if not vm.running:
                    raise PermanentError(f"VM {vm.vm_id} is not running", vm_id=vm.vm_id)
                if vm.booted.is_set():
                    address = pick_address(self._interfaces(vm), expected)
                    if address is not None:
                        return address
                await changed.until(self._timing.poll_s)

    async def probe_ssh(self, ref: VMRef, address: ipaddress.IPv4Address, port: int) -> str | None:
        self._tasks.answer()
        vm = self._inventory.vm(ref, change=False)
        fault = await self._tasks.query_fault("probe_ssh", vm.vm_id)
        if address.is_loopback:
            return await self._ssh.probe(address, port)
        if fault == "impostor":  # another host answers on the address, with its own key
            return new_host_key().public
        if not (vm.running and vm.booted.is_set()):
            raise RetryableError(f"{address}:{port} does not answer yet")
        await self._tasks.sleep(self._timing.sshd_s)
        return vm.host_key

    async def host_keys(self, ref: VMRef) -> list[str]:
        """The guest's public host keys, as the simulator's guest agent reads them (not
        through the network). A guest on 127.0.0.0/8 is a real listener a test started,
        outside the simulator: its agent sees no key files there ([])."""
        self._tasks.answer()
        vm = self._inventory.vm(ref, change=False)
        fault = await self._tasks.query_fault("host_keys", vm.vm_id)
        if not (vm.running and vm.booted.is_set()):
            raise RetryableError(
                f"the simulator's guest agent in VM {vm.vm_id} does not answer yet"
            )
        address = vm.identity.address.ip if vm.identity is not None else vm.address
        if address is not None and address.is_loopback:
            return []
        if fault == "rekeyed":  # read before the guest replaced its keys (cloud-init)
            return [new_host_key().public]
        return [vm.host_key] if vm.host_key else []

    async def install_host_certificate(self, ref: VMRef, certificate: str) -> str | None:
        """Write the certificate next to its key and reload sshd, as the guest agent's
        file-write and exec do: the guest's sshd presents it from then on. A certificate
        of another key is refused, as the real install's check refuses it."""
        self._tasks.answer()
        vm = self._inventory.vm(ref)
        if not (vm.running and vm.booted.is_set()):
            raise RetryableError(
                f"the simulator's guest agent in VM {vm.vm_id} does not answer yet"
            )
        if not _certifies(certificate, vm.host_key):
            raise PermanentError(
                f"the certificate is not of VM {vm.vm_id}'s host key", vm_id=vm.vm_id
            )

        def install() -> None:
            vm.host_certificate = certificate

        fault = self._tasks.fault("install_host_certificate", vm.vm_id)
        effect = Effect(vm, self._inventory.vms, install)
        seconds = self._timing.config_s
        await self._tasks.run("install_host_certificate", vm.vm_id, seconds, effect, fault)
        return f"/etc/ssh/ssh_host_{_key_type(certificate)}_key-cert.pub, sshd reloaded"

    async def close(self) -> None:
        await self._ssh.close()


def _certifies(certificate: str, host_key: str | None) -> bool:
    """Whether the certificate line is of the public key line `host_key`."""
    try:
        cert = asyncssh.import_certificate(certificate)
    except (asyncssh.KeyImportError, ValueError):
        return False
    algorithm, blob = cert.key.export_public_key("openssh").decode().split()[:2]
    return host_key is not None and host_key.split()[:2] == [algorithm, blob]


def _key_type(certificate: str) -> str:
    """The key file's type from the certificate's algorithm ("ssh-ed25519-cert-v01@...")."""
    algorithm = certificate.split(maxsplit=1)[0].split("-cert-", 1)[0]
    return {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(algorithm, "ecdsa")
