"""Which read-only source a plan reads: a `[[backends]]` entry opened through its
read-only session type (vSphere only: the one hypervisor deploybot migrates from), or
an OVA on a web server read from its head. Never a backend: the source is read-only by
construction, so no code path here can hold something that writes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


def check_distinct(configs: Sequence[BackendConfig], source: str, target: str) -> None:
    """Refuse a plan or an apply whose target is its source: the same `[[backends]]`
    entry, or a second entry naming the same server (host:port). Its builds would land
    on the very vCenter being left."""
    if source == target:
        raise UserError(
            f"--from and --to both name {target}: a migration reads one backend and builds "
            "on another, never on the one it reads. Nothing was changed; name another "
            "backend as the target."
        )
    by_name = {c.name: c for c in configs}
    here, there = _endpoint(by_name.get(source)), _endpoint(by_name.get(target))
    if here is not None and here == there:
        raise UserError(
            f"{source} and {target} are the same server ({here[0]}:{here[1]}): a migration "
            "builds on another server than the one it reads. Nothing was changed; name a "
            "backend on another server as the target."
        )


def _endpoint(config: BackendConfig | None) -> tuple[str, int] | None:
    """host:port of a hypervisor's entry (None for one with neither, e.g. the simulator);
    host names compare as DNS does, in lower case and without a final dot."""
    host, port = getattr(config, "host", None), getattr(config, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    return host.lower().rstrip("."), port


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
