"""The fake Proxmox VE API over HTTPS on 127.0.0.1 (aiohttp), for tests, the benchmark
and the docs' demo (docs/backends.md).

Every request is authenticated (API token, or ticket cookie with the CSRF header on
writes), checked against the real schema (400 `Parameter verification failed.` with the
`errors` map), then answered by `ops.ENDPOINTS`; failures are HTTP 500 with the message
as the reason phrase and `{"data": null}`, as pve-http-server does. Every request is
recorded (method, path, parameters), here and in `SESSION_REQUESTS`, so a test can check
all the requests a whole test session sent against the schema.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import trustme
from aiohttp import BodyPartReader, web

from tests.support.fakepve.acl import ENFORCED, Acl, agent_privileges
from tests.support.fakepve.cluster import Cluster, FaultKind, Timings
from tests.support.fakepve.errors import ApiError
from tests.support.fakepve.guest import Guest
from tests.support.fakepve.machines import Machines
from tests.support.fakepve.ops import ENDPOINTS, Call
from tests.support.fakepve.schema import ApiSchema
from tests.support.jumphost import JumpHost

EXEMPT_HEADER = "X-Fake-Exempt"  # a test's deliberate bad request: not the backend's


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    template: str | None
    params: dict[str, str]
    path_params: dict[str, str]
    status: int
    exempt: bool
    at_s: float  # loop time the request arrived
    # Every value of each parameter: an array parameter (exec's `command`) is the same key
    # repeated on the wire, and `params` keeps only one of them.
    lists: dict[str, list[str]] = field(default_factory=dict)


SESSION_REQUESTS: list[Recorded] = []


@dataclass(frozen=True)
class Tls:
    server: ssl.SSLContext
    ca_path: Path


def make_tls(directory: Path) -> Tls:
    """A throwaway CA and a certificate for 127.0.0.1; clients trust `ca_path`."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    path = directory / "fake-pve-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return Tls(context, path)


