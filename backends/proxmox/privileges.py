"""The privileges a deploy needs on Proxmox, checked with `GET /access/permissions`
before the first job finds out at its clone step (`deploybot check`).

The table follows qemu-server's permission checks for the calls the pipeline makes:
clone (`VM.Clone` on the template, `VM.Allocate` for the new VM, `Datastore.AllocateSpace`
on the target storage), config (cloud-init, network, CPU, memory, tags), resize, power,
destroy on rollback, and the guest agent's reads (its address; the SSH host keys with
file-read), whose privileges depend on the release (`hostkeys`: `VM.Monitor` before
PVE 9, `VM.GuestAgent.Audit` and `VM.GuestAgent.FileRead` from 9.0, where
`VM.GuestAgent.Unrestricted` does as well); with host certificates the agent's
file-write and exec (`certificates`: `VM.Monitor` before PVE 9, from 9.0
`VM.GuestAgent.FileWrite` and `VM.GuestAgent.Unrestricted`). The new VM's id is not
known in advance, so its privileges are asked on /vms, from which /vms/<id> inherits.
PVE 8 checks `SDN.Use` on /sdn/zones/localnetwork/<bridge> for a plain bridge too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import MissingPrivilege, Segment
from backends.proxmox.api import PveApi
from backends.proxmox.certificates import exec_privilege, write_privilege
from backends.proxmox.config import Config
from backends.proxmox.hostkeys import (
    GUEST_AGENT_PRIVILEGES_SINCE,
    UNRESTRICTED,
    agent_read_privilege,
    file_read_privilege,
)
from backends.proxmox.inventory import TemplateInfo


@dataclass(frozen=True)
class Need:
    path: str
    privilege: str
    step: str  # what the deploy does with it, for the message
    instead: tuple[str, ...] = ()  # privileges that allow it as well (any one will do)


def needs(
    config: Config,
    template: TemplateInfo,
    release: tuple[int, int],
    segments: Sequence[Segment] = (),
    *,
    certificates: bool = False,
) -> list[Need]:
    """What the deploy steps need, on the paths they use for this template, on the
    server's release (`release`: its major, minor), for NICs on `segments` (none given:
    the configured `bridge`, if any); with `certificates`, also what installing a host
    certificate through the agent needs (`certificates`)."""
    new = "/vms"
    agent = (UNRESTRICTED,) if release >= GUEST_AGENT_PRIVILEGES_SINCE else ()
    storage = config.storage or template.disk.storage
    found = [
        Need(f"/vms/{template.vmid}", "VM.Clone", "copy the template"),
        Need(new, "VM.Allocate", "create the copy (and destroy it on rollback)"),
        Need(new, "VM.Config.Cloudinit", "set the identity (cloud-init)"),
        Need(new, "VM.Config.Network", "set the NIC"),
        Need(new, "VM.Config.CPU", "set the CPU model and cores"),
        Need(new, "VM.Config.Memory", "set the memory"),
        Need(new, "VM.Config.Options", "tag the VM with its job"),
        Need(new, "VM.Config.Disk", "grow the disk"),
        Need(new, "VM.PowerMgmt", "power on (and off on rollback)"),
        Need(new, "VM.Audit", "read the VM's state"),
        Need(new, agent_read_privilege(release), "read the address from the guest agent", agent),
        Need(
            new,
            file_read_privilege(release),
            "read the SSH host keys through the guest agent (file-read)",
            agent,
        ),
    ]
    if certificates:
        found += [
            Need(
                new,
                write_privilege(release),
                "write the SSH host certificate through the guest agent (file-write)",
                agent,
            ),
            Need(
                new,
                exec_privilege(release),
                "reload sshd with the host certificate through the guest agent (exec)",
            ),
        ]
    if storage:
        found.append(Need(f"/storage/{storage}", "Datastore.AllocateSpace", "copy the disk"))
    for segment in segments or ([Segment(config.bridge)] if config.bridge else []):
        found.append(bridge_need(segment))
    return found


def bridge_need(segment: Segment) -> Need:
    """`SDN.Use` where PVE checks it for a NIC on a plain bridge: the bridge's path in
    the `localnetwork` zone, and with a tag the tag's path below it (an ACL on the
    bridge, propagated, covers its tags)."""
    path = f"/sdn/zones/localnetwork/{segment.network}"
    if segment.vlan is not None:
        path += f"/{segment.vlan}"
    return Need(path, "SDN.Use", f"attach the NIC to {segment}")


def who(config: Config) -> str:
    """The user or API token whose permissions are asked (no secret in it)."""
    return f"{config.user}!{config.token_id}" if config.token_id else config.user


async def missing(
    api: PveApi,
    config: Config,
    template: TemplateInfo,
    release: tuple[int, int],
    segments: Sequence[Segment] = (),
    *,
    certificates: bool = False,
) -> list[MissingPrivilege]:
    """The privileges the deploy steps need and the token or user lacks, path by path
    (each path asked once, all at once: PVE computes the inherited set for each, and a
    deploy's check_free waits for them)."""
    wanted = needs(config, template, release, segments, certificates=certificates)
    paths = list(dict.fromkeys(n.path for n in wanted))
    answers: list[Any] = await asyncio.gather(
        *(api.call("GET", "access/permissions", "permissions", {"path": p}) for p in paths)
    )
    held = {
        path: set(answer.get(path, {}) if isinstance(answer, dict) else {})
        for path, answer in zip(paths, answers, strict=True)
    }
    return [
        MissingPrivilege(n.privilege, n.path, n.step, who(config))
        for n in wanted
        if not {n.privilege, *n.instead} & held[n.path]
    ]
