"""A counting HTTPS proxy in front of vcsim: it forwards every request unchanged and
records the SOAP method of each request body (and the object it is called on), and the
method, path and action of each vAPI REST request (/rest, /api: the tagging service),
so a test sees exactly what reached the server, whatever the client says it sent.

What counts as a change is decided here, apart from the code under test. SOAP: see
`mutating`. REST (`rest_mutating`): a GET reads; a POST reads only when it is a
session's login (`POST .../cis/session` or `/api/session`, no action, or the session's
`get`) or one of the tagging service's `list-*` actions (list-attached-tags-on-objects
and its kin: the vAPI spells those reads as POSTs whose body is the list of objects);
a DELETE only when it is the session's logout. Every other POST (create, attach,
detach, any other action), every PUT and PATCH, and every other DELETE changes
something.

Every request is recorded. One that is neither a vAPI request nor a GET or HEAD (those
read: pyvmomi's `GET /sdk/vimServiceVersions.xml`) is judged as SOAP: a body whose
method it cannot read, any other method with any body, and a POST elsewhere (`/folder`, `/nfc`, a
guest file transfer), is recorded with its request line and counts as a change, never
dropped from the count.

It serves the simulator's own certificate for 127.0.0.1 (the test CA's), so a client
keeps TLS verification on; it runs in the test's event loop (pyvmomi calls from the
backend's threads, so the loop is free to serve them).
"""

from __future__ import annotations

import re
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from tests.support.vsphere.simulator import TlsFiles

_METHOD = re.compile(rb"<(?:[\w-]+:)?Body[^>]*>\s*<(?:[\w-]+:)?([A-Za-z_]\w*)")
_THIS = re.compile(rb"<_this[^>]*\btype=\"(\w+)\"[^>]*>([^<]*)</_this>")
# Headers that belong to one connection, or that the proxy's client sets itself.
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}
)
# What a vSphere read may send; anything else is a change. Kept here, apart from the
# code under test (backends/vsphere/readonly.py), so that the test judges on its own.
READ_METHODS = frozenset(
    {
        "RetrieveServiceContent",
        "Login",
        "Logout",
        "CurrentTime",
        "Fetch",
        "RetrieveProperties",
        "RetrievePropertiesEx",
        "ContinueRetrievePropertiesEx",
        "CancelRetrievePropertiesEx",
        "WaitForUpdatesEx",
        "CancelWaitForUpdates",
        "FindByUuid",
        "FindByInventoryPath",
        "FindChild",
        "CreateContainerView",
        "DestroyView",
        "CreatePropertyCollector",
        "DestroyPropertyCollector",
        "CreateFilter",
        "DestroyPropertyFilter",
    }
)
_SESSION_OBJECTS = ("ContainerView", "PropertyCollector", "PropertyFilter")
_MUTATING = re.compile(
    r"(_Task$|^Reconfig|^Create|^Destroy|^MarkAs|^Rename|^Register|^Unregister|^Move|"
    r"^Power|^Reset|^Set|^Update|^Add|^Remove|^Delete|^Upgrade|^Customize|^Import)"
)


def mutating(method: str) -> bool:
    """Whether a SOAP method changes the inventory: `*_Task`, `Reconfig*`, `Create*` and
    `Destroy*` (but of a session's views and property collectors), `MarkAs*`,
    `Rename*` and the other verbs of change."""
    session_object = method.startswith(("Create", "Destroy")) and method.endswith(
        ("View", "PropertyCollector", "Filter")
    )
    return bool(_MUTATING.search(method)) and not session_object


# The vAPI's session, under /rest (every vCenter since 6.5) and /api (7.0 U2+).
_REST_SESSIONS = frozenset({"/rest/com/vmware/cis/session", "/api/session"})
_REST_PREFIXES = ("/rest/", "/api/")


@dataclass(frozen=True)
class Seen:
    method: str  # the SOAP method; "" when the body held none the proxy could read
    this_type: str
    this_id: str
    request: str = ""  # "PUT /folder/x", for a request that was no readable SOAP call


@dataclass(frozen=True)
class RestSeen:
    method: str  # GET, POST, ...
    path: str
    action: str  # the ?~action= (/rest) or ?action= (/api), "" when none


