"""The `/deploy` form and the settings modal: laying them out and reading them back.

`form_view` lays out what the backends offer (handlers/slack/catalog.py); `read_form`
turns a submission into `DeployArgs` or per-block errors using only the configuration,
so the errors can go back inside the 3 s an `ack` allows.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from slack_sdk.models.blocks import (
    Block,
    CheckboxesElement,
    ContextBlock,
    ExternalDataSelectElement,
    InputBlock,
    MarkdownTextObject,
    NumberInputElement,
    PlainTextInputElement,
)
from slack_sdk.models.views import View

from bot.config.settings import Settings
from bot.leases.terms import parse_length
from bot.models import HOSTNAME_RE, UserPrefs
from bot.models.errors import RequestInvalid, UsageError
from bot.models.keys import check_ssh_key
from bot.requests.grammar import is_whole, parse_nics
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from handlers.messages.lifecycle import lease_field_error, lease_hint
from handlers.messages.slack import (
    FORM_HINTS,
    FORM_LABELS,
    FORM_TITLE,
    SETTINGS_TITLE,
    TEMPLATES_OVERFLOW,
    backends_not_answering,
    missing_field,
    storage_option,
    subnet_choice,
)
from handlers.messages.text import escape
from handlers.slack.catalog import Catalog, Choice, template_options, template_value
from handlers.slack.views import SELECT_MAX, fit, option, select

FORM_VIEW = "deploy_form"
# Request fields (bot.models.DeployRequest) to the form block that shows them.
FIELD_BLOCKS = {
    "name": "name",
    "address": "address",
    "": "address",
    "gateway": "address",
    "cores": "cores",
    "memory_mib": "memory",
    "disk_grow_gib": "disk",
    "user": "user",
    "template": "template",
    "ssh_keys": "keys",
    "nics": "nics",
    "mac": "nics",
}


# --- the modal ----------------------------------------------------------------------


def form_view(
    settings: Settings,
    catalog: Catalog,
    choice: Choice,
    prefs: UserPrefs,
    metadata: str,
    quota: str | None = None,
) -> View:
    """`quota`: what the person may still ask for (messages.quota_left), plain text."""
    blocks: list[Block] = [
        _template_block(catalog, choice),
        _input("placement", _placement_select(catalog, choice), dispatch=True),
    ]
    if catalog.storages:
        storage_options = [
            option(storage_option(s.name, s.free_bytes), s.name) for s in catalog.storages
        ]
        storage = select("storage", storage_options, initial=choice.storage)
        # The placement is part of the block id, so a new node resets a stale choice.
        blocks.append(_input(f"storage@{choice.placement}", storage, optional=True, dispatch=True))
    if catalog.clone_note:
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=catalog.clone_note)]))
    # Where the subnets say where NICs go, the address picks the network: no choice.
    segmented = any(s.segment(choice.backend or "") for s in settings.subnets)
    if catalog.networks and not segmented:
        networks = [option(n.name, n.name) for n in catalog.networks]
        blocks.append(
            _input(f"network@{choice.placement}", select("network", networks), optional=True)
        )
    blocks.extend(_sizes_and_identity(settings, prefs, choice.backend))
    if catalog.problems:
        text = fit(backends_not_answering(catalog.problems), 3000)
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=text)]))
    if quota:
        text = fit(escape(quota), 3000)
        blocks.append(ContextBlock(block_id="quota", elements=[MarkdownTextObject(text=text)]))
    return View(
        type="modal",
        callback_id=FORM_VIEW,
        title=FORM_TITLE,
        submit="Deploy",
        close="Cancel",
        private_metadata=metadata,
        blocks=blocks,
    )


def _input(
    block_id: str,
    element: Any,
    *,
    optional: bool = False,
    dispatch: bool = False,
    hint: str | None = None,
) -> InputBlock:
    key = block_id.split("@", 1)[0]
    return InputBlock(
        block_id=block_id,
        label=FORM_LABELS[key],
        element=element,
        optional=optional,
        dispatch_action=dispatch or None,
        hint=hint,
    )


def _template_block(catalog: Catalog, choice: Choice) -> InputBlock:
    everything = template_options(catalog)
    if len(catalog.templates) <= SELECT_MAX:
        element: Any = select("template", everything, initial=choice.template)
        return _input("template", element, dispatch=True)
    initial = next((o for o in everything if o.value == choice.template), None)
    element = ExternalDataSelectElement(
        action_id="template", placeholder="Type to search", initial_option=initial
    )
    hint = TEMPLATES_OVERFLOW.format(count=len(catalog.templates))
    return _input("template", element, dispatch=True, hint=hint)


def _placement_select(catalog: Catalog, choice: Choice) -> Any:
    options = [option(p, p) for p in catalog.placements]
    return select("placement", options, initial=choice.placement)


def _sizes_and_identity(settings: Settings, prefs: UserPrefs, backend: str | None) -> list[Block]:
    d, limits = settings.defaults, settings.limits
    cores = [option(str(n), str(n)) for n in range(1, min(limits.max_cores, SELECT_MAX) + 1)]
    memory = [option(_mib_text(m), str(m)) for m in _memory_sizes(limits.max_memory_mib)]
    segments = [s.segment(backend or "") for s in settings.subnets]
    listed = [
        subnet_choice(str(s), str(seg) if seg else None)
        for s, seg in zip(settings.subnets, segments, strict=True)
    ]
    subnets = ("; " if any(segments) else ", ").join(listed)
    example = str(settings.subnets[0].cidr.network_address + 50)
    keys = "\n".join(prefs.ssh_keys)
    upgrade = CheckboxesElement(
        action_id="upgrade", options=[option(FORM_LABELS["upgrade"], "yes")]
    )
    return [
        _input("name", PlainTextInputElement(action_id="name", max_length=63), hint=_hint("name")),
        _input(
            "address",
            PlainTextInputElement(action_id="address", max_length=18),
            optional=True,
            hint=FORM_HINTS["address"].format(subnets=subnets, example=example),
        ),
        _input(
            "nics",
            PlainTextInputElement(action_id="nics", max_length=400),
            optional=True,
            hint=FORM_HINTS["nics"].format(example=_nic_example(settings)),
        ),
        _input("cores", select("cores", cores, initial=str(d.cores))),
        _input("memory", select("memory", memory, initial=str(d.memory_mib))),
        _input(
            "disk",
            NumberInputElement(
                action_id="disk",
                is_decimal_allowed=False,
                min_value="0",
                max_value=str(limits.max_disk_grow_gib),
                initial_value=str(d.disk_grow_gib),
            ),
        ),
        _input("user", PlainTextInputElement(action_id="user", initial_value=d.user)),
        _input(
            "keys",
            PlainTextInputElement(action_id="keys", multiline=True, initial_value=keys or None),
            optional=True,
            hint=_hint("keys"),
        ),
        _input(
            "lease",
            PlainTextInputElement(action_id="lease", max_length=12),
            optional=True,
            hint=lease_hint(settings.leases),
        ),
        # Unchecked unless the person ticks it; read back as an explicit "no".
        _input("upgrade", upgrade, optional=True),
    ]


def _nic_example(settings: Settings) -> str:
    """A `+` word for the form's hint: another subnet's name, or an address in it."""
    other = settings.subnets[1] if len(settings.subnets) > 1 else settings.subnets[0]
    return f"+{other.name or other.cidr.network_address + 50}"


def _hint(key: str) -> str:
    return FORM_HINTS[key]


def _memory_sizes(limit: int) -> list[int]:
    sizes = [512 * 2**i for i in range(20)]
    return [s for s in sizes if s <= limit][:SELECT_MAX]


def _mib_text(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib >= 1024 else f"{mib} MiB"


# --- reading it back ----------------------------------------------------------------


def state_values(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Block id (without its @suffix) to that block's single element state."""
    values: dict[str, dict[str, Any]] = {}
    for block_id, actions in view.get("state", {}).get("values", {}).items():
        for element in actions.values():
            values[block_id.split("@", 1)[0]] = element
    return values


