"""Cloning on Proxmox: choosing the new VM's id, and cloning into that id only.

The vmid is chosen before anything exists and reserved in this process, so concurrent
deploys never pick the same one; a clone that finds it taken by another client raises
IdTaken and the pipeline picks a new id. A clone request whose answer was lost may have
started the clone: the VM is looked for before the request is sent again, and adopted
when it carries the job's tag, so a retry never leaves a second VM under another id.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from backends.base import (
    CloneSpec,
    IdTaken,
    PermanentError,
    RetryableError,
    Unreachable,
    VMRef,
)
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import AlreadyExists, Forbidden
from backends.proxmox.config import Config
from backends.proxmox.inventory import Inventory
from backends.proxmox.locks import Holder, TaskRunner
from backends.proxmox.pacing import Pace, Pacing, clone_key
from backends.proxmox.vmconfig import Mark, tags_of

_ID_TAKEN = (
    "VM id {vmid} was taken by another client between choosing and cloning; choosing another id"
)


class Cloning:
    """The clone moves of one backend, and the vmids its deploys hold."""

    def __init__(
        self, config: Config, api: PveApi, inventory: Inventory, tasks: TaskRunner, pacing: Pacing
    ) -> None:
        self.config = config
        self.api = api
        self.inventory = inventory
        self.tasks = tasks
        self.pacing = pacing
        self.reserved: set[int] = set()

    async def free_vmid(self) -> int:
        """A vmid the cluster calls free and no deploy of this process holds, reserved
        before the next await so concurrent deploys cannot pick the same one. Deploys
        asking together share one `nextid` answer; the ids after it are skipped when the
        last VM listing showed them in use, and otherwise checked with `nextid?vmid=`,
        which knows every VM of the cluster, also those this user may not see. If
        another client takes one meanwhile, the clone says so and the pipeline asks
        again (IdTaken)."""
        answer = await self.inventory.next_vmid()
        candidate = answer
        for _ in range(1000):
            used = self.inventory.known_vmids
            while candidate in self.reserved or (candidate != answer and candidate in used):
                candidate += 1
            self.reserved.add(candidate)  # held while the server is asked
            try:
                if candidate == answer or not await self.taken(candidate):
                    return candidate
            except BaseException:
                self.reserved.discard(candidate)
                raise
            self.reserved.discard(candidate)
            candidate += 1
        raise PermanentError(f"{self.config.name}: found no free VM id")

    async def taken(self, vmid: int) -> bool:
        """Whether the cluster has a VM (or container) with this id, visible to us or not."""
        try:
            await self.api.get("cluster/nextid", "VM id check", vmid=vmid)
        except AlreadyExists:
            return True
        return False

    async def clone(self, spec: CloneSpec, ref: VMRef, node: str) -> str | None:
        """Clone the spec's template into the ref's vmid on `node`, and wait for it;
        a note when it is a full copy."""
        template = await self.inventory.template(spec.template)
        mode, target = await self.inventory.clone_mode(spec, template, node)
        mark = Mark(spec.job_id, spec.tag, template.name, template.family)
        params: dict[str, Any] = {
            "newid": int(ref.vm_id),
            "name": spec.name,
            "description": mark.text(),  # the job's mark from the first moment on
        }
        if not mode.linked:
            params.update(full=1, storage=target)
        if node != template.node:
            params["target"] = node
        what = f"clone of {template.name} into VM {ref.vm_id}"
        path = f"nodes/{template.node}/qemu/{template.vmid}/clone"
        # A backup of the template (`lock: backup`) stops every clone of it: wait on it.
        label = f"template {template.name} (VM {template.vmid})"
        source = Holder(template.node, str(template.vmid), label, ours=False)
        post = functools.partial(self.api.post, path, what, **params)
        # Linked clones take about as long each time; full ones scale with the storage.
        pace = Pace(self.pacing, "clone", clone_key(template.name, spec.storage))
        try:
            await self._into(node, ref, post, what, source, pace)
        finally:
            self.reserved.discard(int(ref.vm_id))
        return None if mode.linked else f"full copy onto {target}: minutes, not seconds"

    async def _into(
        self,
        node: str,
        ref: VMRef,
        post: Callable[[], Awaitable[Any]],
        what: str,
        source: Holder,
        pace: Pace,
    ) -> None:
        """Clone into the ref's vmid, and only that one. A request whose answer was lost
        may have started the clone: look before sending it again, and adopt what is
        ours, so a retry never leaves a second VM behind under another id."""
        delay = self.config.lock_backoff_s
        for attempt in range(self.config.lock_retries + 1):
            try:
                if attempt and await self.inventory.vm_config(node, ref.vm_id) is not None:
                    raise AlreadyExists(f"VM {ref.vm_id} exists")
                await self.tasks.run(what, node, ref.vm_id, post, holder=source, pace=pace)
                return
            except AlreadyExists:
                await self._adopt(node, ref)
                return
            except Forbidden:  # may we not clone at all, or is the id someone else's?
                if await self.taken(int(ref.vm_id)):
                    raise IdTaken(_ID_TAKEN.format(vmid=ref.vm_id)) from None
                raise
            except Unreachable:
                if attempt == self.config.lock_retries:
                    raise
            await asyncio.sleep(delay)
            delay *= 2

    async def _adopt(self, node: str, ref: VMRef) -> None:
        """The vmid exists: ours from an attempt whose answer was lost (wait for its
        clone to end), or another client's (retryable: the pipeline takes a new id)."""
        try:
            config = await self.inventory.vm_config(node, ref.vm_id)
        except Forbidden:  # a VM we may not even read is not ours
            config = None
        if config is None or ref.tag not in tags_of(config):
            raise IdTaken(_ID_TAKEN.format(vmid=ref.vm_id))
        began = asyncio.get_running_loop().time()
        while config.get("lock"):
            elapsed = asyncio.get_running_loop().time() - began
            await asyncio.sleep(self.api.settings.polling.interval_s(elapsed))
            config = await self.inventory.vm_config(node, ref.vm_id)
            if config is None:
                raise RetryableError(f"an earlier clone into VM {ref.vm_id} failed; cloning again")