def rest_mutating(seen: RestSeen) -> bool:
    """Whether a vAPI request changes something (see the module docstring)."""
    if seen.method in ("GET", "HEAD"):
        return False
    if seen.path in _REST_SESSIONS:
        return not (
            (seen.method == "POST" and seen.action in ("", "get")) or seen.method == "DELETE"
        )
    return not (seen.method == "POST" and seen.action.startswith("list-"))


@dataclass
class SoapProxy:
    upstream_port: int
    tls: TlsFiles
    seen: list[Seen] = field(default_factory=list)
    rest: list[RestSeen] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)  # other GETs and HEADs: "GET /path"
    port: int = 0
    # vAPI requests whose path starts with a key are recorded and answered with its
    # status, never forwarded ("" : all of them): a vCenter whose tagging service is
    # gone, refuses, redirects (a 3xx names /elsewhere), or lost one tag.
    rest_answers: dict[str, int] = field(default_factory=dict)
    # Awaited before a vAPI request is forwarded or answered: a test holds one there.
    rest_gate: Callable[[RestSeen], Awaitable[None]] | None = None

    async def start(self) -> None:
        client_tls = ssl.create_default_context(cafile=str(self.tls.ca))
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=client_tls),
            cookie_jar=aiohttp.DummyCookieJar(),  # the client's cookies pass through
            auto_decompress=True,
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_tls.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=server_tls)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._client.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path.startswith(_REST_PREFIXES):
            action = request.query.get("~action") or request.query.get("action") or ""
            seen = RestSeen(request.method, request.path, action)
            self.rest.append(seen)
            if self.rest_gate is not None:
                await self.rest_gate(seen)
            status = next((v for k, v in self.rest_answers.items() if seen.path.startswith(k)), 0)
            if status:
                where = {"Location": "/elsewhere"} if 300 <= status < 400 else {}
                return web.Response(status=status, headers=where)
        elif request.method in ("GET", "HEAD"):
            self.reads.append(f"{request.method} {request.path}")
        elif request.method == "POST":  # a SOAP call is a POST
            self._record(body, f"POST {request.path}")
        else:
            self.seen.append(Seen("", "", "", f"{request.method} {request.path}"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = f"https://127.0.0.1:{self.upstream_port}{request.path_qs}"
        async with self._client.request(
            request.method, url, data=body, headers=headers
        ) as upstream:
            data = await upstream.read()
            answer = web.Response(status=upstream.status, body=data)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP:
                    answer.headers.add(key, value)
            return answer

    def _record(self, body: bytes, request: str) -> None:
        method = _METHOD.search(body)
        if method is None:  # no SOAP call it can read: a change until shown otherwise
            self.seen.append(Seen("", "", "", request))
            return
        this = _THIS.search(body)
        self.seen.append(
            Seen(
                method.group(1).decode(),
                this.group(1).decode() if this else "",
                this.group(2).decode() if this else "",
            )
        )

    def methods(self) -> Counter[str]:
        """SOAP methods by name, and each unreadable request by its request line."""
        return Counter(s.method or s.request for s in self.seen)

    def mutations(self) -> list[Seen]:
        return [s for s in self.seen if not s.method or mutating(s.method)]

    def rest_calls(self) -> Counter[str]:
        """The vAPI requests by "METHOD path[?action]"."""
        return Counter(
            f"{r.method} {r.path}" + (f"?{r.action}" if r.action else "") for r in self.rest
        )

    def rest_mutations(self) -> list[RestSeen]:
        return [r for r in self.rest if rest_mutating(r)]

    def session_objects_ok(self) -> bool:
        """Every Destroy* that passed was of a view or collector."""
        return all(
            s.this_type in _SESSION_OBJECTS for s in self.seen if s.method.startswith("Destroy")
        )


@asynccontextmanager
async def counting_proxy(port: int, tls: TlsFiles) -> AsyncIterator[SoapProxy]:
    """A started `SoapProxy` in front of vcsim's `port`, stopped at the end."""
    counting = SoapProxy(port, tls)
    await counting.start()
    try:
        yield counting
    finally:
        await counting.stop()
