"""Turn parsed `/deploy` arguments into a validated `DeployRequest`.

This is where the configuration's rules apply: which subnets may be used, the default
prefix, gateway and DNS of the subnet an address falls in, size limits, defaults. All
problems are collected and reported together, so one correction fixes the request.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import ValidationError

from bot.addresses import subnets
from bot.config.settings import Settings
from bot.models import MIN_MEMORY_MIB, DeployRequest, NicRequest
from bot.models.errors import RequestInvalid
from bot.requests.parsed import DeployArgs

# Request fields as the person typed them, so messages name the key they know.
_FIELD_KEYS = {
    "name": "the name",
    "address": "the address",
    "cores": "cpu",
    "memory_mib": "mem",
    "disk_grow_gib": "disk",
    "user": "user",
    "template": "template",
    "mac": "mac",
    "nics": "the NICs",
}


def build_request(
    args: DeployArgs,
    settings: Settings,
    requester: str,
    *,
    user_keys: tuple[str, ...] = (),
    user_template: str | None = None,
) -> DeployRequest:
    problems: list[str] = []
    defaults = settings.defaults
    backend, placement = _placement(args.on, settings)
    data: dict[str, Any] = {
        "name": args.name,
        "template": args.template or user_template or defaults.template,
        "backend": backend,
        "placement": placement,
        "storage": args.storage,
        "network": args.network,
        "cores": args.cores if args.cores is not None else defaults.cores,
        "memory_mib": args.memory_mib if args.memory_mib is not None else defaults.memory_mib,
        "disk_grow_gib": (
            args.disk_grow_gib if args.disk_grow_gib is not None else defaults.disk_grow_gib
        ),
        "user": args.user or defaults.user,
        "ssh_keys": user_keys or defaults.ssh_keys,
        "upgrade": bool(args.upgrade),
        "requester": requester,
    }
    if args.subnet is not None and args.address is not None:
        problems.append(
            f"Give {args.address} or subnet={args.subnet}, not both: an address is in one subnet."
        )
    elif args.address is None:
        data.update(_next_free(args, settings, backend, problems))
    else:
        data.update(_network(args.address, settings, problems))
    _segment(args, settings, backend, data.get("subnet"), problems)
    fields = dict.fromkeys(problems[:1], "address")
    before = len(problems)
    nics = _more_nics(args, settings, backend, data.get("subnet"), problems)
    fields.update(dict.fromkeys(problems[before:], "nics"))
    macs = dict(args.macs)  # by NIC number: 1 is the first NIC's
    data["mac"] = macs.get(1)
    data["nics"] = tuple(
        nic.model_copy(update={"mac": macs.get(n)}) for n, nic in enumerate(nics, 2)
    )
    _limits(data, settings, problems, fields)
    if problems:
        raise RequestInvalid(problems, {field: text for text, field in fields.items()})
    try:
        return DeployRequest(**data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        located = {str(e["loc"][0]) if e["loc"] else "": _explain(e) for e in errors}
        raise RequestInvalid([_explain(e) for e in errors], located) from None


def _placement(on: str | None, settings: Settings) -> tuple[str, str | None]:
    """`on=` names a backend, a node of the default backend, or BACKEND/NODE."""
    if on is None:
        return settings.default_backend, None
    if settings.backend(on) is not None:
        return on, None
    backend, sep, node = on.partition("/")
    if sep and settings.backend(backend) is not None:
        return backend, node or None
    return settings.default_backend, on


def _next_free(
    args: DeployArgs, settings: Settings, backend: str, problems: list[str]
) -> dict[str, Any]:
    """No address asked: the request gets one of its subnet's pool, only a stand-in until
    bot/addresses/allocation.py reserves the next free one (`picked`), before anything is
    recorded."""
    subnet = subnets.choose(settings.subnets, args.subnet, backend, args.network)
    if isinstance(subnet, str):
        problems.append(subnet)
        return {}
    pool = subnet.as_pool().hosts()
    if not pool:
        problems.append(f"The subnet {subnet.label} has no address to hand out (its pool).")
        return {}
    return {
        "address": ipaddress.IPv4Interface(f"{pool[0]}/{subnet.cidr.prefixlen}"),
        "gateway": subnet.gateway,
        "dns": subnet.dns,
        "search_domain": subnet.search_domain,
        "picked": True,
        "subnet": subnet.label,
    }


def _network(address: str, settings: Settings, problems: list[str]) -> dict[str, Any]:
    subnets = ", ".join(str(s) for s in settings.subnets)
    try:
        iface = ipaddress.IPv4Interface(address)
    except ValueError:
        problems.append(
            f"`{address}` is not an IPv4 address: write it like 10.0.0.50 or 10.0.0.50/24."
        )
        return {}
    subnet = settings.subnet_for(iface.ip)
    if subnet is None:
        problems.append(f"{iface.ip} is not in a subnet deploybot may use ({subnets}).")
        return {}
    if "/" in address and iface.network.prefixlen != subnet.cidr.prefixlen:
        problems.append(
            f"{address} says /{iface.network.prefixlen} but {subnet.cidr} is "
            f"/{subnet.cidr.prefixlen}: drop the prefix or write /{subnet.cidr.prefixlen}."
        )
        return {}
    return {
        "address": ipaddress.IPv4Interface(f"{iface.ip}/{subnet.cidr.prefixlen}"),
        "gateway": subnet.gateway,
        "dns": subnet.dns,
        "search_domain": subnet.search_domain,
        "subnet": subnet.label,
    }


def _more_nics(
    args: DeployArgs, settings: Settings, backend: str, first: str | None, problems: list[str]
) -> tuple[NicRequest, ...]:
    """The NICs after the first (`+ADDRESS` / `+SUBNET`), each in its own subnet, on its
    subnet's segment on the backend; what is wrong goes to `problems`."""
    nics: list[NicRequest] = []
    seen = {first: 1} if first else {}
    for number, word in enumerate(args.more_nics, 2):
        found = _nic(word, number, settings, problems)
        if found is None:
            continue
        subnet, address, picked = found
        if subnet.label in seen:
            problems.append(
                f"NIC {number} ({word}) is in {subnet.label} like NIC {seen[subnet.label]}: "
                "two NICs in one subnet share one segment, so give the second address to "
                "the first NIC as an alias (or choose another subnet)."
            )
            continue
        seen[subnet.label] = number
        segment = subnets.segment_on(settings.subnets, subnet, backend)
        if isinstance(segment, str):
            problems.append(f"NIC {number} ({word}): {segment}")
            continue
        nics.append(
            NicRequest(
                address=address,
                subnet=subnet.label,
                gateway=subnet.gateway if subnet.gateway_when_not_first else None,
                dns=subnet.dns,
                search_domain=subnet.search_domain,
                picked=picked,
            )
        )
    return tuple(nics)


