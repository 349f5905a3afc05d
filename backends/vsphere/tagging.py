"""vSphere tags, read (issue 30): vCenter keeps them in its vAPI tagging service (REST),
not in the SOAP inventory a `ReadOnlyVSphere` reads, so a migration plan reads them here.

Read-only by construction, as the SOAP session is: `TagReader` can send exactly five
requests and none of them changes the inventory:

- `POST /rest/com/vmware/cis/session` (basic auth): the login, which makes a session
  and nothing else;
- `POST /rest/com/vmware/cis/tagging/tag-association?~action=list-attached-tags-on-objects`:
  the tags of many objects in one request (the vAPI spells this read as a POST, its
  object list being the body);
- `GET .../tagging/tag/id:ID` and `GET .../tagging/category/id:ID`: the name and the
  category of each tag found, each read once per reader;
- `DELETE /rest/com/vmware/cis/session`: the logout, which ends the login's session.

It has no method that attaches, detaches, creates or deletes anything, and no way to
send another path or action: each is a constant here.

`/rest` rather than the newer `/api` (vSphere 7.0 U2+): `/rest` is served by every
vCenter from 6.5 through 8, and it is the one the simulator the tests use (vcsim 0.24)
implements; `/api` is not there.

Errors at the boundary: a server without the service (a standalone ESXi host, a
vCenter whose vAPI endpoint answers 404) or one that refuses the user (401, 403) is
`TagsUnreadable`, which the plan reports as "tags not readable: <why>" rather than
failing, as is a redirect (never followed: the reader talks to the server named, and
its session header goes nowhere else); a tag (or its category) deleted between the
batch that named it and its `GET` (404) is left out, as it is no longer attached; a
server that does not answer (refused, timed out, 5xx) is `Unreachable`, as
for SOAP; a TLS refusal is a `PermanentError` saying what to fix.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections import Counter
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import aiohttp

from backends.advice import tls_advice
from backends.base import PermanentError, Unreachable
from backends.vsphere.session import Endpoint
from bot.models.errors import BackendError

SESSION = "/rest/com/vmware/cis/session"
ASSOCIATION = "/rest/com/vmware/cis/tagging/tag-association"
TAG = "/rest/com/vmware/cis/tagging/tag"
CATEGORY = "/rest/com/vmware/cis/tagging/category"
ATTACHED_ON_OBJECTS = "list-attached-tags-on-objects"
SESSION_HEADER = "vmware-api-session-id"
# Objects per batch: one request for a plan's every VM or template up to this many
# (a request body of ~50 bytes per object).
BATCH_OBJECTS = 2000
LOGOUT_TIMEOUT_S = 5
# A tag as the plan keeps it: "Category/Tag".
SEPARATOR = "/"


class TagsUnreadable(PermanentError):
    """The server has no tagging service this user may read: a plan says so and goes on."""


# What `_send` answers for a tag or category read by its id that is not there (404:
# deleted since the batch that named it).
_GONE = object()


class TagReader:
    """One vAPI session that reads the tags attached to VMs and templates, and nothing
    else (see the module docstring). Used once per plan or check: `async with`."""

    def __init__(self, endpoint: Endpoint, password: str, tls: ssl.SSLContext) -> None:
        self._endpoint = endpoint
        self._password = password  # only ever handed to the login's basic auth
        self._tls = tls
        self._base = f"https://{endpoint.host}:{endpoint.port}"
        self._http: aiohttp.ClientSession | None = None
        self._session_id: str | None = None
        self._names: dict[str, str | None] = {}  # tag id -> "Category/Tag", None: gone
        self._categories: dict[str, str] = {}  # category id -> its name
        self.calls: Counter[str] = Counter()  # requests sent, by what they are

    async def __aenter__(self) -> TagReader:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def attached(self, vm_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The tags ("Category/Tag", sorted) of each VM or template by managed object id
        (vm-42); one without tags has an empty tuple. Logs in on first use."""
        found: dict[str, tuple[str, ...]] = {vm: () for vm in vm_ids}
        if not vm_ids:
            return found
        if self._session_id is None:
            await self._login()
        for start in range(0, len(vm_ids), BATCH_OBJECTS):
            chunk = vm_ids[start : start + BATCH_OBJECTS]
            for vm, tag_ids in (await self._attached_ids(chunk)).items():
                if vm in found:
                    names = [await self._name(t) for t in tag_ids]
                    found[vm] = tuple(sorted({n for n in names if n is not None}))
        return found

    async def close(self) -> None:
        """Log out (when logged in) and close the connections; never raises."""
        session, self._session_id = self._session_id, None
        try:
            # A logout that fails ends with the session's idle timeout on the server.
            if session is not None and self._http is not None:
                with contextlib.suppress(BackendError, TimeoutError):
                    async with asyncio.timeout(LOGOUT_TIMEOUT_S):
                        await self._send("DELETE", SESSION, "logout", session=session)
        finally:
            http, self._http = self._http, None
            if http is not None:
                await http.close()

    async def _login(self) -> None:
        # Basic auth by hand: aiohttp 3.14 deprecates its helpers, >= 3.9 lacks the new one.
        pair = f"{self._endpoint.user}:{self._password}".encode()
        basic = "Basic " + base64.b64encode(pair).decode("ascii")
        value = await self._send("POST", SESSION, "login", authorization=basic)
        if not isinstance(value, str) or not value:
            raise TagsUnreadable(f"{self._where}: the vAPI login answered no session id")
        self._session_id = value

    async def _attached_ids(self, vm_ids: Sequence[str]) -> dict[str, list[str]]:
        body = {"object_ids": [{"type": "VirtualMachine", "id": vm} for vm in vm_ids]}
        value = await self._send(
            "POST", ASSOCIATION, ATTACHED_ON_OBJECTS, params={"~action": ATTACHED_ON_OBJECTS},
            json=body, session=self._session_id,
        )  # fmt: skip
        ids: dict[str, list[str]] = {}
        for item in value if isinstance(value, list) else []:
            obj = item.get("object_id") if isinstance(item, dict) else None
            if isinstance(obj, dict) and obj.get("type") == "VirtualMachine":
                ids[str(obj.get("id"))] = [str(t) for t in item.get("tag_ids") or []]
        return ids

    async def _name(self, tag_id: str) -> str | None:
        """'Category/Tag'; None when the tag or its category was deleted since the batch."""
        if tag_id not in self._names:
            self._names[tag_id] = await self._read_name(tag_id)
        return self._names[tag_id]

    async def _read_name(self, tag_id: str) -> str | None:
        tag = await self._get(TAG, tag_id, "tag")
        if tag is None:
            return None
        category_id = str(tag.get("category_id") or "")
        if category_id not in self._categories:
            category = await self._get(CATEGORY, category_id, "category")
            if category is None:
                return None
            self._categories[category_id] = str(category.get("name") or category_id)
        return f"{self._categories[category_id]}{SEPARATOR}{tag.get('name') or tag_id}"

    async def _get(self, path: str, object_id: str, what: str) -> dict[str, Any] | None:
        """The object by its id; None when it is gone (deleted since the batch)."""
        value = await self._send("GET", f"{path}/id:{object_id}", what, session=self._session_id)
        if value is _GONE:
            return None
        if not isinstance(value, dict):
            raise TagsUnreadable(f"{self._where}: the vAPI answered no {what} for {object_id}")
        return value

    @property
    def _where(self) -> str:
        return self._endpoint.where

    async def _send(
        self,
        method: str,
        path: str,
        what: str,
        *,
        session: str | None = None,
        authorization: str | None = None,
        params: dict[str, str] | None = None,
        json: Any = None,
    ) -> Any:
        """One request; its answer's `value`. Errors become the project's (see the
        module docstring)."""
        http = self._client()
        headers = {SESSION_HEADER: session} if session else {}
        if authorization is not None:
            headers["Authorization"] = authorization
        self.calls[f"{method} {what}"] += 1
        try:
            async with http.request(
                method, self._base + path, headers=headers, params=params, json=json,
                allow_redirects=False,  # the session id goes to the server named, only
            ) as answer:  # fmt: skip
                if answer.status == 404 and method == "GET":  # a tag or category, by id
                    return _GONE
                _check(answer.status, self._endpoint, what)
                data = await answer.json(content_type=None) if method != "DELETE" else {}
        except aiohttp.ClientConnectorCertificateError as exc:
            ep = self._endpoint
            error = exc.certificate_error
            if not isinstance(error, ssl.SSLError):
                error = ssl.SSLError(str(error))
            raise PermanentError(tls_advice(ep.name, ep.where, ep.ca_bundle, error)) from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unreachable(f"{self._where} does not answer the {what} ({exc})") from None
        except ValueError:  # not JSON
            raise TagsUnreadable(f"{self._where} answers the {what} with no vAPI JSON") from None
        return data.get("value") if isinstance(data, dict) else None

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._tls, limit=2),
                timeout=aiohttp.ClientTimeout(total=self._endpoint.request_timeout_s),
                cookie_jar=aiohttp.DummyCookieJar(),  # the session id goes in its header
                raise_for_status=False,
            )
        return self._http


def _check(status: int, endpoint: Endpoint, what: str) -> None:
    """A refusal as the project's error (see the module docstring)."""
    where = endpoint.where
    if status == 404:
        raise TagsUnreadable(
            f"{where} has no vAPI tagging service (its /rest {what} answers 404: a "
            "standalone ESXi host, or a vCenter without the vAPI endpoint)"
        )
    if status in (401, 403):
        raise TagsUnreadable(
            f"{where} refuses the vAPI {what} to {endpoint.user} ({status}): tags need "
            "a user that may log in to the vAPI and read them (System.Read)"
        )
    if status >= 500:
        raise Unreachable(f"{where} answers {status} to the {what}")
    if 300 <= status < 400:
        raise TagsUnreadable(
            f"{where} answers the vAPI {what} with a redirect ({status}), which is not "
            "followed: tags are read from the server named in the backend's url only"
        )
    if status >= 400:
        raise TagsUnreadable(f"{where} answers {status} to the {what}")
