"""What the template-build tests share: a real HTTP server on 127.0.0.1 that serves
"upstream" files and counts what it was asked, and the skip-or-fail rule for libguestfs."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bot.images import customize


def unavailable(reason: str) -> NoReturn:
    """Skip saying why; under DEPLOYBOT_REQUIRE_LIBGUESTFS=1 (CI) fail instead."""
    if os.environ.get("DEPLOYBOT_REQUIRE_LIBGUESTFS") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_LIBGUESTFS=1 forbids skipping this test")
    pytest.skip(reason)


def require_libguestfs() -> None:
    if missing := customize.missing_tools():
        unavailable(
            f"missing {', '.join(missing)} (apt-get install --no-install-recommends "
            "libguestfs-tools linux-image-amd64)"
        )
    if not any(Path("/boot").glob("vmlinuz-*")):
        unavailable(
            "no kernel in /boot for libguestfs' appliance (apt-get install linux-image-amd64)"
        )


@dataclass
class Upstream:
    """A local "mirror": `files` (URL path -> file or bytes) served under `url`;
    `/cut/NAME` answers with the full Content-Length but stops halfway through."""

    url: str = ""
    files: dict[str, Path | bytes] = field(default_factory=dict)
    hits: Counter[str] = field(default_factory=Counter)

    def link(self, name: str) -> str:
        return f"{self.url}/{name}"

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] += 1
        content = self.files.get(name)
        if content is None:
            raise web.HTTPNotFound()
        if isinstance(content, Path):
            return web.FileResponse(content)
        return web.Response(body=content)

    async def _cut(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[f"cut/{name}"] += 1
        content = self.files[name]
        assert isinstance(content, bytes)
        response = web.StreamResponse()
        response.content_length = len(content)
        await response.prepare(request)
        await response.write(content[: len(content) // 2])
        assert request.transport is not None
        request.transport.close()  # the connection drops mid-file
        return response


@asynccontextmanager
async def upstream_server() -> AsyncIterator[Upstream]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_get("/cut/{name}", upstream._cut)
    app.router.add_get("/{name:.+}", upstream._serve)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    upstream.url = str(server.make_url("")).rstrip("/")
    try:
        yield upstream
    finally:
        await server.close()