def block_ids(view: dict[str, Any]) -> dict[str, str]:
    """Block id without its @suffix to the block id the view really has."""
    ids = [str(b["block_id"]) for b in view.get("blocks", []) if b.get("block_id")]
    return {block_id.split("@", 1)[0]: block_id for block_id in ids}


def value(element: dict[str, Any] | None) -> str | None:
    if not element:
        return None
    if element.get("selected_option"):
        return str(element["selected_option"]["value"])
    text = element.get("value")
    return str(text).strip() if text not in (None, "") else None


def choice_of(view: dict[str, Any]) -> Choice:
    values = state_values(view)
    return Choice(
        template=value(values.get("template")),
        placement=value(values.get("placement")),
        storage=value(values.get("storage")),
        network=value(values.get("network")),
    )


@dataclass
class FormResult:
    args: DeployArgs | None
    keys: tuple[str, ...]
    errors: dict[str, str]  # block id -> message


def read_form(view: dict[str, Any], settings: Settings, requester: str) -> FormResult:
    """Check a submission with the configuration only (no hypervisor call)."""
    values = state_values(view)
    ids = block_ids(view)
    errors: dict[str, str] = {}
    required = ("template", "placement", "name", "cores", "memory", "user")
    optional = ("address", "storage", "network", "disk", "lease", "nics")
    got = {key: value(values.get(key)) for key in (*required, *optional)}
    for key in required:
        if got[key] is None:
            errors[key] = missing_field(FORM_LABELS[key])
    keys, key_error = _keys(value(values.get("keys")))
    if key_error:
        errors["keys"] = key_error
    _check_choice(got, errors)
    for key in ("cores", "memory", "disk"):
        if got[key] is not None and not is_whole(str(got[key])):
            errors[key] = f"{FORM_LABELS[key]}: give a whole number."
    if got["name"] and not HOSTNAME_RE.match(got["name"]):
        errors["name"] = FORM_HINTS["name"] + "."
    lease = _lease(got["lease"], settings, errors)
    nics: tuple[tuple[str, ...], tuple[tuple[int, str], ...]] = ((), ())
    try:
        nics = parse_nics(got["nics"] or "")
    except UsageError as exc:
        errors["nics"] = exc.problem
    if errors:
        return FormResult(None, keys, _to_blocks(errors, ids))
    args = _args(got, bool((values.get("upgrade") or {}).get("selected_options")))
    args = dataclasses.replace(args, more_nics=nics[0], macs=nics[1])
    if lease is not None:  # asked: a length, or never (the core decides who may)
        args = dataclasses.replace(args, lease_s=lease[0], lease_never=lease[0] is None)
    try:
        build_request(args, settings, requester, user_keys=keys)
    except RequestInvalid as exc:
        for name, text in (exc.fields or {"": exc.message}).items():
            errors.setdefault(FIELD_BLOCKS.get(name, "name"), text)
        return FormResult(None, keys, _to_blocks(errors, ids))
    return FormResult(args, keys, {})