def _nic(
    word: str, number: int, settings: Settings, problems: list[str]
) -> tuple[subnets.Subnet, ipaddress.IPv4Interface, bool] | None:
    """One `+` word: an address (in the subnet it falls in) or a subnet by name or CIDR
    (its pool's first address, a stand-in until the next free one is reserved)."""
    named = [s for s in settings.subnets if word in (s.name, str(s.cidr))]
    if named:
        pool = named[0].as_pool().hosts()
        if not pool:
            problems.append(
                f"NIC {number}: the subnet {named[0].label} has no address to hand out."
            )
            return None
        stand_in = ipaddress.IPv4Interface(f"{pool[0]}/{named[0].cidr.prefixlen}")
        return named[0], stand_in, True
    before = len(problems)
    got = _network(word, settings, problems)
    if len(problems) > before:
        problems[before:] = [
            f"NIC {number}: {p}"
            + (" (or name a subnet for its next free address)" if "IPv4" in p else "")
            for p in problems[before:]
        ]
        return None
    subnet = settings.subnet_for(got["address"].ip)
    assert subnet is not None  # _network refused addresses outside every subnet
    if got["address"].ip == subnet.gateway:  # the first NIC's is refused by the model
        problems.append(
            f"NIC {number}: {subnet.gateway} is the gateway of {subnet.cidr}: pick another address."
        )
        return None
    return subnet, got["address"], False


def _segment(
    args: DeployArgs, settings: Settings, backend: str, label: str | None, problems: list[str]
) -> None:
    """The subnet picks the NIC's segment on the backend: refused when it has none there
    while other subnets do, or when network= names another (`subnets.segment_on`)."""
    subnet = next((s for s in settings.subnets if s.label == label), None)
    if subnet is None:
        return  # the address was refused already
    found = subnets.segment_on(settings.subnets, subnet, backend, args.network)
    if isinstance(found, str):
        problems.append(found)


def _limits(
    data: dict[str, Any], settings: Settings, problems: list[str], fields: dict[str, str]
) -> None:
    limits = settings.limits
    checks = (
        ("cores", "cpu", limits.max_cores, ""),
        ("memory_mib", "mem", limits.max_memory_mib, " MiB"),
        ("disk_grow_gib", "disk", limits.max_disk_grow_gib, " GiB"),
    )
    if data["memory_mib"] < MIN_MEMORY_MIB:  # a form's value (the text grammar says it)
        problems.append(
            f"mem: {data['memory_mib']} MiB is too little: a VM needs at least "
            f"{MIN_MEMORY_MIB} MiB."
        )
        fields[problems[-1]] = "memory_mib"
    for field, key, limit, unit in checks:
        if data[field] > limit:
            problems.append(f"{key}: {data[field]}{unit} is over the limit of {limit}{unit}.")
            fields[problems[-1]] = field


def _explain(error: Any) -> str:
    loc = error["loc"][0] if error["loc"] else ""
    message = str(error["msg"]).removeprefix("Value error, ")
    key = _FIELD_KEYS.get(str(loc), str(loc))
    if key in ("the name", "the address") or not loc:
        return message[:1].upper() + message[1:] + ("" if message.endswith(".") else ".")
    return f"{key}: {message}."
