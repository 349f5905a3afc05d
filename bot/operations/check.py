"""`deploybot check`: whether the configuration can work, asked of the systems it names.

`check-config` only parses the file; this connects. For every backend: can we reach it,
is its certificate trusted, does it take our credentials, does the default template
exist and is it a template, do the default storage and network exist, can each
subnet's segment there take a NIC (the bridge exists on every node and is VLAN-aware
for a tag, the portgroup exists, is no uplink and reaches the hosts: `ChecksSegments`),
and does the account hold the privileges the deploy steps need, on those segments too
(where the backend can say: `ChecksPrivileges`; with a host CA, those installing
certificates too). The host CA (`[ssh]`): whether its key loads from the environment,
and its fingerprint. One result per check, each a problem with its fix or ok, so an
operator sees everything wrong at once instead of one job failure at a time.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from backends import advice
from backends.abilities import ChecksPrivileges, ChecksSegments
from backends.base import Backend, Segment
from backends.ipam import open_ipam
from backends.ipam.base import Ipam
from bot.addresses.subnets import Subnet
from bot.app.runtime import make_backend
from bot.config.settings import Settings
from bot.models.errors import BackendError, ConfigError, UserError
from bot.requests.admission import find_template
from bot.sshca.authority import load_host_ca


@dataclass(frozen=True)
class CheckResult:
    name: str  # what was checked, e.g. "pve: template ubuntu-24.04"
    ok: bool
    detail: str  # what was found
    fix: str = ""  # what to change, when not ok (or when a warning)
    # ok, but two things that should agree do not (e.g. NetBox's VLAN and a segment's
    # tag): said, not counted as a problem.
    warning: bool = False


async def run_checks(settings: Settings) -> list[CheckResult]:
    results = check_host_ca(settings)
    # With a CA the privileges installing certificates are asked too (even when it does
    # not load: the operator means to have one).
    certificates = settings.ssh.host_ca_env is not None
    for config in settings.backends:
        try:
            backend = make_backend(config)
        except UserError as exc:  # a missing secret, an unreadable CA bundle
            results.append(CheckResult(f"{config.name}: set-up", False, exc.message))
            continue
        segments = [(str(s.cidr), s.segment(config.name)) for s in settings.subnets]
        try:
            results += await check_backend(
                config.name,
                backend,
                settings.defaults.template,
                segments,
                certificates=certificates,
            )
        finally:
            await backend.close()
    # Overlapping or duplicate subnets stop the configuration from loading at all.
    cidrs = ", ".join(str(s.cidr) for s in settings.subnets) or "none"
    results.append(CheckResult("subnets", True, f"no overlaps ({cidrs})"))
    results += await check_ipam(settings)
    return results


async def check_ipam(settings: Settings) -> list[CheckResult]:
    """The IPAM: each subnet's prefix (or range) exists, the tags exist, the VLAN field
    (NetBox's `vlan_field`) can hold a VLAN, and the token may add and delete an address
    (one is reserved and deleted per subnet); a warning for each segment whose VLAN tag
    is not the subnet's VLAN in the IPAM."""
    if settings.ipam.provider == "builtin":
        return [CheckResult("ipam", True, "builtin: deploybot's own database, no server")]
    try:
        ipam = open_ipam(settings.ipam, os.environ)
    except BackendError as exc:  # no token in the environment
        return [CheckResult("ipam: set-up", False, exc.message)]
    try:
        try:
            problems = await ipam.problems([s.as_pool() for s in settings.subnets])
        except BackendError as exc:
            problems = [exc.message]
        warnings = await check_vlans(ipam, settings.subnets)
    finally:
        await ipam.close()
    if not problems:
        where = f"NetBox at {settings.ipam.url}"
        detail = f"{where}: every subnet's prefix found; the token may add and delete addresses"
        if settings.ipam.vlan_field:
            detail += f"; each address records its prefix's VLAN in {settings.ipam.vlan_field}"
        return [CheckResult("ipam", True, detail), *warnings]
    return [CheckResult("ipam", False, problem) for problem in problems] + warnings


async def check_vlans(ipam: Ipam, subnets: tuple[Subnet, ...]) -> list[CheckResult]:
    """A warning for each segment whose VLAN tag is not the VLAN the IPAM gives the
    subnet (NetBox: its prefix's): one of the two is wrong, and a VM would sit on the
    tag's VLAN while NetBox says the other. A segment without a tag (an access bridge,
    a vSphere portgroup) says no VLAN deploybot could compare."""
    out = []
    for subnet in subnets:
        tagged = {b: s.vlan for b, s in subnet.segments.items() if s.vlan is not None}
        try:
            vlan = await ipam.vlan(subnet.as_pool()) if tagged else None
        except BackendError:
            continue  # no prefix, no answer: a problem `problems` already said
        for backend, tag in tagged.items():
            if vlan is None or vlan.vid == tag:
                continue
            segment = subnet.segments[backend].segment()
            detail = (
                f"{ipam.name}'s prefix {subnet.ipam_prefix or subnet.cidr} is in {vlan}, but "
                f"the subnet's segment on {backend} is {segment}"
            )
            fix = (
                f"make them one VLAN: the prefix's VLAN in {ipam.name}, or vlan in "
                f"[subnets.segments.{backend}] of {subnet.label}"
            )
            name = f"ipam: subnet {subnet.label} VLAN"
            out.append(CheckResult(name, True, detail, fix, warning=True))
    return out


def check_host_ca(settings: Settings) -> list[CheckResult]:
    """The host CA: none configured, or its key loads (its fingerprint, the hosts its
    line names), or why not (the message names the variable, never its value)."""
    try:
        ca = load_host_ca(settings, os.environ)
    except ConfigError as exc:
        return [CheckResult("ssh: host CA", False, exc.message)]
    if ca is None:
        detail = "none configured ([ssh] host_ca_env): host keys are confirmed, not certified"
        return [CheckResult("ssh: host CA", True, detail)]
    detail = (
        f"{ca.fingerprint} from {ca.source}; certifies host keys for {', '.join(ca.patterns)} "
        "(`deploybot ssh-ca` prints the known_hosts line)"
    )
    return [CheckResult("ssh: host CA", True, detail)]


async def check_backend(
    name: str,
    backend: Backend,
    template: str,
    segments: list[tuple[str, Segment | None]] | None = None,
    *,
    certificates: bool = False,
) -> list[CheckResult]:
    """The checks of one backend; the first refusal of the connection ends them (the
    rest would only repeat it). `segments`: each subnet (its CIDR) and its segment on
    this backend (None: it has none there). `certificates`: a host CA is configured, so
    the privileges installing host certificates count too."""
    segments = segments or []
    try:
        await backend.placements()
    except BackendError as exc:
        detail = exc.message
        if advice.UNTRUSTED in detail and isinstance(backend, ChecksPrivileges):
            host, port = backend.endpoint
            presented = await asyncio.to_thread(advice.presented_certificate, host, port)
            detail += f"; {presented}" if presented else ""
        return [CheckResult(f"{name}: connection", False, detail, _connection_fix(exc))]
    results = [CheckResult(f"{name}: connection", True, "reached; TLS and credentials accepted")]
    try:
        results.append(await _template(name, backend, template))
        results += await _placement(name, backend)
        results += await _segments(name, backend, segments)
        wanted = list(dict.fromkeys(s for _c, s in segments if s is not None))
        results += await _privileges(name, backend, template, wanted, certificates)
    except BackendError as exc:
        results.append(CheckResult(f"{name}: inventory", False, exc.message))
    return results


def _connection_fix(exc: BackendError) -> str:
    if exc.retryable:
        return "check `host` and `port` and that this machine may reach the API"
    return ""  # a refusal's message already says what to change (backends/advice.py)


async def _template(name: str, backend: Backend, template: str) -> CheckResult:
    check = f"{name}: template {template}"
    found = await find_template(backend, template)
    if found is None:
        names = ", ".join(t.name for t in await backend.templates()) or "none"
        return CheckResult(
            check,
            False,
            f"not a template there (templates: {names})",
            "set `template` under [defaults] to one of them, or make it a template",
        )
    if found.problem:
        return CheckResult(check, False, found.problem)
    return CheckResult(check, True, "exists and is a template")


async def _placement(name: str, backend: Backend) -> list[CheckResult]:
    results = []
    storage = backend.default_storage if isinstance(backend, ChecksPrivileges) else None
    if storage:
        storages = [s.name for s in await backend.storages()]
        results.append(_exists(name, "storage", storage, storages))
    if backend.default_network:
        networks = [n.name for n in await backend.networks()]
        results.append(_exists(name, "network", backend.default_network, networks))
    return results


def _exists(name: str, what: str, wanted: str, there: list[str]) -> CheckResult:
    check = f"{name}: {what} {wanted}"
    if wanted in there:
        return CheckResult(check, True, "exists")
    return CheckResult(
        check,
        False,
        f"does not exist there ({what}s there: {', '.join(there) or 'none'})",
        f"correct `{what}` in [[backends]] {name}",
    )


async def _segments(
    name: str, backend: Backend, segments: list[tuple[str, Segment | None]]
) -> list[CheckResult]:
    """One line per subnet: where its VMs' NICs go on this backend, and whether they can."""
    if not any(s for _c, s in segments):
        if len(segments) < 2:
            return []
        where = backend.default_network or "the template's own network"
        return [
            CheckResult(
                f"{name}: segments",
                False,
                f"no subnet has a segment here: the NICs of all {len(segments)} subnets' "
                f"VMs go on {where}",
                f"add [subnets.segments.{name}] to each subnet, saying where its VMs go",
            )
        ]
    results = []
    for cidr, segment in segments:
        if segment is None:
            results.append(
                CheckResult(
                    f"{name}: subnet {cidr}",
                    False,
                    "no segment here, while other subnets have one: its requests are refused",
                    f"add [subnets.segments.{name}] to the subnet {cidr}",
                )
            )
            continue
        check = f"{name}: subnet {cidr} on {segment}"
        if not isinstance(backend, ChecksSegments):
            results.append(CheckResult(check, True, "configured (this backend cannot check it)"))
            continue
        problems = await backend.segment_problems(segment)
        if not problems:
            tagged = ", VLAN-aware" if segment.vlan is not None else ""
            results.append(CheckResult(check, True, f"exists{tagged}"))
        results += [CheckResult(check, False, problem) for problem in problems]
    return results


async def _privileges(
    name: str, backend: Backend, template: str, segments: list[Segment], certificates: bool
) -> list[CheckResult]:
    if not isinstance(backend, ChecksPrivileges):
        return []
    try:
        lacking = await backend.missing_privileges(template, segments, certificates=certificates)
    except BackendError as exc:  # a check that could not run is no "ok"
        if exc.retryable:
            raise  # the backend stopped answering: the inventory line says so
        return [
            CheckResult(
                f"{name}: privileges",
                False,
                f"not checked: {exc.message}",
                "correct what it names, then run `deploybot check` again: the privileges "
                "are asked on what a deploy of the default template uses",
            )
        ]
    if not lacking:
        held = "the deploy steps' privileges are held"
        held += " (installing host certificates too)" if certificates else ""
        return [CheckResult(f"{name}: privileges", True, held)]
    return [
        CheckResult(
            f"{name}: privilege {m.privilege} on {m.where}",
            False,
            advice.privilege_missing(m.account, m.step),
            advice.privilege_fix(m.account, m.privilege, m.where),
        )
        for m in lacking
    ]
