"""`POST /nodes/{node}/storage/{storage}/download-url`: the node fetches a file itself
(a `download` task), verifies its checksum and keeps it only if it matches, as
pve-storage does. The lab has no network: only URLs on 127.0.0.1 are fetched; any other
host fails the task the way a node without a route would."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tests.support.fakepve.call import Call
from tests.support.fakepve.errors import ApiError, TaskError
from tests.support.fakepve.storage import IMPORT_RELEASE, extension_ok, storage_content, storage_of


async def download_url(c: Call) -> Any:
    cl = c.cluster
    storage = storage_of(cl, c.path["storage"])
    content, name, url = c.params["content"], c.params["filename"], c.params["url"]
    if content == "import" and cl.release_tuple < IMPORT_RELEASE:
        raise ApiError(400, "Parameter verification failed.", {"content": "value not allowed"})
    if content not in storage_content(storage):
        raise ApiError(500, f"storage '{storage.name}' does not support '{content}' content")
    if not extension_ok(content, name):
        raise ApiError(500, "wrong file extension")
    volid = f"{storage.name}:{content}/{name}"
    target = cl.files() / "storage" / storage.name / content / name

    async def fetch() -> None:
        host = urlsplit(url).hostname or ""
        if host not in ("127.0.0.1", "localhost"):
            raise TaskError(f"could not download {url}: no route to host {host} (lab)")
        with tempfile.NamedTemporaryFile(dir=cl.files(), delete=False) as held:
            part = Path(held.name)
        try:
            digest = await _get(url, part, c.params.get("checksum-algorithm", "sha256"))
            expected = c.params.get("checksum")
            if expected is not None and digest != expected.lower():
                raise TaskError(f"checksum mismatch: got '{digest}' != expect '{expected}'")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(part, target)
            cl.volumes[volid] = target
        finally:
            await asyncio.to_thread(part.unlink, True)

    return cl.spawn(
        c.node,
        "download",
        "",
        c.user,
        lock_vmid=None,
        duration_s=cl.timings.config_s,
        effect=fetch,
        log=(f"downloading {url} to {target}",),
    )


async def _get(url: str, into: Path, algorithm: str) -> str:
    hasher = hashlib.new(algorithm)
    timeout = aiohttp.ClientTimeout(total=600)
    session = aiohttp.ClientSession(timeout=timeout, trust_env=False)
    async with session, session.get(url) as response:
        if response.status != 200:
            raise TaskError(f"download failed: {response.status} {response.reason}")
        with into.open("wb") as out:
            async for chunk in response.content.iter_chunked(1 << 20):
                hasher.update(chunk)
                out.write(chunk)
    return hasher.hexdigest()


__all__ = ["download_url"]
