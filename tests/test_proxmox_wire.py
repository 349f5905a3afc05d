"""Every request the Proxmox backend sent in the whole test session, checked against the
real API schema (`../shared/reference/pve-api-subset.json`).

The fake servers of every test record what they received in `SESSION_REQUESTS`; this
module sorts after the other Proxmox tests, so by the time it runs they have all sent
theirs. It also drives a deploy of its own first, so it checks something when run
alone. The check is independent of the fake's own validation: each request's parameters
are typed and validated with `jsonschema` against a JSON Schema built from the PVE one.
Where the reference data is missing it skips, except in CI (DEPLOYBOT_REQUIRE_REFERENCE=1).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from typing import Any

import jsonschema

from backends.base import CloneSpec, Identity
from tests.support.fakepve import testing
from tests.support.fakepve.formats import FORMATS
from tests.support.fakepve.schema import ADDED_IN, ApiSchema, check_property_string
from tests.support.fakepve.server import SESSION_REQUESTS, Recorded, Tls
from tests.support.fakepve.testing import make_backend, start_fake

# The fake server's fixtures, shared by the Proxmox test modules.
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

# What a deploy and its rollback use: the check must have seen each of them.
USED = {
    ("GET", "/version"),
    ("GET", "/cluster/status"),
    ("GET", "/cluster/resources"),
    ("GET", "/cluster/nextid"),
    ("GET", "/nodes"),
    ("GET", "/nodes/{node}/status"),
    ("GET", "/nodes/{node}/capabilities/qemu/cpu"),
    ("GET", "/nodes/{node}/storage"),
    ("GET", "/nodes/{node}/network"),
    ("POST", "/access/ticket"),
    ("POST", "/nodes/{node}/qemu/{vmid}/clone"),
    ("GET", "/nodes/{node}/qemu/{vmid}/config"),
    ("POST", "/nodes/{node}/qemu/{vmid}/config"),
    ("PUT", "/nodes/{node}/qemu/{vmid}/resize"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/start"),
    ("GET", "/nodes/{node}/qemu/{vmid}/status/current"),
    ("GET", "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces"),
    ("POST", "/nodes/{node}/qemu/{vmid}/status/stop"),
    ("DELETE", "/nodes/{node}/qemu/{vmid}"),
    ("GET", "/nodes/{node}/tasks"),
    ("GET", "/nodes/{node}/tasks/{upid}/status"),
    ("GET", "/nodes/{node}/tasks/{upid}/log"),
}
IDENTITY = Identity(
    hostname="wire01",
    user="ubuntu",
    ssh_keys=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 me@host",
    ),
    address=ipaddress.IPv4Interface("10.0.0.77/24"),
    gateway=ipaddress.IPv4Address("10.0.0.1"),
    dns=(ipaddress.IPv4Address("10.0.0.2"),),
    search_domain="lab.example",
    upgrade=True,
    cores=2,
    memory_mib=2048,
)


async def exercise(schema: ApiSchema, tls: Tls) -> None:
    """A deploy and rollback with ticket auth, a full clone, a failing task and the CPU
    fallback, so every endpoint the backend uses has been sent at least once."""
    async with start_fake(schema, tls) as fake:
        fake.cluster.nodes["pve1"].flags = None
        fake.inject("start", "task_error")
        backend = make_backend(fake, auth="password")
        try:
            await backend.templates()
            await backend.storages()
            await backend.networks()
            spec = CloneSpec("jwire01", "wire01", "rocky-9", storage="bulk-nfs")
            ref = await backend.prepare_clone(spec)
            other = CloneSpec("jwire02", "wire02", "debian-12")
            other_ref = await backend.prepare_clone(other)
            # Two waits at once: they share the poll of the node's running tasks.
            await asyncio.gather(backend.clone(spec, ref), backend.clone(other, other_ref))
            await backend.destroy(other_ref)
            await backend.apply_identity(ref, IDENTITY)
            await backend.grow_disk(ref, 3)
            try:
                await backend.power_on(ref)
            except Exception:  # the planted task error: its log is read
                await backend.power_on(ref)
            await backend.wait_for_address(ref, IDENTITY.address.ip)
            await backend.power_off(ref)
            await backend.destroy(ref)
        finally:
            await backend.close()


def _typed(spec: dict[str, Any], value: str) -> Any:
    """A wire string as the JSON value its type names (left a string when it is not one)."""
    kind = spec.get("type")
    if kind == "integer" and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    if kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", value):
        return float(value)
    if kind == "boolean" and value.lower() in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    return value


def _json_schema(
    spec: dict[str, Any], key: str, checker: jsonschema.FormatChecker
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": spec.get("type", "string")}
    for name in ("enum", "maxLength", "minLength"):
        if name in spec:
            out[name] = spec[name]
    for name in ("minimum", "maximum"):
        if name in spec:
            out[name] = float(spec[name])
    if "pattern" in spec:
        out["pattern"] = "^(?:" + str(spec["pattern"]).replace("(?^:", "(?:") + ")$"
    fmt = spec.get("format")
    if isinstance(fmt, dict):
        checker.checks(key)(
            lambda v, fmt=fmt: not isinstance(v, str) or check_property_string(fmt, v) is None
        )
        out["format"] = key
    elif isinstance(fmt, str):
        # A format nobody can verify fails: an unchecked value must not pass as checked.
        checker.checks(fmt)(lambda v, fmt=fmt: fmt in FORMATS and FORMATS[fmt](str(v)) is None)
        out["format"] = fmt
    return out


def _declared(declared: dict[str, Any], key: str) -> dict[str, Any]:
    """The schema of parameter `key`, by its name or its `name[n]` family ({}: none)."""
    if key in declared:
        spec: dict[str, Any] = declared[key]
        return spec
    for name, spec in declared.items():
        if name.endswith("[n]") and re.fullmatch(f"{name[:-3]}\\d+", key):
            return spec
    return {}


def problems(schema: ApiSchema, request: Recorded) -> list[str]:
    if request.template is None:
        return ["not a route of the API"]
    info = schema.method(request.template, request.method)
    if info is None:
        return [f"no {request.method} on {request.template}"]
    declared: dict[str, Any] = info["parameters"].get("properties", {}) or {}
    checker = jsonschema.FormatChecker(formats=())
    properties: dict[str, Any] = {}
    patterns: dict[str, Any] = {}
    for name, spec in declared.items():
        key = f"{request.method} {request.template} {name}"
        if name.endswith("[n]"):
            patterns[f"^{name[:-3]}\\d+$"] = _json_schema(spec, key, checker)
        else:
            properties[name] = _json_schema(spec, key, checker)
    document = {
        "type": "object",
        "properties": properties,
        "patternProperties": patterns,
        "additionalProperties": False,
        "required": [n for n, s in declared.items() if not s.get("optional") and "[n]" not in n],
    }
    values = {**request.params, **request.path_params}
    typed = {k: _typed(_declared(declared, k), v) for k, v in values.items()}
    for k in typed:  # an array parameter: every value its repeated key carried
        if _declared(declared, k).get("type") == "array":
            typed[k] = request.lists.get(k, [values[k]])
    validator = jsonschema.Draft202012Validator(document, format_checker=checker)
    return [
        f"{'/'.join(map(str, e.path)) or '-'}: {e.message}" for e in validator.iter_errors(typed)
    ]


async def test_every_request_the_backend_sent_is_valid_against_the_real_schema(
    pve_schema: ApiSchema,
    pve_tls: Tls,
) -> None:
    await exercise(pve_schema, pve_tls)
    sent = [r for r in SESSION_REQUESTS if not r.exempt]
    found = [f"{r.method} {r.path} {r.params}: {p}" for r in sent for p in problems(pve_schema, r)]
    assert found == []
    assert {(r.method, r.template) for r in sent} >= USED
    config = pve_schema.method("/nodes/{node}/qemu/{vmid}/config", "POST")
    assert config is not None and set(ADDED_IN) <= set(config["parameters"]["properties"])


def test_the_check_itself_finds_bad_requests(pve_schema: ApiSchema) -> None:
    def bad(params: dict[str, str]) -> list[str]:
        request = Recorded(
            "POST",
            "/nodes/pve1/qemu/101/config",
            "/nodes/{node}/qemu/{vmid}/config",
            params,
            {"node": "pve1", "vmid": "101"},
            200,
            False,
            0.0,
        )
        return problems(pve_schema, request)

    assert (
        bad(
            {
                "cores": "2",
                "sshkeys": "ssh-ed25519%20AAAA",
                "ipconfig0": "ip=10.0.0.5/24,gw=10.0.0.1",
            }
        )
        == []
    )
    assert bad({"bogus": "1"}) and bad({"cores": "zero"}) and bad({"cores": "0"})
    assert bad({"sshkeys": "ssh-ed25519 AAAA"}) and bad({"ipconfig0": "ip=10.0.0.5"})
    assert bad({"net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0,tag=9999"})
    assert bad({"citype": "cloud"}) and bad({"agent": "maybe"})
