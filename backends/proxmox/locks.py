"""Running Proxmox tasks, and waiting out the locks in their way: how long, how often,
and what to say when a lock stays.

Proxmox answers with two kinds of lock, and each needs its own patience:

* The file lock (`flock` on /var/lock/qemu-server/lock-<vmid>.conf), which every task
  holds while it works on the VM. A call or task that waited ~10 s for it fails
  `can't lock file '...' - got timeout`. Nothing was done, and only another try tells
  whether the lock is free now: the call is sent again after a backoff.
* The config lock (`lock: backup` in the VM's config), set by an operation that may run
  for hours (vzdump, a snapshot, a migration, a clone into the VM). Every change fails at
  once, `VM is locked (backup)`, so sending it again cannot help before the key is gone:
  the config is read instead (with backoff) and the call sent again once it is free.
  A clone re-posted every few seconds for as long as a backup runs is what this avoids.

`clone` on a VM of ours is our own clone still copying into it: waited for as long as
the caller allows (its step timeout). Any other lock, and a file lock that stays taken,
is waited for at most `lock_wait_s` from its first answer; then `Locked` names the lock
and says what to do about it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from backends import troubles
from backends.base import Locked, RetryableError
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import ConfigLocked, LockContention
from backends.proxmox.config import Config
from backends.proxmox.inventory import Inventory
from backends.proxmox.pacing import Pace

log = logging.getLogger(__name__)
T = TypeVar("T")

OWN_LOCKS = frozenset({"clone"})  # on a VM of ours: our clone into it is still copying
_POLL_MIN_S = 0.01  # even with lock_backoff_s = 0, never a busy loop
_POLL_MAX_S = 10.0  # a lock that lasts minutes needs no quicker look than this
# What qemu-server's lock names mean, said of the VM that carries one ({vm}).
_MEANING = {
    "backup": "a backup (vzdump) of {vm} is running",
    "snapshot": "a snapshot of {vm} is being taken",
    "snapshot-delete": "a snapshot of {vm} is being deleted",
    "rollback": "{vm} is being rolled back to a snapshot",
    "migrate": "{vm} is being migrated to another node",
    "create": "{vm} is being restored from a backup",
    "clone": "a clone into {vm} is still copying",
    "disk": "a disk of {vm} is being moved",
    "suspending": "{vm} is being hibernated",
    "suspended": "{vm} is hibernated (suspended to disk)",
}


@dataclass(frozen=True)
class Holder:
    """The VM whose locks decide whether a call can go through: the VM it changes, or
    the template a clone reads. `ours`: a VM of the job, whose `clone` lock is our own."""

    node: str
    vmid: str
    label: str
    ours: bool = True


def vm_holder(node: str, vmid: str) -> Holder:
    return Holder(node, vmid, f"VM {vmid}")


class TaskRunner:
    """Starts a task, waits for its end, and waits out the locks on its way."""

    def __init__(self, config: Config, api: PveApi, inventory: Inventory) -> None:
        self.config = config
        self.api = api
        self.inventory = inventory

    async def run(
        self,
        what: str,
        node: str,
        vm_id: str,
        start: Callable[[], Awaitable[Any]],
        *,
        holder: Holder | None = None,
        pace: Pace | None = None,
    ) -> str:
        """Start a task (on VM `vm_id`, whose locks matter unless `holder` says whose
        do) and return its exit status once it ended; `pace` says what the task is, so
        its status is asked for when such a task usually ends."""

        async def once() -> str:
            upid = await start()
            if upid is None:  # a synchronous answer: resize before PVE 8.0
                return "OK"
            upid = upid if isinstance(upid, str) else str(upid)  # a Upid keeps its arrival
            return await self.api.wait_task(upid, what, vm_id=vm_id, pace=pace)

        return await self.patiently(what, holder or vm_holder(node, vm_id), once)

    async def patiently(self, what: str, holder: Holder, action: Callable[[], Awaitable[T]]) -> T:
        """Run `action`; on a lock answer wait (see the module docstring) and run it
        again. Raises `Locked` when a lock outlasts `lock_wait_s`."""
        loop = asyncio.get_running_loop()
        first: float | None = None
        delay = max(self.config.lock_backoff_s, _POLL_MIN_S)
        while True:
            try:
                return await action()
            except LockContention as exc:
                first = loop.time() if first is None else first
                lock: str | None
                if isinstance(exc, ConfigLocked):
                    lock = exc.lock
                else:  # a file lock: the config may say who holds the VM for long
                    lock = await self._lock(holder, None)
                own = holder.ours and lock in OWN_LOCKS
                deadline = None if own else first + self.config.lock_wait_s
                log.info("%s: %s; waiting for the lock to go", what, exc.message)
                delay = await self._wait(what, holder, lock, exc, delay, first, deadline)

    async def _wait(
        self,
        what: str,
        holder: Holder,
        lock: str | None,
        exc: LockContention,
        delay: float,
        first: float,
        deadline: float | None,
    ) -> float:
        """Sleep with backoff until the lock may be free (a config lock: until the
        config no longer shows it); return the next backoff. Past `deadline`: Locked."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise _locked(what, holder, lock, exc, deadline - first)
            # The caller's own timeout may come first (a step shorter than lock_wait_s):
            # it then names the lock and what to do, not only "timed out".
            troubles.trouble(_locked(what, holder, lock, exc, round(now - first, 1)).message)
            await asyncio.sleep(delay if deadline is None else min(delay, deadline - now))
            delay = min(delay * 2, _POLL_MAX_S)
            if lock is None or await self._lock(holder, lock) != lock:
                return delay  # free (or another lock: the next try says which)

    async def _lock(self, holder: Holder, unknown: str | None) -> str | None:
        """The holder's config lock now (None: none, or the VM is gone); `unknown` when
        the config cannot be read just now."""
        try:
            config = await self.inventory.vm_config(holder.node, holder.vmid)
        except RetryableError:
            return unknown
        found = (config or {}).get("lock")
        return str(found) if found else None


def _locked(
    what: str, holder: Holder, lock: str | None, exc: LockContention, waited_s: float
) -> Locked:
    """What stayed locked, for how long, and what a person can do about it."""
    node, vmid, waited = holder.node, holder.vmid, f"{waited_s:g} s"
    if lock is None:
        return Locked(
            f"{exc.message}; still so after {waited}: another task holds that lock and "
            f"does not let go. Find it in the task list of node {node} (a task that does "
            "not end), and wait for it to end or stop it.",
            lock="file lock",
            vm_id=exc.vm_id,
        )
    meaning = _MEANING.get(lock, "a '{lock}' operation holds {vm}")
    meaning = meaning.format(vm=holder.label, lock=lock)
    if lock == "suspended":
        todo = f"Resume it first (`qm resume {vmid}` on {node})."
    else:
        todo = (
            f"Wait until that has finished (the task list of node {node} shows it); if no "
            f"such task is running, the lock is stale: clear it with `qm unlock {vmid}` "
            f"on {node}."
        )
    return Locked(
        f"{what}: VM is locked ({lock}): {meaning}, still after {waited}. " + todo,
        lock=lock,
        vm_id=exc.vm_id,
    )
