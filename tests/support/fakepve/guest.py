"""What the fake's guests show the world: the agent's interface list and an sshd.

The sshd is real (asyncssh, with a host key generated at first boot as cloud-init
does), but it only ever listens on a guest address inside 127.0.0.0/8: tests and demos
never send a packet anywhere else.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Sequence
from typing import Any

import asyncssh

log = logging.getLogger(__name__)
_IP = re.compile(r"(?:^|,)ip=([0-9.]+)/(\d+)")


def configured_ip(config: dict[str, str]) -> tuple[ipaddress.IPv4Address, int] | None:
    match = _IP.search(config.get("ipconfig0", ""))
    if not match:
        return None
    return ipaddress.IPv4Address(match.group(1)), int(match.group(2))


def interfaces(
    config: dict[str, str], vmid: int, leases: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """`network-get-interfaces` of a booted cloud image with docker: loopback, the
    container bridge, then the NIC with its link-local IPv6 before its real address
    and any `leases` (`10.0.0.9/24`: addresses it got otherwise, DHCP or by hand)."""
    mac = config.get("net0", "virtio=BC:24:11:00:00:00").split(",")[0].split("=")[-1]
    nic: list[dict[str, Any]] = [
        {
            "ip-address": f"fe80::be24:11ff:fe{vmid % 256:02x}:{vmid % 4096:04x}",
            "ip-address-type": "ipv6",
            "prefix": 64,
        },
    ]
    static = configured_ip(config)
    if static is not None:
        nic.append({"ip-address": str(static[0]), "ip-address-type": "ipv4", "prefix": static[1]})
    for lease in leases:
        address, _, prefix = lease.partition("/")
        nic.append({"ip-address": address, "ip-address-type": "ipv4", "prefix": int(prefix or 24)})
    return [
        {
            "name": "lo",
            "hardware-address": "00:00:00:00:00:00",
            "ip-addresses": [
                {"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128},
            ],
        },
        {
            "name": "docker0",
            "hardware-address": "02:42:5e:11:22:33",
            "ip-addresses": [{"ip-address": "172.17.0.1", "ip-address-type": "ipv4", "prefix": 16}],
        },
        {"name": "eth0", "hardware-address": mac.lower(), "ip-addresses": nic},
    ]


class Guest:
    """Opens and closes the guests' sshd listeners; `ssh_port` None means no sshd.

    A guest on a loopback address listens there, on `ssh_port`. A guest on any other
    address (10.0.0.50) is reachable only through the lab's jump host (`behind_jump`):
    its sshd listens on an ephemeral port of 127.0.0.1, and `route` tells the jump host
    where "10.0.0.50:22" is. Without a jump host such a guest has no sshd at all."""

    def __init__(self, ssh_port: int | None, *, behind_jump: bool = False) -> None:
        self.ssh_port = ssh_port
        self.behind_jump = behind_jump
        self.host_keys: dict[int, str] = {}  # vmid -> SHA256 fingerprint
        self._servers: dict[int, asyncssh.SSHAcceptor] = {}
        self._endpoints: dict[str, tuple[int, tuple[str, int]]] = {}  # address -> vmid, sshd

    async def boot(
        self,
        vmid: int,
        config: dict[str, str],
        key: asyncssh.SSHKey | None = None,
        certificates: Sequence[str] = (),
    ) -> None:
        """Start the guest's sshd, presenting `key` (the guest's host key file; a new
        one when not given) and the `certificates` of it (OpenSSH lines)."""
        static = configured_ip(config)
        if self.ssh_port is None or static is None:
            return
        address = static[0]
        if address.is_loopback:
            listen = (str(address), self.ssh_port)
        elif self.behind_jump:
            listen = ("127.0.0.1", 0)  # where the jump host's route leads
        else:
            return  # never listen outside 127.0.0.0/8
        key = key or asyncssh.generate_private_key("ssh-ed25519")
        # One certificate per key: sshd presents the certificate and the plain key.
        certified = [asyncssh.import_certificate(c) for c in certificates[:1]]
        host_keys: list[Any] = [(key, certified[0])] if certified else [key]
        try:
            server = await asyncssh.create_server(
                asyncssh.SSHServer, *listen, server_host_keys=host_keys
            )
        except OSError as exc:
            log.warning("guest %s: sshd cannot listen on %s:%s: %s", vmid, *listen, exc)
            return
        self._servers[vmid] = server
        self._endpoints[str(address)] = (vmid, server.sockets[0].getsockname()[:2])
        self.host_keys[vmid] = key.get_fingerprint("sha256")

    def route(self, host: str, port: int) -> tuple[str, int] | None:
        """For the jump host: the sshd of the booted guest with this address and port."""
        found = self._endpoints.get(host)
        if found is None or self.ssh_port is None or port not in (22, self.ssh_port):
            return None
        return found[1]

    async def shutdown(self, vmid: int) -> None:
        server = self._servers.pop(vmid, None)
        self._endpoints = {a: e for a, e in self._endpoints.items() if e[0] != vmid}
        if server is not None:
            server.close()
            await server.wait_closed()

    def listening(self, vmid: int) -> bool:
        return vmid in self._servers

    async def close(self) -> None:
        for vmid in list(self._servers):
            await self.shutdown(vmid)