class FakePVE:
    def __init__(
        self,
        schema: ApiSchema,
        tls: Tls,
        *,
        cluster: Cluster | None = None,
        timings: Timings | None = None,
        release: str = "8.2",
        cluster_name: str | None = "lab",
        ssh_port: int | None = None,
        machines: Callable[[Cluster], Machines] | None = None,
        jump_dir: Path | None = None,
        user: str = "root@pam",
        token_name: str = "deploybot",
        token_secret: str | None = None,
        password: str | None = None,
        auth_fail_delay_s: float = 3.0,
        ticket_lifetime_s: float = 7200.0,
        record_session: bool = True,
        state_dir: Path | None = None,
    ) -> None:
        self.schema = schema
        self.tls = tls
        guest = Guest(ssh_port, behind_jump=jump_dir is not None)
        self.cluster = cluster or Cluster.standard(
            timings=timings, release=release, cluster_name=cluster_name, guest=guest
        )
        if state_dir is not None:  # uploaded files go there
            self.cluster.state_dir = state_dir
        if machines is not None:  # real guests (`realvm.RealMachines`), say
            self.cluster.machines = machines(self.cluster)
        # Guests outside 127.0.0.0/8 answer SSH only through this lab's jump host.
        self.jump = (
            None
            if jump_dir is None
            else JumpHost(
                jump_dir,
                self.cluster.machines.route,
                await_banner=self.cluster.machines.accepts_early,
            )
        )
        self.user = user
        self.token_id = f"{user}!{token_name}"
        self.token_secret = token_secret or secrets.token_hex(16)
        self.password = password or secrets.token_urlsafe(12)
        self.auth_fail_delay_s = auth_fail_delay_s
        self.ticket_lifetime_s = ticket_lifetime_s
        self.record_session = record_session
        self.requests: list[Recorded] = []
        # What GET /access/permissions answers (and the agent's file and exec endpoints
        # check); tests revoke from it.
        self.acl = Acl(self.cluster.release_tuple)
        self.clock_offset_s = 0.0
        self._tickets: dict[str, tuple[str, float, str]] = {}  # ticket -> user, issued, csrf
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._in_flight = 0
        self.peak_in_flight = 0  # the most requests it answered at once (tests set 0)
        self._idle = asyncio.Condition()

    # --- life cycle ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakePVE:
        if not host.startswith("127."):
            raise ValueError("the fake Proxmox listens on 127.0.0.0/8 only")
        app = web.Application()
        app.router.add_route("*", "/api2/json/{tail:.*}", self._api)
        app.router.add_get("/_fake/tasks", self._tasks)
        app.router.add_post("/_fake/inject", self._inject)
        app.router.add_post("/_fake/revoke", self._revoke)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.tls.server)
        await site.start()
        self.port = self._runner.addresses[0][1]
        if self.jump is not None:
            await self.jump.start(host)
        return self

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/api2/json"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.jump is not None:
            await self.jump.close()
        await self.cluster.close()

    async def __aenter__(self) -> FakePVE:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- test controls ------------------------------------------------------------------

    def inject(self, endpoint: str, kind: FaultKind, times: int = 1, **options: Any) -> None:
        """A fault for the next `times` calls of an endpoint (see `ops.ENDPOINTS`), or
        with `for_s=` for every call during that long from the first one it answers."""
        known = {name for name, _handler in ENDPOINTS.values()} | {"ticket"}
        if endpoint not in known:
            raise ValueError(f"unknown endpoint {endpoint!r}; one of {sorted(known)}")
        self.cluster.inject(endpoint, kind, times, **options)

    def now(self) -> float:
        return time.monotonic() + self.clock_offset_s

    def advance_clock(self, seconds: float) -> None:
        """Let the server's clock (ticket ages) jump ahead."""
        self.clock_offset_s += seconds

    async def settled(self) -> None:
        """Wait until no request is being answered and no task is running."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._in_flight == 0)
        await asyncio.gather(*(t.done.wait() for t in list(self.cluster.tasks.values())))

    async def answered(self, check: Callable[[], bool]) -> None:
        """Wait until `check()` holds, looking again after each answered request: a test
        acts on the server at a moment the client brought about, without sleeping."""
        async with self._idle:
            await self._idle.wait_for(check)

    def sent(self, method: str, template: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.template == template]

    # --- requests -----------------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.Response:
        # Routed on the path as sent: a volume id in it (`local%3Aimport%2Fx.qcow2`) is
        # one segment, decoded once matched.
        raw_path = "/" + request.rel_url.raw_path.removeprefix("/api2/json/").rstrip("/")
        path = unquote(raw_path)
        method = request.method
        upload: Path | None = None
        if method == "POST" and request.content_type == "multipart/form-data":
            params, upload = await self._multipart(request)
            lists = {k: [v] for k, v in params.items()}
        else:
            raw = request.query if method in ("GET", "DELETE") else await request.post()
            params = {k: str(v) for k, v in raw.items()}
            # An array parameter (exec's `command`) is the same key repeated.
            lists = {k: [str(v) for v in raw.getall(k)] for k in raw}
        route = self.schema.route(raw_path)
        status = 499  # until answered: a client that gave up (nginx's code for it)
        arrived = asyncio.get_running_loop().time()
        self._in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        try:
            data = await self._answer(request, method, path, params, route, upload, lists)
            status = 200
            return web.json_response({"data": data})
        except ApiError as exc:
            status = exc.status
            body: dict[str, Any] = {"data": None}
            if exc.errors:
                body["errors"] = exc.errors
            reason = exc.reason.splitlines()[0] if exc.reason else "error"
            return web.Response(
                status=status, reason=reason, text=json.dumps(body), content_type="application/json"
            )
        finally:
            if upload is not None:
                upload.unlink(missing_ok=True)  # kept only when a task took it
            record = Recorded(
                method,
                path,
                route.template if route else None,
                params,
                route.params if route else {},
                status,
                EXEMPT_HEADER in request.headers,
                arrived,
                lists,
            )
            self.requests.append(record)
            if self.record_session:
                SESSION_REQUESTS.append(record)
            await self._done_one()

    async def _multipart(self, request: web.Request) -> tuple[dict[str, str], Path | None]:
        """A multipart form as pveproxy reads one (an upload): each field's text, and
        the file part streamed to `/var/tmp/pveupload-<hex>` (here: under the state
        dir), its name as the value of its field (`filename`)."""
        params: dict[str, str] = {}
        upload: Path | None = None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader) or part.name is None:
                continue
            if part.filename is None:
                params[part.name] = await part.text()
                continue
            folder = self.cluster.files() / "tmp"
            folder.mkdir(parents=True, exist_ok=True)
            upload = folder / f"pveupload-{secrets.token_hex(8)}"
            with upload.open("wb") as out:
                while chunk := await part.read_chunk():
                    out.write(chunk)
            params[part.name] = part.filename
        return params, upload

    async def _done_one(self) -> None:
        async with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    async def _answer(
        self,
        request: web.Request,
        method: str,
        path: str,
        params: dict[str, str],
        route: Any,
        upload: Path | None = None,
        lists: dict[str, list[str]] | None = None,
    ) -> Any:
        info = self.schema.method(route.template, method) if route else None
        if route is None or info is None:
            raise ApiError(501, f"Method '{method} {path}' not implemented")
        if route.template == "/access/ticket" and method == "POST":
            self._verify(route.template, method, params, route.params)
            return await self._login(params)
        user = await self._authenticate(request, method, info)
        self._verify(route.template, method, params, route.params)
        if (method, route.template) == ("GET", "/access/permissions"):
            return self.acl.answer(params, user)
        if (method, route.template) not in ENDPOINTS:
            raise ApiError(501, f"Method '{method} {path}' not implemented")
        if route.template in ENFORCED:
            self._permitted(info, route.params, user)
        endpoint, handler = ENDPOINTS[(method, route.template)]
        if route.params.get("node") in self.cluster.offline:
            # What pveproxy answers for a node it cannot reach.
            raise ApiError(595, f"Connection refused (node {route.params['node']} is offline)")
        fault = self.cluster.take(endpoint, ("delay", "error", "lock_timeout"))
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
        elif fault is not None and fault.kind == "error":
            raise ApiError(fault.status, fault.message or "injected failure", fault.errors)
        elif fault is not None:
            vmid = route.params.get("vmid", "0")
            lock = (
                fault.message
                or f"can't lock file '/var/lock/qemu-server/lock-{vmid}.conf' - got timeout"
            )
            raise ApiError(500, lock)
        return await handler(Call(self.cluster, params, route.params, user, upload, lists or {}))

    def _permitted(self, info: dict[str, Any], path_params: dict[str, str], user: str) -> None:
        """The endpoint's permission check, with the privileges of the server's release."""
        check = info["permissions"]["check"]
        where, privileges, any_of = agent_privileges(check, self.cluster.release_tuple)
        self.acl.check(user, where.format(**path_params), privileges, any_of)

    def _verify(
        self, template: str, method: str, params: dict[str, str], path_params: dict[str, str]
    ) -> None:
        errors = self.schema.check(
            template, method, {**params, **path_params}, self.cluster.release_tuple
        )
        if errors:
            raise ApiError(400, "Parameter verification failed.", errors)

    # --- auth ---------------------------------------------------------------------------

    async def _authenticate(self, request: web.Request, method: str, info: dict[str, Any]) -> str:
        header = request.headers.get("Authorization", "")
        if header.startswith("PVEAPIToken="):
            token_id, _, secret = header.removeprefix("PVEAPIToken=").partition("=")
            if token_id != self.token_id or not hmac.compare_digest(secret, self.token_secret):
                await asyncio.sleep(self.auth_fail_delay_s)
                raise ApiError(401, "authentication failure")
            if not info.get("allowtoken", 1):
                raise ApiError(403, f"Permission check failed ({token_id}, API tokens not allowed)")
            return token_id
        cookie = request.cookies.get("PVEAuthCookie")
        if not cookie:
            raise ApiError(401, "No ticket")
        user = self._ticket_user(cookie)
        if user is None:
            await asyncio.sleep(self.auth_fail_delay_s)
            raise ApiError(401, "authentication failure")
        if method != "GET":
            csrf = request.headers.get("CSRFPreventionToken", "")
            if not hmac.compare_digest(csrf, self._tickets[cookie][2]):
                raise ApiError(401, "Permission denied - invalid csrf token")
        return user

    def _ticket_user(self, ticket: str) -> str | None:
        entry = self._tickets.get(ticket)
        if entry is None or self.now() - entry[1] > self.ticket_lifetime_s:
            return None
        return entry[0]

    async def _login(self, params: dict[str, str]) -> dict[str, Any]:
        user = params["username"]
        if "@" not in user and "realm" in params:
            user = f"{user}@{params['realm']}"
        password = params["password"]
        good = user == self.user and hmac.compare_digest(password, self.password)
        if not (good or self._ticket_user(password) == user):  # a valid ticket renews itself
            await asyncio.sleep(self.auth_fail_delay_s)
            raise ApiError(401, "authentication failure")
        stamp = f"{int(time.time()):08X}"
        signature = base64.b64encode(secrets.token_bytes(48)).decode()
        ticket = f"PVE:{user}:{stamp}::{signature}"
        csrf = f"{stamp}:{base64.b64encode(secrets.token_bytes(24)).decode()}"
        self._tickets[ticket] = (user, self.now(), csrf)
        answer: dict[str, Any] = {"username": user, "ticket": ticket, "CSRFPreventionToken": csrf}
        if self.cluster.cluster_name:
            answer["clustername"] = self.cluster.cluster_name
        return answer

    # --- control endpoints (outside /api2, for the benchmark and demos) -----------------

    async def _tasks(self, request: web.Request) -> web.Response:
        tasks = [
            {
                "upid": t.upid,
                "type": t.type,
                "id": t.id,
                "began_s": t.began_s,
                "ended_s": t.ended_s,
                "exitstatus": t.exitstatus,
                "vmid": t.vmid,
            }
            for t in self.cluster.tasks.values()
        ]
        # Every request's route, arrival and VM, for the benchmark's breakdown and API span.
        requests = [
            [f"{r.method} {r.template or r.path}", r.at_s, r.path_params.get("vmid")]
            for r in self.requests
        ]
        return web.json_response({"tasks": tasks, "requests": requests})

    async def _inject(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            self.inject(body.pop("endpoint"), body.pop("kind"), int(body.pop("times", 1)), **body)
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    async def _revoke(self, request: web.Request) -> web.Response:
        """{"privilege": "VM.Clone", "path": "/vms/100"} (no path: everywhere)."""
        body = await request.json()
        if not isinstance(body.get("privilege"), str):
            return web.json_response({"error": "privilege: a string"}, status=400)
        self.acl.revoke(body["privilege"], body.get("path"))
        return web.json_response({"ok": True})
