"""Whether a placement can run a build profile's CPU baseline (`x86-64-v3` needs avx2).

The rule, in order:

1. A cluster with EVC on (`summary.currentEVCModeKey`) shows its VMs that mode's CPU
   and no more, on every host: the mode decides (x86-64-v3 needs intel-haswell or
   amd-zen and later; x86-64-v2-AES intel-westmere or amd-bulldozer and later).
2. Else every host of the placement counts (DRS may move the VM to any): its CPUID
   leaves (`hardware.cpuFeature`) must have the baseline's flags; a host whose leaves
   are not readable is judged by the best EVC mode it could offer
   (`summary.maxEVCModeKey`).
3. What cannot be read at all is not refused: it becomes a note that says so.

vcsim's hosts report the CPUID of a Xeon E5-1620 (Sandy Bridge: AES, AVX, no leaf 7
and so no avx2) and no EVC mode: x86-64-v2-AES passes there and x86-64-v3 is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The CPUID flags each baseline needs: (leaf, register, bit, name).
_V2 = [
    (1, "ecx", 0, "sse3"),
    (1, "ecx", 9, "ssse3"),
    (1, "ecx", 13, "cx16"),
    (1, "ecx", 19, "sse4.1"),
    (1, "ecx", 20, "sse4.2"),
    (1, "ecx", 23, "popcnt"),
    (0x80000001, "ecx", 0, "lahf_lm"),
]
_AES = [(1, "ecx", 25, "aes")]
_V3 = [
    (1, "ecx", 12, "fma"),
    (1, "ecx", 22, "movbe"),
    (1, "ecx", 27, "osxsave"),
    (1, "ecx", 28, "avx"),
    (1, "ecx", 29, "f16c"),
    (7, "ebx", 3, "bmi1"),
    (7, "ebx", 5, "avx2"),
    (7, "ebx", 8, "bmi2"),
    (0x80000001, "ecx", 5, "lzcnt"),
]
FLAGS = {"x86-64-v2-AES": _V2 + _AES, "x86-64-v3": _V2 + _AES + _V3}

# EVC modes, oldest first per vendor, and the oldest that carries each baseline.
_EVC = {
    "intel": [
        "intel-merom",
        "intel-penryn",
        "intel-nehalem",
        "intel-westmere",
        "intel-sandybridge",
        "intel-ivybridge",
        "intel-haswell",
        "intel-broadwell",
        "intel-skylake",
        "intel-cascadelake",
        "intel-icelake",
        "intel-sapphirerapids",
    ],
    "amd": [
        "amd-rev-e",
        "amd-rev-f",
        "amd-greyhound-no3dnow",
        "amd-greyhound",
        "amd-bulldozer",
        "amd-piledriver",
        "amd-steamroller",
        "amd-zen",
        "amd-zen2",
        "amd-zen3",
        "amd-zen4",
    ],
}
_EVC_MIN = {
    "x86-64-v2-AES": {"intel": "intel-westmere", "amd": "amd-bulldozer"},
    "x86-64-v3": {"intel": "intel-haswell", "amd": "amd-zen"},
}
HOST_PATHS = ["name", "hardware.cpuFeature", "summary.maxEVCModeKey"]


@dataclass(frozen=True)
class HostCpu:
    name: str
    leaves: dict[int, dict[str, int]]  # CPUID leaf -> register -> value; empty: unknown
    max_evc: str | None = None


def leaves(cpu_feature: Iterable[Any]) -> dict[int, dict[str, int]]:
    """`HostCpuIdInfo` entries ("0000:...:1101", most significant bit first) as numbers."""
    found: dict[int, dict[str, int]] = {}
    for info in cpu_feature:
        regs = {}
        for reg in ("eax", "ebx", "ecx", "edx"):
            bits = str(getattr(info, reg, "") or "").replace(":", "")
            if len(bits) == 32 and set(bits) <= {"0", "1"}:
                regs[reg] = int(bits, 2)
        found[int(info.level) & 0xFFFFFFFF] = regs
    return found


def missing_flags(cpu: str, regs: dict[int, dict[str, int]]) -> list[str]:
    return [
        name
        for leaf, reg, bit, name in FLAGS[cpu]
        if not (regs.get(leaf, {}).get(reg, 0) >> bit) & 1
    ]


def evc_offers(cpu: str, mode: str) -> bool | None:
    """Whether EVC mode `mode` carries baseline `cpu`; None for a mode not known here."""
    for vendor, modes in _EVC.items():
        if mode in modes:
            return modes.index(mode) >= modes.index(_EVC_MIN[cpu][vendor])
    return None


def baseline_problem(
    cpu: str, placement: str, hosts: list[HostCpu], evc_mode: str | None
) -> tuple[str | None, list[str]]:
    """(what is wrong, or None; notes) for running baseline `cpu` on `placement`."""
    if cpu not in FLAGS:
        return f"unknown CPU baseline {cpu!r} (known: {', '.join(FLAGS)})", []
    fix = f"build on a placement whose CPUs offer {cpu}, or choose a profile with a lower cpu"
    if evc_mode:
        offers = evc_offers(cpu, evc_mode)
        if offers is None:
            return None, [f"EVC mode {evc_mode} of {placement} is not known here: {cpu} unchecked"]
        if not offers:
            return (
                f"{placement} runs its VMs in EVC mode {evc_mode}, which lacks {cpu}: raise "
                f"the cluster's EVC mode (to {_EVC_MIN[cpu]['intel']} or "
                f"{_EVC_MIN[cpu]['amd']} at least) or {fix}"
            ), []
        return None, []
    if not hosts:
        return None, [f"{placement} has no host to read the CPU of: {cpu} unchecked"]
    lacking, notes = [], []
    for host in hosts:
        if host.leaves:
            flags = missing_flags(cpu, host.leaves)
            if flags:
                lacking.append(f"{host.name} lacks {', '.join(flags)}")
        elif host.max_evc and evc_offers(cpu, host.max_evc) is False:
            lacking.append(f"{host.name} offers at most EVC mode {host.max_evc}")
        elif not host.max_evc or evc_offers(cpu, host.max_evc) is None:
            notes.append(f"the CPU of {host.name} is not readable: {cpu} unchecked there")
    if lacking:
        return f"{placement} cannot run {cpu}: {'; '.join(lacking)}; {fix}", notes
    return None, notes
