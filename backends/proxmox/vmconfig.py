"""Reading and writing Proxmox VM configuration values: pure functions, no I/O.

A VM's config is a flat map of strings (`scsi0: local-lvm:vm-101-disk-0,size=4G`,
`net0: virtio=BC:24:11:..,bridge=vmbr0`, `tags: a;b`). The backend reads the boot disk,
the NIC and its own marks from it, and writes identity values in the wire syntax the
API schema demands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from backends.base import NotOurVM, PermanentError, Segment, VMInfo, VMNotFound, VMRef
from backends.tags import job_marks, parse_tag

GIB = 1024**3
_UNITS = {"K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}
_DISK_KEYS = tuple(
    f"{bus}{n}"
    for bus, count in (("scsi", 31), ("virtio", 16), ("sata", 6), ("ide", 4))
    for n in range(count)
)
_TAG_SPLIT = re.compile(r"[;,\s]+")
_NIC_MODELS = frozenset(
    {
        "e1000",
        "e1000-82540em",
        "e1000-82544gc",
        "e1000-82545em",
        "e1000e",
        "i82551",
        "i82557b",
        "i82559er",
        "ne2k_isa",
        "ne2k_pci",
        "pcnet",
        "rtl8139",
        "virtio",
        "vmxnet3",
    }
)

# What the host CPU must offer for each x86-64 baseline model (Linux /proc/cpuinfo names).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
BASELINE_FLAGS: dict[str, frozenset[str]] = {
    "x86-64-v2": _V2,
    "x86-64-v2-AES": _V2 | {"aes"},
    "x86-64-v3": _V3,
    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}

# Guest OS family from a template name when no `os-<family>` tag says it.
_FAMILY_PATTERNS = (
    (re.compile(r"ubuntu", re.I), "ubuntu"),
    (re.compile(r"debian", re.I), "debian"),
    (re.compile(r"(?:rocky|alma|rhel|centos|oracle|ol)[-_ ]?(?:linux[-_ ]?)?(\d+)", re.I), "el"),
)


def family_of(name: str, tags: frozenset[str], overrides: dict[str, str]) -> str:
    """The guest OS family: an `os-<family>` tag on the template, the configured
    override for its name, else what its name says; "unknown" when none does."""
    for tag in sorted(tags):
        if tag.startswith("os-") and len(tag) > 3:
            return tag[3:]
    if name in overrides:
        return overrides[name]
    for pattern, family in _FAMILY_PATTERNS:
        match = pattern.search(name)
        if match:
            return f"el{match.group(1)}" if family == "el" else family
    return "unknown"


def cpu_model(cpu: str) -> str:
    """`x86-64-v3,flags=+aes` -> `x86-64-v3`; `cputype=host` -> `host`."""
    first = cpu.split(",", 1)[0]
    return first.split("=", 1)[1] if first.startswith("cputype=") else first


def missing_cpu_flags(cpu: str, host_flags: frozenset[str]) -> list[str]:
    return sorted(BASELINE_FLAGS.get(cpu_model(cpu), frozenset()) - host_flags)


def tags_of(config: dict[str, Any]) -> frozenset[str]:
    """Tags plus the job marks in the description (set at clone time, before the
    identity change can write tags)."""
    tags = {t for t in _TAG_SPLIT.split(str(config.get("tags", ""))) if t}
    # Only the mark's own `tag:` line, strictly parsed: any other `deploybot-...` text a
    # person wrote in the description says nothing about who built the VM.
    mark = mark_field(config, "tag")
    if mark is not None and parse_tag(mark) is not None:
        tags.add(mark)
    return frozenset(tags)


def owned(config: dict[str, Any] | None, ref: VMRef, node: str, where: str) -> dict[str, Any]:
    """The ref's VM's config, refusing a VM that is gone (`where`: what was searched)
    or that does not carry the job's tag: deploybot never touches someone else's VM."""
    if config is None:
        raise VMNotFound(f"VM {ref.vm_id} does not exist on {where}", vm_id=ref.vm_id)
    if ref.tag not in tags_of(config):
        raise NotOurVM(
            f"VM {ref.vm_id} ({config.get('name', '?')}) on {node} does not carry tag "
            f"{ref.tag}: deploybot leaves it alone",
            vm_id=ref.vm_id,
        )
    return config


def vm_info(item: dict[str, Any]) -> VMInfo:
    """A VM as `/cluster/resources?type=vm` lists it."""
    tags = frozenset(t for t in _TAG_SPLIT.split(str(item.get("tags", ""))) if t)
    running = item.get("status") == "running"
    lock = str(item["lock"]) if item.get("lock") else None  # backup, snapshot, migrate, ...
    name = str(item.get("name", ""))
    return VMInfo(str(item["vmid"]), name, running, tags, str(item["node"]), lock)


def has_mark(tags: frozenset[str]) -> bool:
    return bool(job_marks(tags))


def merged_tags(config: dict[str, Any], tag: str) -> str:
    """The VM's own tags (inherited from its template) plus the job tag, `;`-separated.

    A job tag inherited from the template (a template deploybot built, or one converted
    from a deployed VM) is dropped: the clone belongs to its own job only, and gc must
    not read it as the template's job's VM."""
    own = {t for t in _TAG_SPLIT.split(str(config.get("tags", ""))) if t and parse_tag(t) is None}
    return ";".join(sorted(own | {tag}))


@dataclass(frozen=True)
class Mark:
    """What the clone's description records: durable, readable after a restart."""

    job_id: str
    tag: str
    template: str
    family: str

    def text(self, extra: str = "") -> str:
        lines = [
            "Deployed by deploybot; do not remove the lines below.",
            f"job: {self.job_id}",
            f"tag: {self.tag}",
            f"template: {self.template}",
            f"os: {self.family}",
        ]
        return "\n".join([*lines, extra] if extra else lines)