def _lease(
    text: str | None, settings: Settings, errors: dict[str, str]
) -> tuple[int | None] | None:
    """The lease field: None when empty (the default), else (seconds or None: never)."""
    if text is None:
        return None
    try:
        seconds = parse_length(text)
    except ValueError as exc:
        errors["lease"] = f"{exc}."
        return None
    if seconds is not None and not 0 < seconds <= settings.leases.max:
        errors["lease"] = lease_field_error(settings.leases)
    return (seconds,)


def _check_choice(got: dict[str, str | None], errors: dict[str, str]) -> None:
    template, placement = got["template"], got["placement"]
    if template and placement and template.split("|")[0] != placement.split("/")[0]:
        errors["placement"] = (
            f"{template.split('|')[-1]} is a template on {template.split('|')[0]}: "
            "choose a place on that backend."
        )


def _keys(text: str | None) -> tuple[tuple[str, ...], str | None]:
    keys: list[str] = []
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            keys.append(check_ssh_key(line))
        except ValueError as exc:
            return (), f"Key on line {number}: {exc}."
    return tuple(keys), None


def _args(got: dict[str, str | None], upgrade: bool) -> DeployArgs:
    template = got["template"] or "|"
    return DeployArgs(
        name=got["name"] or "",
        address=got["address"],
        template=template.split("|", 1)[1],
        on=got["placement"],
        storage=got["storage"],
        network=got["network"],
        cores=int(got["cores"] or 0),
        memory_mib=int(got["memory"] or 0),
        disk_grow_gib=int(got["disk"] or 0),
        user=got["user"],
        upgrade=upgrade,  # explicit: an unticked box means no
        given=("template", "on", "cpu", "mem", "disk", "user", "upgrade"),
    )


def _to_blocks(errors: dict[str, str], ids: dict[str, str]) -> dict[str, str]:
    return {ids.get(key, key): fit(text, 2000) for key, text in errors.items()}


def metadata(channel: str, extra: dict[str, str] | None = None) -> str:
    return json.dumps({"channel": channel, **(extra or {})})


# --- the settings modal ---------------------------------------------------------------

SETTINGS_VIEW = "user_settings"


def settings_view(catalog: Catalog, prefs: UserPrefs, metadata: str) -> View:
    keys = "\n".join(prefs.ssh_keys)
    initial = next(
        (
            template_value(b, t.name)
            for b, t in catalog.templates
            if t.name == prefs.default_template
        ),
        None,
    )
    templates = select("default_template", template_options(catalog), initial=initial)
    blocks: list[Block] = [
        _input(
            "keys",
            PlainTextInputElement(action_id="keys", multiline=True, initial_value=keys or None),
            optional=True,
        ),
        _input("default_template", templates, optional=True),
    ]
    return View(
        type="modal",
        callback_id=SETTINGS_VIEW,
        title=SETTINGS_TITLE,
        submit="Save",
        close="Cancel",
        private_metadata=metadata,
        blocks=blocks,
    )


def read_settings(view: dict[str, Any]) -> tuple[tuple[str, ...], str | None, dict[str, str]]:
    """Keys, default template and per-block errors of a settings submission."""
    values = state_values(view)
    keys, error = _keys(value(values.get("keys")))
    template = value(values.get("default_template"))
    errors = {"keys": error} if error else {}
    return keys, template.split("|", 1)[1] if template else None, errors
