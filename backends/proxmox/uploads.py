"""Storage content on a Proxmox node, as a template build needs it: which storages take
what, uploading an image (checksum-verified by Proxmox), listing and removing volumes.
An upload is named after its build job (`buildmarks.upload_name`), so one a crash left
is found again."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

from backends.base import PermanentError
from backends.proxmox import buildmarks
from backends.proxmox.api import PveApi


class StorageContent:
    def __init__(self, api: PveApi) -> None:
        self.api = api

    async def storages(self, node: str) -> list[dict[str, Any]]:
        """Every enabled storage of the node, with its content types."""
        items: list[dict[str, Any]] = await self.api.get(
            f"nodes/{node}/storage", "storage list", enabled=1
        )
        return items

    async def volumes(
        self, node: str, storage: str, content: str | None = None
    ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = await self.api.get(
            f"nodes/{node}/storage/{storage}/content", f"content of {storage}", content=content
        )
        return items

    async def has_volume(self, node: str, upload: buildmarks.UploadTarget) -> bool:
        """Whether an earlier attempt's upload is there (complete: Proxmox moves a
        verified upload into place only at the end of its task)."""
        listing = await self.volumes(node, upload.storage, upload.content)
        return any(v.get("volid") == upload.volid for v in listing)

    async def delete_volume(self, node: str, storage: str, volid: str) -> None:
        what = f"removing {volid}"
        path = f"nodes/{node}/storage/{storage}/content/{quote(volid, safe='')}"
        try:
            upid = await self.api.delete(path, what)
        except PermanentError as exc:
            if "does not exist" in exc.message or "no such volume" in exc.message:
                return
            raise
        if upid is not None:
            await self.api.wait_task(str(upid), what)

    async def upload(self, node: str, upload: buildmarks.UploadTarget, image: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="deploybot-upload-") as folder:
            source = image
            if upload.content == "iso":  # counted as raw there: send raw data
                source = Path(folder) / upload.filename
                await _to_raw(image, source)
            digest = await asyncio.to_thread(_sha256, source)
            what = f"upload of {image.name} to {upload.storage} on {node}"
            path = f"nodes/{node}/storage/{upload.storage}/upload"
            upid = await self.api.upload(
                path,
                what,
                source,
                upload.filename,
                content=upload.content,
                checksum=digest,
                **{"checksum-algorithm": "sha256"},
            )
            if upid is not None:
                await self.api.wait_task(str(upid), what)

    async def download(
        self, node: str, upload: buildmarks.UploadTarget, url: str, digest: str
    ) -> None:
        """Have the node fetch `url` into the import storage itself, verifying it against
        `digest` ("sha256:<hex>" or "sha512:<hex>"): Proxmox keeps only a file that
        matches, so nothing half-downloaded is ever used."""
        algorithm, _, hexdigest = digest.partition(":")
        what = f"download of {url} to {upload.storage} on {node}"
        upid = await self.api.post(
            f"nodes/{node}/storage/{upload.storage}/download-url",
            what,
            content=upload.content,
            filename=upload.filename,
            url=url,
            checksum=hexdigest,
            **{"checksum-algorithm": algorithm, "verify-certificates": 1},
        )
        if upid is not None:
            await self.api.wait_task(str(upid), what)

    async def remove_uploads(self, node: str, job_id: str) -> None:
        """Every upload of this job on the node's import and iso storages."""
        prefix = buildmarks.upload_prefix(job_id)
        for storage in await self.storages(node):
            for kind in ("import", "iso"):
                if kind not in buildmarks.contents(storage):
                    continue
                for volume in await self.volumes(node, str(storage["storage"]), kind):
                    volid = str(volume.get("volid", ""))
                    if volid.rsplit("/", 1)[-1].startswith(prefix):
                        await self.delete_volume(node, str(storage["storage"]), volid)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def _to_raw(image: Path, target: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        "qemu-img",
        "convert",
        "-O",
        "raw",
        str(image),
        str(target),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _out, err = await process.communicate()
    if process.returncode != 0:
        raise PermanentError(f"converting {image} to raw for the upload failed: {err.decode()}")
