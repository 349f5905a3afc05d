"""Building golden templates on Proxmox (`backends.building.BuildsTemplates`).

A build, as API calls (each mutation waits for its task):

1. `POST /nodes/{node}/storage/{up}/upload` (multipart: content `import`, the file
   `deploybot-<job>.qcow2`, checksum + checksum-algorithm sha256, so Proxmox verifies
   it), task `imgcopy`;
2. `POST /nodes/{node}/qemu`: the VM, its disk imported from the upload
   (`scsi0: STORAGE:0,import-from=<upload volid>`), a cloud-init drive, serial console,
   agent, CPU baseline, tags and the build mark (`buildmarks`), task `qmcreate`;
3. `POST /nodes/{node}/qemu/{vmid}/template`, task `qmtemplate`;
4. `DELETE /nodes/{node}/storage/{up}/content/{volid}`: the upload, no longer needed.

Publishing renames (`POST .../config name=`) the new template to the plain name, then the
previous one to `<name>-v<its version>`. Marks and names: `buildmarks`; uploads and
volumes: `uploads`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.base import IdTaken, PermanentError, VMNotFound, VMRef
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.proxmox import buildmarks, rollback
from backends.proxmox.api import PveApi
from backends.proxmox.apierrors import AlreadyExists
from backends.proxmox.cloning import Cloning
from backends.proxmox.config import Config
from backends.proxmox.inventory import LINKED_TYPES, Inventory
from backends.proxmox.locks import TaskRunner
from backends.proxmox.uploads import StorageContent
from backends.proxmox.vmconfig import cpu_model, owned, tags_of
from bot.models.errors import BackendError

log = logging.getLogger(__name__)
_TEMPLATE = (1, "1", True)
# File storages, where a disk is a file whose format the disk spec chooses (raw by
# default); btrfs keeps raw disks and clones them by snapshot.
QCOW2_TYPES = frozenset({"dir", "nfs", "cifs", "glusterfs"})


class TemplateBuilds:
    """The build moves of one Proxmox backend (`ProxmoxBackend` holds one and hands the
    `BuildsTemplates` calls to it)."""

    def __init__(
        self, config: Config, api: PveApi, inventory: Inventory, tasks: TaskRunner, cloning: Cloning
    ) -> None:
        self.config = config
        self.api = api
        self.inventory = inventory
        self.tasks = tasks
        self.cloning = cloning
        self.content = StorageContent(api)
        self.fetched_by_node: set[str] = set()  # builds whose image the node downloaded

    # --- before anything is created ---------------------------------------------------

    async def preflight(self, plan: BuildPlan) -> BuildTarget:
        node = plan.placement or await self.inventory.default_node()
        nodes = await self.inventory.online_nodes()
        if node not in nodes:
            raise PermanentError(
                f"{node!r} is not an online node of {self.config.name} (have: "
                f"{', '.join(nodes) or 'none'}): build on=one of them"
            )
        shortfall = await self.inventory.cpu_shortfall(plan.cpu, node)
        if shortfall is not None:
            raise PermanentError(
                f"build profile {plan.profile} needs CPU model {cpu_model(plan.cpu)}, but "
                f"{shortfall}: its guests would panic at boot. Build on a node with that "
                "CPU (on=NODE), or set the profile's CPU baseline to what the nodes offer."
            )
        storages = await self.content.storages(node)
        storage = plan.storage or self.config.storage or _default_storage(storages)
        if storage is None:
            raise PermanentError(
                f"no storage on {node} holds VM disks (content images): enable `Disk "
                "image` on one, or name one with storage=NAME"
            )
        found = next((s for s in storages if s["storage"] == storage), None)
        if found is None:
            have = ", ".join(sorted(str(s["storage"]) for s in storages)) or "none"
            raise PermanentError(
                f"storage {storage!r} does not exist on {node} (have: {have}): name another "
                "with storage=NAME"
            )
        if "images" not in buildmarks.contents(found):
            raise PermanentError(
                f"storage {storage} on {node} does not hold VM disks (its content is "
                f"{found.get('content') or 'none'}): add `images` to its content in "
                "Datacenter > Storage, or build onto another storage (storage=NAME)"
            )
        release = await self.inventory.release()
        upload = buildmarks.choose_upload(storages, release, storage, plan.job_id)
        if upload is None:
            kinds = "import or iso" if release >= buildmarks.IMPORT_RELEASE else "iso"
            raise PermanentError(
                f"no storage on {node} takes the image upload (content {kinds}): enable "
                f"that content on a file storage of {node} (e.g. `local`)"
            )
        await self._names_free(plan)
        notes = [f"image upload to {upload.storage} (content {upload.content})"]
        if upload.content == "iso":
            notes.append("the image is sent as raw data (no import content on this release)")
        if found.get("type") not in LINKED_TYPES:
            notes.append(f"{storage} ({found.get('type')}) cannot hold linked clones")
        return BuildTarget(placement=node, storage=storage, notes=tuple(notes))

    async def _names_free(self, plan: BuildPlan) -> None:
        vms = await self.inventory.vms()
        taken = [v for v in vms if v.get("name") == plan.versioned_name]
        if taken:
            raise PermanentError(
                f"the name {plan.versioned_name} is taken by VM {taken[0]['vmid']} on "
                f"{taken[0]['node']}: remove or rename it, or build another version"
            )
        for item in (v for v in vms if v.get("name") == plan.name):
            what = f"VM {item['vmid']} on {item['node']}"
            if item.get("template") not in _TEMPLATE:
                raise PermanentError(
                    f"the name {plan.name} belongs to {what}, which is not a template: rename "
                    "that VM, or give the build profile another name"
                )
            config = await self.inventory.vm_config(str(item["node"]), str(item["vmid"])) or {}
            if not buildmarks.ours(config, plan.installation):
                raise PermanentError(
                    f"the name {plan.name} belongs to template {what}, which this deploybot "
                    "did not build: rename it (deploys by that name then take the new "
                    "build), or give the build profile another name"
                )

    async def prepare(self, plan: BuildPlan, target: BuildTarget) -> VMRef:
        vmid = await self.cloning.free_vmid()
        cluster = await self.inventory.cluster_name()
        node = target.placement
        return plan.ref(str(vmid), f"{node}@{cluster}" if cluster else node)

    # --- the build --------------------------------------------------------------------

    async def create(self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path) -> str:
        node = node_of(ref)
        try:
            existing = await self.inventory.vm_config(node, ref.vm_id)
            if existing is not None and ref.tag not in tags_of(existing):
                raise IdTaken(f"VM id {ref.vm_id} was taken by another client; choosing another")
            release = await self.inventory.release()
            storages = await self.content.storages(node)
            upload = buildmarks.choose_upload(storages, release, target.storage, plan.job_id)
            if upload is None:
                raise PermanentError(f"no storage on {node} takes the image upload any more")
            if existing is not None and existing.get("template") not in _TEMPLATE:
                # A crash between create and template: start again from a clean slate.
                await rollback.destroy(
                    self.api, self.tasks, functools.partial(self._owned, ref), ref.vm_id
                )
                existing = None
            if existing is None:
                if not await self.content.has_volume(node, upload):
                    await self._fetch(node, plan, upload, image)
                found = [s for s in storages if s["storage"] == target.storage]
                kind = str(found[0].get("type", "")) if found else ""
                await self._create_vm(plan, target, ref, node, upload, kind)
                await self._templatise(node, ref.vm_id)
            await self.content.delete_volume(node, upload.storage, upload.volid)
        finally:
            self.cloning.reserved.discard(int(ref.vm_id))
        how = "a download by the node to" if plan.job_id in self.fetched_by_node else "an upload to"
        return (
            f"VM {ref.vm_id} {plan.versioned_name} on {node}: imported onto {target.storage} "
            f"from {how} {upload.storage}"
        )

    async def _fetch(
        self, node: str, plan: BuildPlan, upload: buildmarks.UploadTarget, image: Path
    ) -> None:
        """The image onto the node: fetched by Proxmox from upstream (`download-url`)
        when it needs no change and an import storage takes it, else uploaded."""
        if plan.source_url and plan.source_digest and upload.content == "import":
            try:
                await self.content.download(node, upload, plan.source_url, plan.source_digest)
                self.fetched_by_node.add(plan.job_id)
                return
            except BackendError as exc:  # no route, no Sys.AccessNetwork, upstream changed
                log.warning("node %s could not download the image (%s): uploading it", node, exc)
        await self.content.upload(node, upload, image)

    async def _create_vm(
        self,
        plan: BuildPlan,
        target: BuildTarget,
        ref: VMRef,
        node: str,
        upload: buildmarks.UploadTarget,
        storage_type: str,
    ) -> None:
        disk = f"{plan.disk_bus}0"
        # A file storage's default format is raw, whose template no linked clone can use:
        # qcow2 there, as a deploy's clone then takes seconds, not minutes.
        spec = f"{target.storage}:0,import-from={upload.volid}"
        if storage_type in QCOW2_TYPES:
            spec += ",format=qcow2"
        nic = f"{plan.nic},bridge={self.config.bridge}" if self.config.bridge else plan.nic
        params: dict[str, Any] = {
            "vmid": int(ref.vm_id),
            "name": plan.versioned_name,
            disk: spec,
            "ide2": f"{target.storage}:cloudinit",
            "serial0": "socket",
            "vga": "serial0",
            "agent": "1",
            "cpu": plan.cpu,
            "ostype": plan.ostype,
            "net0": nic,
            "boot": f"order={disk}",
            "cores": plan.cores,
            "memory": str(plan.memory_mib),
            "tags": buildmarks.build_tags(plan),
            "description": buildmarks.build_description(plan),
        }
        if plan.disk_bus == "scsi":
            params["scsihw"] = "virtio-scsi-single"
        what = f"creating VM {ref.vm_id} ({plan.versioned_name}) on {node}"
        post = functools.partial(self.api.post, f"nodes/{node}/qemu", what, **params)
        try:
            await self.tasks.run(what, node, ref.vm_id, post)
        except AlreadyExists:
            config = await self.inventory.vm_config(node, ref.vm_id)
            if config is None or ref.tag not in tags_of(config):
                raise IdTaken(f"VM id {ref.vm_id} was taken by another client") from None
            raise  # ours from a lost answer: the caller's retry finds and redoes it

    async def _templatise(self, node: str, vm_id: str) -> None:
        what = f"converting VM {vm_id} to a template"
        path = f"nodes/{node}/qemu/{vm_id}/template"
        await self.tasks.run(what, node, vm_id, functools.partial(self.api.post, path, what))

    # --- publishing -------------------------------------------------------------------

    async def publish(self, plan: BuildPlan, ref: VMRef) -> str:
        node, config = await self._owned_config(ref)
        if config.get("template") not in _TEMPLATE:
            raise PermanentError(
                f"VM {ref.vm_id} is not a template (yet): the build did not finish; build again"
            )
        notes = []
        if config.get("name") != plan.name:
            await self._rename(node, ref.vm_id, plan.name)
            notes.append(f"VM {ref.vm_id} is now {plan.name}")
        for item in await self.inventory.vms():
            vmid = str(item.get("vmid"))
            if item.get("name") != plan.name or vmid == ref.vm_id:
                continue
            other = await self.inventory.vm_config(str(item["node"]), vmid) or {}
            version = buildmarks.version_of(vmid, str(item["node"]), other)
            if item.get("template") not in _TEMPLATE or version is None:
                raise PermanentError(
                    f"VM {vmid} on {item['node']} is also called {plan.name} and deploybot did "
                    "not build it: rename it by hand, deploys may pick either meanwhile"
                )
            if not buildmarks.ours(other, plan.installation):
                raise PermanentError(
                    f"template {vmid} ({plan.name}) was built by another deploybot "
                    "installation: it is left alone; rename it by hand"
                )
            old_name = f"{plan.name}-v{version.version}"
            await self._rename(str(item["node"]), vmid, old_name)
            notes.append(f"the previous one (VM {vmid}) is now {old_name}")
        self.inventory.forget_templates()
        return "; ".join(notes) or f"VM {ref.vm_id} was already {plan.name}"

    async def _rename(self, node: str, vm_id: str, name: str) -> None:
        what = f"renaming VM {vm_id} to {name}"
        path = f"nodes/{node}/qemu/{vm_id}/config"
        post = functools.partial(self.api.post, path, what, name=name)
        await self.tasks.run(what, node, vm_id, post)

    # --- what there is ----------------------------------------------------------------

    async def versions(self, name: str | None = None) -> list[TemplateVersion]:
        items = [i for i in await self.inventory.vms() if i.get("template") in _TEMPLATE]
        configs = await asyncio.gather(
            *(self.inventory.vm_config(str(i["node"]), str(i["vmid"])) for i in items)
        )
        found: list[tuple[TemplateVersion, set[buildmarks.Volume]]] = []
        for item, config in zip(items, configs, strict=True):
            version = buildmarks.version_of(str(item["vmid"]), str(item["node"]), config or {})
            if version is not None and name in (None, version.base_name):
                found.append((version, buildmarks.base_volumes(config or {})))
        wanted = {(str(v.placement), store) for v, volumes in found for store, _ in volumes}
        listings = await asyncio.gather(*(self.content.volumes(n, s) for n, s in sorted(wanted)))
        children: dict[buildmarks.Volume, set[str]] = {}
        for listing in listings:
            for volume in listing:
                for parent in buildmarks.clone_parents(volume):
                    children.setdefault(parent, set()).add(str(volume.get("vmid", "")))
        answer = []
        for version, volumes in found:
            users = {u for v in volumes for u in children.get(v, set())} - {version.vm_id, ""}
            answer.append(_with_users(version, users))
        return sorted(answer, key=lambda v: (v.base_name, v.version, v.vm_id))

    # --- removing ---------------------------------------------------------------------

    async def destroy(self, ref: VMRef) -> None:
        node = node_of(ref)
        try:
            node, _config = await self._owned_config(ref)
        except VMNotFound:
            pass
        else:
            await rollback.stop(self.api, self.tasks, node, ref.vm_id)
            owned = functools.partial(self._owned, ref)
            await rollback.destroy(self.api, self.tasks, owned, ref.vm_id)
        self.cloning.reserved.discard(int(ref.vm_id))
        await self.content.remove_uploads(node, ref.job_id)

    # --- helpers ----------------------------------------------------------------------

    async def _owned(self, ref: VMRef) -> tuple[str, str]:
        node, _config = await self._owned_config(ref)
        return node, ""

    async def _owned_config(self, ref: VMRef) -> tuple[str, dict[str, Any]]:
        node = node_of(ref)
        return node, owned(await self.inventory.vm_config(node, ref.vm_id), ref, node, node)


def node_of(ref: VMRef) -> str:
    node = (ref.placement or "").partition("@")[0]
    if not node:
        raise PermanentError(f"VM {ref.vm_id}: the build's record names no node")
    return node


def _default_storage(storages: list[dict[str, Any]]) -> str | None:
    """For disks: one that can hold linked clones first, then the most free space."""
    able = [s for s in storages if "images" in buildmarks.contents(s)]
    able.sort(key=lambda s: (s.get("type") not in LINKED_TYPES, -int(s.get("avail", 0))))
    return str(able[0]["storage"]) if able else None


def _with_users(version: TemplateVersion, users: set[str]) -> TemplateVersion:
    return replace(version, used_by=tuple(sorted(users, key=int)))
