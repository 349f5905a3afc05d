"""What every endpoint handler gets (`Call`) and the small helpers the read and write
endpoints share: disk sizes as Proxmox writes them, and qemu-server's lock checks."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.fakepve.cluster import GIB, VM, Cluster
from tests.support.fakepve.errors import ApiError, TaskError

UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}


@dataclass(frozen=True)
class Call:
    cluster: Cluster
    params: dict[str, str]
    path: dict[str, str]
    user: str
    upload: Path | None = None  # a multipart request's file, saved under the state dir
    lists: dict[str, list[str]] = field(default_factory=dict)  # every value of each key

    @property
    def node(self) -> str:
        return self.path["node"]

    @property
    def vmid(self) -> int:
        return int(self.path["vmid"])

    def vm(self) -> VM:
        self.cluster.node(self.node)
        return self.cluster.vm(self.node, self.vmid)


Handler = Callable[[Call], Awaitable[Any]]


def size_bytes(text: str) -> int:
    match = re.search(r"(?:^|,)size=(\d+(?:\.\d+)?)([KMGT]?)", text)
    return int(float(match.group(1)) * UNITS[match.group(2)]) if match else 0


def size_text(size: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]}{unit}"
    return str(size)


def locked(vm: VM) -> None:
    """qemu-server's check_lock in the API's early checks: an HTTP 500 at once."""
    if lock := vm.config.get("lock"):
        raise ApiError(500, f"VM is locked ({lock})")


def task_locked(vm: VM) -> None:
    """The same check_lock inside a task: the task fails with it."""
    if lock := vm.config.get("lock"):
        raise TaskError(f"VM is locked ({lock})")
