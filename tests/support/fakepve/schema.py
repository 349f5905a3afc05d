"""Request checking against the real PVE API schema (`pve-api-subset.json`).

Mirrors pve-common's `PVE::JSONSchema::validate` for request parameters: every
parameter must be declared (`additionalProperties: 0`), required ones present, and each
value (a string on the wire) must pass its type, range, length, enum, pattern and
format, including property strings (`net0: virtio=..,bridge=..`) whose keys are checked
one by one. Messages are the server's own, so the fake's 400 answers read like it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from tests.support.fakepve.formats import FORMATS, UNKNOWN

_BOOL = re.compile(r"1|0|true|false|yes|no|on|off", re.I)
_INT = re.compile(r"[+-]?\d+")
_NUM = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_ARRAY = re.compile(r"([a-z]+)(\d+)")
# Parameters that appeared in a release; older servers refuse them as unknown.
ADDED_IN = {"ciupgrade": (8, 0)}
# The same, for one endpoint: the agent's file-read, qemu-server 9.1.5 (supplement.json).
_FILE_READ = "/nodes/{node}/qemu/{vmid}/agent/file-read"
ADDED_TO = {(_FILE_READ, name): (9, 1) for name in ("count", "decode", "offset")}
# Endpoints the reference subset lacks, taken from the PVE sources (see its `_source`):
# merged in, never overriding the reference.
SUPPLEMENT = Path(__file__).with_name("supplement.json")


def with_supplement(raw: dict[str, Any]) -> dict[str, Any]:
    extra = json.loads(SUPPLEMENT.read_text(encoding="utf-8"))
    added = {k: v for k, v in extra.items() if k.startswith("/") and k not in raw}
    return {**raw, **added}


@dataclass(frozen=True)
class Route:
    template: str  # the schema's path, e.g. /nodes/{node}/qemu/{vmid}/config
    params: dict[str, str]  # values of its {placeholders}


def _perl_regex(pattern: str) -> re.Pattern[str]:
    """Schema patterns are Perl: `(?^:...)` is a plain group in Python."""
    return re.compile(pattern.replace("(?^:", "(?:").replace(r"\z", r"\Z"))


class ApiSchema:
    def __init__(self, raw: dict[str, Any]) -> None:
        raw = with_supplement(raw)
        self.raw = raw
        self._routes: list[tuple[re.Pattern[str], str]] = []
        for path in raw:
            regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path))
            self._routes.append((re.compile(regex), path))

    def route(self, path: str) -> Route | None:
        for regex, template in self._routes:
            match = regex.fullmatch(path)
            if match:
                return Route(template, {k: unquote(v) for k, v in match.groupdict().items()})
        return None

    def method(self, template: str, method: str) -> dict[str, Any] | None:
        info: dict[str, Any] | None = self.raw.get(template, {}).get("info", {}).get(method)
        return info

    def check(
        self,
        template: str,
        method: str,
        params: dict[str, str],
        release: tuple[int, int] = (99, 0),
    ) -> dict[str, str]:
        """The 400 `errors` map for these parameters (empty when all is well)."""
        info = self.method(template, method)
        if info is None:
            return {"": f"Method '{method} {template}' not implemented"}
        declared: dict[str, Any] = info.get("parameters", {}).get("properties", {}) or {}
        props = {
            name: spec
            for name, spec in declared.items()
            if release >= max(ADDED_IN.get(name, (0, 0)), ADDED_TO.get((template, name), (0, 0)))
        }
        errors: dict[str, str] = {}
        for name, value in params.items():
            spec = props.get(name) or _array_spec(props, name)
            if spec is None:
                errors[name] = UNKNOWN
            elif (problem := check_value(spec, value)) is not None:
                errors[name] = problem
        for name, spec in props.items():
            if not spec.get("optional") and "[n]" not in name and name not in params:
                errors[name] = "property is missing and it is not optional"
        return errors


def _array_spec(props: dict[str, Any], name: str) -> dict[str, Any] | None:
    """`net0` is declared as `net[n]`."""
    match = _ARRAY.fullmatch(name)
    spec: dict[str, Any] | None = props.get(f"{match.group(1)}[n]") if match else None
    return spec


def check_value(spec: dict[str, Any], value: str) -> str | None:
    kind = spec.get("type", "string")
    if kind == "boolean" and not _BOOL.fullmatch(value):
        return f"type check ('boolean') failed - got '{value}'"
    if kind in ("integer", "number"):
        if not (_INT if kind == "integer" else _NUM).fullmatch(value):
            return f"type check ('{kind}') failed - got '{value}'"
        number = float(value)
        if "minimum" in spec and number < float(spec["minimum"]):
            return f"value must have a minimum value of {spec['minimum']}"
        if "maximum" in spec and number > float(spec["maximum"]):
            return f"value must have a maximum value of {spec['maximum']}"
    if "maxLength" in spec and len(value) > int(spec["maxLength"]):
        return f"value may only be {spec['maxLength']} characters long"
    if "minLength" in spec and len(value) < int(spec["minLength"]):
        return f"value must be at least {spec['minLength']} characters long"
    if "enum" in spec and value not in spec["enum"]:
        return (
            f"value '{value}' does not have a value in the enumeration '{', '.join(spec['enum'])}'"
        )
    if "pattern" in spec and not _perl_regex(str(spec["pattern"])).fullmatch(value):
        return "value does not match the regex pattern"
    fmt = spec.get("format")
    if isinstance(fmt, dict):
        problem = check_property_string(fmt, value)
        return None if problem is None else f"invalid format - {problem}"
    if isinstance(fmt, str):
        verify = FORMATS.get(fmt)
        if verify is None:
            return f"format '{fmt}' is not implemented by the fake server"
        problem = verify(value)
        return None if problem is None else f"invalid format - {problem}"
    return None


def check_property_string(fmt: dict[str, Any], value: str) -> str | None:
    """`key=value,...` against a format map; aliases like `virtio=<mac>` (keyAlias) too."""
    default_key = next((k for k, s in fmt.items() if s.get("default_key")), None)
    seen: dict[str, str] = {}
    for part in (p for p in value.split(",") if p):
        key, sep, val = part.partition("=")
        if not sep:
            if default_key is None or default_key in seen:
                return f"value without key, but schema does not define a default key: {part}"
            key, val = default_key, part
        spec = fmt.get(key)
        if spec is None:
            return f"{key}: {UNKNOWN}"
        if "alias" in spec:
            if "keyAlias" in spec:
                seen[str(spec["keyAlias"])] = key  # `virtio=<mac>`: model virtio
            key = str(spec["alias"])
            spec = fmt[key]
        if key in seen:
            return f"duplicate key in comma-separated list property: {key}"
        problem = check_value(spec, val)
        if problem is not None:
            return f"{key}: {problem}"
        seen[key] = val
    for key, spec in fmt.items():
        if "alias" not in spec and not spec.get("optional") and key not in seen:
            return f"{key}: property is missing and it is not optional"
    return None
