"""Which read-only source a plan reads: a `[[backends]]` entry opened through its
read-only session type (vSphere only: the one hypervisor deploybot migrates from), or
an OVA on a web server read from its head. Never a backend: the source is read-only by
construction, so no code path here can hold something that writes."""

from __future__ import annotations

from collections.abc import Mapping

from backends.base import Backend
from backends.config import BackendConfig
from backends.migrating import ReadOnlySource
from backends.proxmox import ProxmoxBackend
from backends.vsphere import readonly
from backends.vsphere.ovahead import OvaSource
from bot.models.errors import BackendError, ConfigError, UserError


def open_source(config: BackendConfig, environ: Mapping[str, str]) -> ReadOnlySource:
    """The read-only session of `config` (not connected yet)."""
    if config.kind != "vsphere":
        raise UserError(
            f"--from {config.name}: a migration reads a vSphere backend, and "
            f"{config.name} is {config.kind}; name a vsphere backend, or use --from-ova URL."
        )
    try:
        return readonly.create(config, environ)
    except BackendError as exc:  # a missing password
        raise ConfigError(exc.message) from None


def ova_source(url: str, timeout_s: float) -> ReadOnlySource:
    if not url.startswith(("http://", "https://")):
        raise UserError(f"--from-ova {url!r}: give the http:// or https:// URL of an .ova file.")
    return OvaSource(url, timeout_s=timeout_s)


async def target_storage_type(target: Backend) -> str | None:
    """The type of the storage a moved VM's disks would land on (the target's configured
    `storage`: dir, lvmthin, zfspool, ...), which decides their format; None when the
    target names none or is not Proxmox. Read only."""
    if not isinstance(target, ProxmoxBackend) or not target.config.storage:
        return None
    node = await target.inventory.default_node()
    types = {s.name: s.type for s in await target.inventory.storages(node)}
    return types.get(target.config.storage)
