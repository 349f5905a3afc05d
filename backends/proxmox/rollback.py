"""Undoing a deploy on Proxmox: stop (and wait for the stop), destroy (and wait).

Both moves aim at a state, so a failure is judged by the state it left. A stop that
failed while the VM still runs, or a destroy that failed while the VM is still there,
is retryable: the caller (bot/jobs/waiting.py) tries again within the move's timeout, so one
HTTP 500 does not leave a running VM behind. A VM already stopped, or already gone, is
success whatever the answer said.

`VM <id> is running - destroy failed` means the VM runs again since it was stopped (a
stop that failed, a person, HA, or a start whose answer was lost): stop it, wait for
the stop task, destroy again. Errors another try cannot change go up as they are: a
refused permission, a lock held by someone else past its wait (`Locked`), not our VM.

Both waits are paced like the deploy's (`pacing`): per template, by how long this
process saw a stop and a destroy take.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from backends.base import Locked, NotOurVM, RetryableError, VMNotFound
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import Forbidden, StillRunning
from backends.proxmox.locks import TaskRunner
from backends.proxmox.pacing import Pace, Pacing
from bot.models.errors import BackendError

log = logging.getLogger(__name__)
# A destroy that finds the VM running again stops it this many times before it hands
# the decision back to its caller's retry (and timeout).
_RESTOPS = 3
# Another try cannot change these: say them as they are.
_FINAL = (Forbidden, Locked, NotOurVM)
# The node and template of the VM, once its job tag was checked again (VMNotFound when
# it is gone).
Owned = Callable[[], Awaitable[tuple[str, str]]]


async def stop(
    api: PveApi, tasks: TaskRunner, node: str, vm_id: str, pace: Pace | None = None
) -> None:
    """Stop (hard) and wait for the stop task; done when the VM no longer runs."""
    if not await _running(api, node, vm_id):
        return
    what = f"stop of VM {vm_id}"
    path = f"nodes/{node}/qemu/{vm_id}/status/stop"
    try:
        await tasks.run(what, node, vm_id, functools.partial(api.post, path, what), pace=pace)
    except VMNotFound:
        return
    except _FINAL:
        raise
    except BackendError as exc:
        if exc.retryable:
            raise
        if not await _running(api, node, vm_id):
            return  # the answer was an error, yet the VM stopped
        raise RetryableError(
            f"{exc.message}; VM {vm_id} still runs: stopping it again", vm_id=vm_id
        ) from None


async def destroy(
    api: PveApi, tasks: TaskRunner, owned: Owned, vm_id: str, pacing: Pacing | None = None
) -> None:
    """Delete with disks, backup jobs and HA entry, and wait; a VM gone is done."""
    params = {"purge": 1, "destroy-unreferenced-disks": 1}
    for _ in range(_RESTOPS):
        try:
            node, template = await owned()
        except VMNotFound:
            return
        what = f"destroy of VM {vm_id} on {node}"
        path = f"nodes/{node}/qemu/{vm_id}"
        delete = functools.partial(api.delete, path, what, **params)
        try:
            await tasks.run(what, node, vm_id, delete, pace=_pace(pacing, "destroy", template))
            return
        except VMNotFound:
            return
        except StillRunning as exc:
            log.info("%s; stopping it (again) first", exc.message)
            await stop(api, tasks, node, vm_id, _pace(pacing, "stop", template))
            continue
        except _FINAL:
            raise
        except BackendError as exc:
            if exc.retryable:
                raise
            try:
                await owned()
            except VMNotFound:
                return  # the answer was an error, yet the VM is gone
            raise RetryableError(
                f"{exc.message}; VM {vm_id} is left on {node}: destroying it again",
                vm_id=vm_id,
            ) from None
    raise RetryableError(
        f"VM {vm_id} was running again after each of {_RESTOPS} stops: stopping and "
        "destroying it again",
        vm_id=vm_id,
    )


def _pace(pacing: Pacing | None, operation: str, template: str) -> Pace | None:
    return Pace(pacing, operation, template) if pacing is not None else None


async def _running(api: PveApi, node: str, vm_id: str) -> bool:
    try:
        status = await api.get(f"nodes/{node}/qemu/{vm_id}/status/current", "VM status")
    except VMNotFound:
        return False
    return bool(status.get("status") == "running")
