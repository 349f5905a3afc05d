"""The named formats of the PVE JSON schema (pve-common `JSONSchema.pm`, qemu-server),
as far as the endpoints deploybot uses need them.

Each verifier returns None when the value is fine, else the server's message. A format
the fake does not know is an error, not a pass: a request the fake cannot check must
not count as checked.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from urllib.parse import unquote

Verifier = Callable[[str], str | None]

_NODE = re.compile(r"[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?")
_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?"
_DNS = re.compile(rf"({_LABEL}\.)*{_LABEL}")
_STORAGE_ID = re.compile(r"[a-z][a-z0-9\-_.]*[a-z0-9]", re.I)
_CONFIG_ID = re.compile(r"[a-z][a-z0-9_]+", re.I)
_URLENCODED = re.compile(r"[-%a-zA-Z0-9_.!~*'()]*")
_TAG = re.compile(r"[a-z0-9_][a-z0-9_\-+.]*", re.I)
_BRIDGE = re.compile(r"[-_.\w]+")
_MAC = re.compile(r"[a-f0-9][02468ace](?::[a-f0-9]{2}){5}", re.I)
_REALM = re.compile(r"[A-Za-z][A-Za-z0-9.\-_]+")
_POOL = re.compile(r"[A-Za-z0-9_\-.]+")
UNKNOWN = "property is not defined in schema and the schema does not allow additional properties"
_SPLIT = re.compile(r"[\0;,\s]+")
_CPU_FLAGS = re.compile(r"[+-][a-zA-Z0-9\-_.]+(?:;[+-][a-zA-Z0-9\-_.]+)*")
_CONTENT = frozenset({"images", "rootdir", "vztmpl", "iso", "backup", "snippets", "import"})
_SSH_KEY = re.compile(
    r"(?:(?:ssh-(?:rsa|dss|ed25519)|ecdsa-sha2-nistp(?:256|384|521)|"
    r"sk-(?:ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com) [A-Za-z0-9+/]+={0,3})(?: .*)?"
)
# CPU models QEMU on PVE offers (the `cputype` of `cpu`); custom ones start `custom-`.
CPU_MODELS = frozenset(
    {
        "486",
        "athlon",
        "Broadwell",
        "Cascadelake-Server",
        "Conroe",
        "core2duo",
        "coreduo",
        "EPYC",
        "EPYC-Genoa",
        "EPYC-Milan",
        "EPYC-Rome",
        "Haswell",
        "host",
        "Icelake-Server",
        "IvyBridge",
        "kvm32",
        "kvm64",
        "max",
        "Nehalem",
        "Opteron_G5",
        "Penryn",
        "pentium",
        "qemu32",
        "qemu64",
        "SandyBridge",
        "Skylake-Client",
        "Skylake-Server",
        "Westmere",
        "x86-64-v2",
        "x86-64-v2-AES",
        "x86-64-v3",
        "x86-64-v4",
    }
)


def _regex(pattern: re.Pattern[str], what: str) -> Verifier:
    def verify(value: str) -> str | None:
        return None if pattern.fullmatch(value) else f"value does not look like a valid {what}"

    return verify


def _ip(kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address], what: str) -> Verifier:
    def verify(value: str) -> str | None:
        try:
            kind(value)
        except ValueError:
            return f"value does not look like a valid {what}"
        return None

    return verify


def _cidr(version: int | None) -> Verifier:
    def verify(value: str) -> str | None:
        try:
            iface = ipaddress.ip_interface(value)
        except ValueError:
            return "value does not look like a valid CIDR network"
        if "/" not in value or (version and iface.version != version):
            return "value does not look like a valid CIDR network"
        return None

    return verify


def _vmid(value: str) -> str | None:
    return (
        None
        if re.fullmatch(r"[1-9][0-9]{2,8}", value)
        else "value does not look like a valid VM ID"
    )


def _urlencoded(value: str) -> str | None:
    return None if _URLENCODED.fullmatch(value) else f"invalid urlencoded string: {value}"


def _list_of(item: Verifier) -> Verifier:
    def verify(value: str) -> str | None:
        for part in (p for p in _SPLIT.split(value) if p):
            if (error := item(part)) is not None:
                return error
        return None

    return verify


def _tag(value: str) -> str | None:
    return None if _TAG.fullmatch(value) else f"invalid characters in tag '{value}'"


def _content(value: str) -> str | None:
    return None if value in _CONTENT else f"invalid content type '{value}'"


def _address(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return f"unable to parse address '{value}'"
    return None


def _pairs(value: str, default_key: str | None) -> dict[str, str] | str:
    """`k=v,k2=v2` (the first may lack its key); a message when malformed."""
    found: dict[str, str] = {}
    for part in (p for p in value.split(",") if p):
        key, sep, val = part.partition("=")
        if not sep:
            if default_key is None or default_key in found:
                return f"value without key, but schema does not define a default key: {part}"
            key, val = default_key, part
        if key in found:
            return f"duplicate key in comma-separated list property: {key}"
        found[key] = val
    return found


def ipconfig(value: str) -> str | None:
    """`ip=<CIDRv4>|dhcp,gw=<IPv4>,ip6=<CIDRv6>|auto|dhcp,gw6=<IPv6>`; gw needs a static ip."""
    pairs = _pairs(value, None)
    if isinstance(pairs, str):
        return pairs
    checks: dict[str, Verifier] = {
        "ip": lambda v: None if v == "dhcp" else _cidr(4)(v),
        "gw": _ip(ipaddress.IPv4Address, "IPv4 address"),
        "ip6": lambda v: None if v in ("dhcp", "auto") else _cidr(6)(v),
        "gw6": _ip(ipaddress.IPv6Address, "IPv6 address"),
    }
    for key, val in pairs.items():
        if key not in checks:
            return f"{key}: {UNKNOWN}"
        if (error := checks[key](val)) is not None:
            return f"{key}: {error}"
    for gw, ip in (("gw", "ip"), ("gw6", "ip6")):
        if gw in pairs and pairs.get(ip, "dhcp") in ("dhcp", "auto"):
            return f"{gw}: gateway specified without specifying an IP address"
    return None


def cpu_conf(value: str) -> str | None:
    """`[[cputype=]<model>][,flags=+a;-b][,hidden=<bool>]`; the model must exist."""
    pairs = _pairs(value, "cputype")
    if isinstance(pairs, str):
        return pairs
    for key, val in pairs.items():
        if key == "cputype":
            if val not in CPU_MODELS and not val.startswith("custom-"):
                return f"cputype: CPU model '{val}' does not exist"
        elif key == "flags":
            if not _CPU_FLAGS.fullmatch(val):
                return "flags: value does not match the regex pattern"
        elif key == "hidden":
            if val not in ("0", "1"):
                return f"hidden: type check ('boolean') failed - got '{val}'"
        else:
            return f"{key}: {UNKNOWN}"
    return None


# pve-storage's volume ids (`local-lvm:vm-100-disk-0`, `local:import/x.qcow2`, and the
# `STORAGE:SIZE` of a disk to allocate), and qemu-server's boot order.
_VOLUME_ID = re.compile(r"[a-z][a-z0-9\-_.]*[a-z0-9]:.+", re.I)
_BOOT_DEVICE = re.compile(r"(?:ide|sata|scsi|virtio|net|efidisk|tpmstate)\d+|hostpci\d+|usb\d+")


def _volume_or_path(value: str) -> str | None:
    """`pve-volume-id-or-qm-path` / `-or-absolute-path`: a volume id, an absolute
    path, or (for drives) `none`/`cdrom`."""
    if _VOLUME_ID.fullmatch(value) or value.startswith("/") or value in ("none", "cdrom"):
        return None
    return f"unable to parse volume ID '{value}'"


def _boot(value: str) -> str | None:
    """`order=scsi0;net0` (or the legacy letters `cdn`)."""
    if re.fullmatch(r"[acdn]{1,4}", value):
        return None
    pairs = _pairs(value, "legacy")
    if isinstance(pairs, str):
        return pairs
    for key, val in pairs.items():
        if key != "order":
            return f"{key}: {UNKNOWN}"
        for device in val.split(";"):
            if not _BOOT_DEVICE.fullmatch(device):
                return f"order: invalid boot device '{device}'"
    return None


FORMATS: dict[str, Verifier] = {
    "pve-volume-id-or-qm-path": _volume_or_path,
    "pve-volume-id-or-absolute-path": _volume_or_path,
    "pve-qm-boot": _boot,
    "pve-node": _regex(_NODE, "node name"),
    "pve-vmid": _vmid,
    "dns-name": _regex(_DNS, "DNS name"),
    "pve-storage-id": _regex(_STORAGE_ID, "storage ID"),
    "pve-configid": _regex(_CONFIG_ID, "configuration ID"),
    "pve-configid-list": _list_of(_regex(_CONFIG_ID, "configuration ID")),
    "pve-poolid": _regex(_POOL, "pool ID"),
    "pve-realm": _regex(_REALM, "realm"),
    "pve-bridge-id": _regex(_BRIDGE, "bridge"),
    "mac-addr": _regex(_MAC, "MAC address"),
    "urlencoded": _urlencoded,
    "pve-qm-ipconfig": ipconfig,
    "pve-vm-cpu-conf": cpu_conf,
    "address-list": _list_of(_address),
    "pve-tag-list": _list_of(_tag),
    "pve-storage-content": _content,
    "pve-storage-content-list": _list_of(_content),
    "ipv4": _ip(ipaddress.IPv4Address, "IPv4 address"),
    "ipv6": _ip(ipaddress.IPv6Address, "IPv6 address"),
    "CIDRv4": _cidr(4),
    "CIDRv6": _cidr(6),
    "CIDR": _cidr(None),
}


def ssh_keys_problem(encoded: str) -> str | None:
    """qemu-server unescapes `sshkeys` and validates each key line."""
    for line in unquote(encoded).splitlines():
        if line.strip() and not line.startswith("#") and not _SSH_KEY.fullmatch(line):
            return "SSH public key validation error"
    return None
