"""A deploy's identity as Proxmox config fields: the one config change that gives a
clone its name, cloud-init user, key, address, DNS, size, CPU model, NIC and tags."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from backends.base import Identity, Nic, PermanentError
from backends.proxmox.vmconfig import DISK_MARK, boot_disk, mark_field, merged_tags, nic_with

# `ciupgrade` exists from PVE 8.0; older servers upgrade on first boot, always.
CIUPGRADE_SINCE = (8, 0)


@dataclass(frozen=True)
class IdentityFields:
    params: dict[str, Any]  # for POST .../config, None values left out
    note: str | None  # for the job's thread: what this server could not be told


def identity_fields(
    config: dict[str, Any],
    identity: Identity,
    tag: str,
    *,
    cpu: str | None,
    nic: str | None,
    release: tuple[int, int],
) -> IdentityFields:
    """The fields for the clone whose current `config` is given (its digest makes the
    change refuse if someone changed the VM meanwhile); `cpu` and `nic` as the OS
    profile wants them; `release` the server's (major, minor)."""
    params: dict[str, Any] = {
        "name": identity.hostname,
        "ciuser": identity.user,
        "ipconfig0": f"ip={identity.address.with_prefixlen},gw={identity.gateway}",
        "cores": identity.cores,
        "memory": str(identity.memory_mib),
        "agent": "1",
        "cpu": cpu,
        "tags": merged_tags(config, tag),
        "description": _described(config, identity),
        "digest": config.get("digest"),  # refuse if someone changed it meanwhile
        "net0": nic,
    }
    params |= more_nics(config, identity, nic)
    if identity.ssh_keys:  # format `urlencoded`: %20 for spaces, never `+`
        params["sshkeys"] = quote("\n".join(identity.ssh_keys), safe="")
    if identity.dns:
        params["nameserver"] = " ".join(str(d) for d in identity.dns)
    if identity.searches:
        # Also the guest's domain: Proxmox's own cloud-init user-data says
        # `hostname: <name>`, `fqdn: <name>.<searchdomain>`, `manage_etc_hosts: true`
        # (qemu-server's get_hostname_fqdn), so `name` stays the bare host name.
        # Several (merged from every NIC's subnet): Proxmox's `searchdomain` is one
        # string that its cloud-init network config splits at spaces.
        params["searchdomain"] = " ".join(identity.searches)
    note = None
    if release >= CIUPGRADE_SINCE:
        params["ciupgrade"] = 1 if identity.upgrade else 0  # the server's default is 1
    else:
        note = (
            f"server {release[0]}.{release[1]}: ciupgrade not sent (it exists from PVE 8.0); "
            "this server upgrades packages on first boot whatever was asked"
        )
    return IdentityFields({k: v for k, v in params.items() if v is not None}, note)


def more_nics(config: dict[str, Any], identity: Identity, net0: str | None) -> dict[str, str]:
    """`net1`, `ipconfig1`, ... for `identity.more_nics`: each NIC in net0's model (as
    written now: `net0`, else the clone's) on its segment (None: net0's bridge, untagged),
    with its fixed MAC or, new, none (Proxmox generates one); one already there (a
    retry after a lost answer) keeps its MAC, so a second attempt changes nothing.
    `ipconfigN` is `ip=A/P` with `gw=G` only where the NIC has a gateway."""
    first = net0 or str(config.get("net0") or "virtio,bridge=vmbr0")
    head, *rest = first.split(",")
    model = head.partition("=")[0]
    options = dict(p.split("=", 1) for p in rest if "=" in p)
    model = options.get("model", model) if model == "model" else model
    bridge = options.get("bridge", "vmbr0")
    fields: dict[str, str] = {}
    for index, nic in enumerate(identity.more_nics, start=1):
        line = _nic_line(config.get(f"net{index}"), nic, model, bridge)
        if line is not None:
            fields[f"net{index}"] = line
        fields[f"ipconfig{index}"] = _ipconfig(nic)
    return fields


def _nic_line(had: Any, nic: Nic, model: str, bridge: str) -> str | None:
    if had:
        return nic_with(str(had), model, bridge, nic.segment, nic.mac)
    head = f"{model}={nic.mac.upper()}" if nic.mac else model
    if nic.segment is None:
        return f"{head},bridge={bridge}"
    tag = f",tag={nic.segment.vlan}" if nic.segment.vlan is not None else ""
    firewall = "1" if nic.segment.firewall else "0"
    return f"{head},bridge={nic.segment.network}{tag},firewall={firewall}"


def _ipconfig(nic: Nic) -> str:
    gateway = f",gw={nic.gateway}" if nic.gateway is not None else ""
    return f"ip={nic.address.with_prefixlen}{gateway}"


def _described(config: dict[str, Any], identity: Identity) -> str | None:
    """The clone's description with the identity appended; None leaves it as it is."""
    text = str(config.get("description", ""))
    if not text:
        return None
    kept = text.split("\naddress: ")[0]
    if mark_field(config, DISK_MARK) is None:
        # The disk's size before any growth: with it a disk growth asked again (a
        # retry, or a job resumed by a new process) aims at the same size.
        with contextlib.suppress(PermanentError):  # no disk: a growth asked says so
            kept += f"\n{DISK_MARK}: {boot_disk(config).size_bytes}"
    return f"{kept}\naddress: {identity.address} ({identity.user})"
