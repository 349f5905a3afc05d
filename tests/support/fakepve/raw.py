"""A bare HTTPS client for the fake Proxmox API (requests sent raw, many wrong on
purpose, exempt from the session's "every request was valid" check), and checks of its
answers against the schema: shared by the tests of the fake itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.support.fakepve.server import EXEMPT_HEADER, FakePVE


@dataclass
class Answer:
    status: int
    reason: str
    body: dict[str, Any]

    @property
    def data(self) -> Any:
        return self.body["data"]


class Raw:
    """A bare HTTPS client for the fake; token auth unless told otherwise."""

    def __init__(self, session: aiohttp.ClientSession, fake: FakePVE) -> None:
        self.session = session
        self.fake = fake
        self.token = f"PVEAPIToken={fake.token_id}={fake.token_secret}"

    async def call(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        *,
        auth: bool = True,
        headers: dict[str, str] | None = None,
        cookies: dict[str, str] | None = None,
    ) -> Answer:
        sent = {EXEMPT_HEADER: "1", **(headers or {})}
        if auth:
            sent["Authorization"] = self.token
        query = params if method in ("GET", "DELETE") else None
        form = params if method in ("POST", "PUT") else None
        async with self.session.request(
            method, self.fake.url + path, params=query, data=form, headers=sent, cookies=cookies
        ) as response:
            return Answer(response.status, response.reason or "", await response.json())

    async def task(self, upid: str) -> dict[str, Any]:
        """Wait for a task on the fake's own event, then read its status."""
        await self.fake.cluster.task(upid).done.wait()
        status: dict[str, Any] = (await self.call("GET", f"/nodes/pve1/tasks/{upid}/status")).data
        return status


async def linked_clone(raw: Raw, newid: int = 120, template: int = 9000) -> str:
    answer = await raw.call(
        "POST", f"/nodes/pve1/qemu/{template}/clone", {"newid": str(newid), "name": "t1"}
    )
    assert answer.status == 200, answer
    return str(answer.data)


def shape_problems(spec: dict[str, Any], value: Any, where: str = "data") -> list[str]:
    """Where an answer differs from the schema's `returns` (types, enums, required keys).
    Perl's JSON writes booleans as 0/1, so those count as booleans."""
    kinds: dict[str, tuple[type, ...]] = {
        "integer": (int,),
        "number": (int, float),
        "string": (str,),
        "boolean": (bool, int),
        "array": (list,),
        "object": (dict,),
        "null": (type(None),),
    }
    kind = spec.get("type")
    if kind in kinds and not isinstance(value, kinds[kind]):
        return [f"{where}: {type(value).__name__} where the schema says {kind}"]
    if "enum" in spec and value not in spec["enum"]:
        return [f"{where}: {value!r} is not one of {spec['enum']}"]
    found: list[str] = []
    if isinstance(value, list):
        for i, item in enumerate(value):
            found += shape_problems(spec.get("items", {}), item, f"{where}[{i}]")
    if isinstance(value, dict):
        for key, sub in (spec.get("properties") or {}).items():
            if key in value:
                found += shape_problems(sub, value[key], f"{where}.{key}")
            elif not sub.get("optional"):
                found.append(f"{where}.{key}: missing")
    return found