# The mark line the identity change adds: the boot disk's size in bytes as cloned.
DISK_MARK = "disk-bytes"


def mark_field(config: dict[str, Any], key: str) -> str | None:
    match = re.search(rf"^{key}: (\S+)$", str(config.get("description", "")), re.M)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Disk:
    key: str  # scsi0, virtio0, ...
    volume: str  # local-lvm:vm-101-disk-0
    size_bytes: int

    @property
    def storage(self) -> str:
        return self.volume.split(":", 1)[0]


def boot_disk(config: dict[str, Any]) -> Disk:
    """The disk the VM boots from: the first disk in `boot: order=...`, else the first
    disk that is neither a CD-ROM nor the cloud-init drive."""
    order = re.search(r"order=([^,]+)", str(config.get("boot", "")))
    preferred = [k for k in (order.group(1).split(";") if order else []) if k in _DISK_KEYS]
    for key in [*preferred, *_DISK_KEYS]:
        value = config.get(key)
        if not isinstance(value, str) or "media=cdrom" in value or "cloudinit" in value:
            continue
        volume = value.split(",", 1)[0]
        size = re.search(r"(?:^|,)size=(\d+(?:\.\d+)?)([KMGT]?)(?:,|$)", value)
        size_bytes = int(float(size.group(1)) * _UNITS.get(size.group(2), 1)) if size else 0
        return Disk(key, volume, size_bytes)
    raise PermanentError("the VM has no disk to boot from")


def size_text(size_bytes: int) -> str:
    """An absolute size for `resize` (`14G`), in the largest unit that is exact."""
    for unit in ("T", "G", "M", "K"):
        if size_bytes % _UNITS[unit] == 0:
            return f"{size_bytes // _UNITS[unit]}{unit}"
    return str(size_bytes)


def nic_with(
    net0: str | None,
    model: str | None,
    bridge: str | None,
    segment: Segment | None = None,
    mac: str | None = None,
) -> str | None:
    """`net0` with the profile's NIC model (None: the template's), keeping the MAC; None
    when nothing would change. Both spellings are read: `virtio=<MAC>,...` (what Proxmox
    writes) and `model=virtio,macaddr=<MAC>,...`; a changed one is written in the first.

    With the subnet's `segment`, the NIC is put exactly there: `bridge`, `tag` (removed
    when the segment has no VLAN: the template's tag would put it on another one) and
    `firewall` written as `virtio=MAC,bridge=vmbr0,tag=20,firewall=0`, the template's
    other options (rate, mtu, queues, ...) after them. Without one, only the configured
    `bridge` replaces the template's (None: kept) and every other option stays. A fixed
    `mac` replaces the clone's (written upper-case, as Proxmox writes its own)."""
    if not net0:
        return None
    parts = net0.split(",")
    head, rest = parts[0], parts[1:]
    current, _, had = head.partition("=")
    options = dict(p.split("=", 1) for p in rest if "=" in p)
    if current == "model":
        current, had = had, options.pop("macaddr", "")
    if current not in _NIC_MODELS:
        return None  # not a NIC line this reads: leave the template's choice alone
    new_mac = mac.upper() if mac else had
    new_model = model or current
    placed = dict(options)
    if segment is not None:
        where = {"bridge": segment.network, "tag": str(segment.vlan) if segment.vlan else None}
        where["firewall"] = "1" if segment.firewall else "0"
        rest_of = {k: v for k, v in options.items() if k not in where}
        placed = {k: v for k, v in where.items() if v is not None} | rest_of
    elif bridge:
        placed["bridge"] = bridge
    same_mac = new_mac.upper() == had.upper()
    if new_model == current and same_mac and list(placed.items()) == list(options.items()):
        return None
    head = f"{new_model}={new_mac}" if new_mac else new_model
    return ",".join([head, *(f"{k}={v}" for k, v in placed.items())])


def parse_release(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)
