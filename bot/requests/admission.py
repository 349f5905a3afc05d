"""Checks of a deploy request against the hypervisor, before anything is recorded.

The request is well-formed by now (bot/requests/validation.py); these ask the backend whether
what it names exists there (template, node, storage, network) and whether the name is
free, so that the requester hears of a mistake at once, with what to choose instead,
rather than from a job that fails at its clone step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping

from backends.abilities import NamedTemplates
from backends.base import Backend, Network, Segment, Storage, Template
from bot.addresses.allocation import Known, named
from bot.addresses.macs import mac_conflict
from bot.models import DeployRequest
from bot.models.errors import BackendError, Conflict, RequestInvalid


async def check_on_backend(
    backends: Mapping[str, Backend], request: DeployRequest, segment: Segment | None = None
) -> Template:
    """Refuse unknown templates, placements and networks before anything is recorded;
    return the template. `segment`: where the request's subnet puts its NIC there
    (None: `network=`, else the backend's own network)."""
    backend = backends.get(request.backend)
    if backend is None:
        raise RequestInvalid([f"No backend called {request.backend!r} is running."])
    problems = []
    try:  # two independent questions: asked together, the requester waits for one
        found, placements = await asyncio.gather(
            find_template(backend, request.template), backend.placements(), return_exceptions=True
        )
        for answer in (found, placements):
            if isinstance(answer, BaseException):
                raise answer
        assert not isinstance(found, BaseException) and isinstance(placements, list)
        template = found
        # Only a refusal lists the others (reading every template costs requests).
        names = [t.name for t in await backend.templates()] if template is None else []
    except BackendError as exc:
        raise RequestInvalid([_unanswered(request.backend, exc)]) from None
    if template is None:
        problems.append(
            f"template: {request.template!r} is not a template on {request.backend}; "
            + _choices(names, "templates", "see `/deploy templates`")
        )
    # What the backend knows against the template as configured (a NIC its guest has
    # no driver for): its VM would be built and then never answer.
    if template is not None and template.problem:
        problems.append(f"template: {template.problem}")
    places = [p.name for p in placements]
    if request.placement is not None and request.placement not in places:
        choices = ", ".join([*places, *backends])
        problems.append(
            f"on: {request.placement!r} is neither a backend nor a node of "
            f"{request.backend}; choose one of {choices}."
        )
    listing = backend.storages(request.placement) if request.storage else None
    storages = await _names(request.backend, listing) if listing else []
    if request.storage is not None and request.storage not in storages:
        problems.append(
            f"storage: {request.storage!r} is not a storage for VM disks on {request.backend}; "
            + _choices(storages, "storages for VM disks")
        )
    network = request.network or backend.default_network
    if segment is not None:
        networks = await _names(request.backend, backend.networks(request.placement))
        if segment.network not in networks:
            problems.append(
                f"{request.subnet or request.address.network} is on {segment} on "
                f"{request.backend}, but {segment.network} is not a network there: ask an "
                f"operator to correct [subnets.segments.{request.backend}] (networks there: "
                f"{', '.join(networks) or 'none'})."
            )
    elif network is not None:
        networks = await _names(request.backend, backend.networks(request.placement))
        if network not in networks and request.network is not None:
            problems.append(
                f"network: {network!r} is not a network on {request.backend}; "
                + _choices(networks, "networks")
            )
        elif network not in networks:
            # The backend's own setting is wrong: the clone step would fail for everyone.
            problems.append(
                f"network: {network!r}, the network of [[backends]] {request.backend} in the "
                "configuration, does not exist there: ask an operator to correct it "
                f"(networks there: {', '.join(networks) or 'none'})."
            )
    if problems:
        raise RequestInvalid(problems)
    assert template is not None  # else a problem was raised
    return template


async def find_template(backend: Backend, name: str) -> Template | None:
    """The named template: looked up alone where the backend can (`NamedTemplates`),
    else found among all of them."""
    if isinstance(backend, NamedTemplates):
        return await backend.template(name)
    return next((t for t in await backend.templates() if t.name == name), None)


async def _names(backend: str, listing: Awaitable[list[Storage] | list[Network]]) -> list[str]:
    try:
        return [item.name for item in await listing]
    except BackendError as exc:
        raise RequestInvalid([_unanswered(backend, exc)]) from None


def _unanswered(backend: str, exc: BackendError) -> str:
    """Why the backend could not be asked; "try again" only where waiting may help."""
    if exc.retryable:
        return f"{backend} did not answer ({exc.message}); try again in a minute."
    # A wrong password, an untrusted certificate, an unknown host: waiting will not help.
    return f"{backend}: {exc.message}"


async def check_free(backends: Mapping[str, Backend], request: DeployRequest) -> Known:
    """Refuse a name a VM (ours or not) already has, before anything is recorded.

    The pipeline checks again when the job starts; this answers the requester now.
    A fixed MAC another VM there has is refused too (`mac_conflict`). Addresses and
    MACs held by our own jobs are refused by the store's unique indexes. Returns
    the addresses in use the same read gave (`bot.addresses.allocation.named`), for the address
    check that follows.
    """
    try:
        taken, known = await named(backends, request)
        mac = await mac_conflict(backends[request.backend], request)
    except BackendError:
        return {}  # the pipeline's own check will say it, with retries
    if taken:
        raise Conflict(
            f"A VM named {request.name} already exists on {request.backend} "
            f"(id {taken[0].vm_id}): pick another name, or remove that VM first."
        )
    if mac is not None:
        raise Conflict(f"{mac[:1].upper()}{mac[1:]}: pick another MAC, or leave mac= out.")
    return known


def _choices(names: list[str], what: str, see: str = "") -> str:
    """The end of a "not a ... on ..." message: what to choose instead, or, when there
    is nothing to choose, who must act (a list that is empty helps nobody)."""
    if not names:
        return f"it has no {what} at all: ask an operator to add one."
    return f"choose one of {', '.join(names)}" + (f" ({see})." if see else ".")


def check_login(request: DeployRequest) -> None:
    """Refuse a VM nobody could log in to: the guest gets no password (cloud-init
    locks it), so without a key the SSH line at the end would be a lie."""
    if request.ssh_keys:
        return
    raise RequestInvalid(
        [
            f"No SSH key to log in to {request.name} with, so nobody could use it. Save "
            "your public key with `/deploy key ssh-ed25519 AAAA... you@laptop` and ask "
            "again, or ask an operator to set `ssh_keys` under [defaults] in the "
            "configuration."
        ]
    )


async def problems_at_start(
    backends: Mapping[str, Backend], default_template: str | None = None
) -> list[str]:
    """What an operator must fix before any request to a backend can succeed: it refuses
    us (password, certificate, host name), its configured network or the default
    template (`[defaults] template`) does not exist; and templates no request can use
    as configured (`Template.problem`). A backend that does not answer yet is no such
    problem: jobs wait for it."""
    problems = []
    for name, backend in backends.items():
        wanted = backend.default_network
        try:
            templates = await backend.templates()
            networks = [n.name for n in await backend.networks()] if wanted else []
        except BackendError as exc:
            if not exc.retryable:
                problems.append(f"backend {name}: {exc.message}")
            continue
        # Requests for these are refused (check_on_backend); the operator hears it now.
        problems += [f"backend {name}: {t.problem}" for t in templates if t.problem]
        names = [t.name for t in templates]
        if default_template is not None and default_template not in names:
            problems.append(
                f"backend {name}: the default template {default_template!r} is not there, "
                "so every deploy to it without template= would be refused: set [defaults] "
                f"template to one of {', '.join(names) or 'its templates (it has none)'}"
            )
        if wanted and wanted not in networks:
            problems.append(
                f"backend {name}: its network {wanted!r} does not exist there, so every "
                f"deploy without network= would be refused: correct it in [[backends]] "
                f"(networks there: {', '.join(networks) or 'none'})"
            )
    return problems
