"""What the hypervisors offer the deploy form, for what it has chosen so far.

`discover` asks the backends (templates, nodes, storage with free space, networks, and
whether the choice means a linked clone or a full copy); it runs after the modal is
open, never before an `ack`. The answer is a `Catalog`, which the bot keeps so that
the template search of a long list can be answered inside its `ack`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slack_sdk.models.blocks import Option

from backends.base import CloneSpec, Network, Storage, Template
from bot.app.service import Deployer
from bot.config.settings import Settings
from bot.models import UserPrefs
from bot.models.errors import BackendError
from handlers.messages.slack import clone_mode
from handlers.slack.views import SELECT_MAX, option


@dataclass(frozen=True)
class Choice:
    """What the form has selected so far; values as the selects carry them."""

    template: str | None = None  # "BACKEND|TEMPLATE"
    placement: str | None = None  # "BACKEND" or "BACKEND/NODE"
    storage: str | None = None
    network: str | None = None

    @property
    def backend(self) -> str | None:
        if self.placement:
            return self.placement.split("/", 1)[0]
        return self.template.split("|", 1)[0] if self.template else None

    @property
    def node(self) -> str | None:
        if self.placement and "/" in self.placement:
            return self.placement.split("/", 1)[1]
        return None


@dataclass
class Catalog:
    """What the backends offer for the current choice."""

    templates: list[tuple[str, Template]] = field(default_factory=list)
    placements: list[str] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    networks: list[Network] = field(default_factory=list)
    clone_note: str | None = None
    problems: list[str] = field(default_factory=list)


def template_value(backend: str, name: str) -> str:
    return f"{backend}|{name}"


def template_options(catalog: Catalog, query: str = "") -> list[Option]:
    wanted = query.lower().strip()
    return [
        option(f"{t.name} ({backend})", template_value(backend, t.name))
        for backend, t in catalog.templates
        if wanted in t.name.lower()
    ][:SELECT_MAX]


async def discover(deployer: Deployer, choice: Choice) -> Catalog:
    """Ask every backend what the form can offer; a backend that fails is reported."""
    catalog = Catalog()
    for backend, found in (await deployer.templates()).items():
        if isinstance(found, str):
            catalog.problems.append(f"{backend}: {found}")
            continue
        catalog.templates.extend((backend, t) for t in found)
    for name, backend_obj in deployer.backends.items():
        catalog.placements.append(name)
        try:
            catalog.placements.extend(f"{name}/{p.name}" for p in await backend_obj.placements())
        except BackendError as exc:
            catalog.problems.append(f"{name}: {exc.message}")
    chosen = deployer.backends.get(choice.backend or deployer.settings.default_backend)
    if chosen is None:
        return catalog
    try:
        catalog.storages = await chosen.storages(choice.node)
        catalog.networks = await chosen.networks(choice.node)
        if choice.template:
            spec = CloneSpec(
                "jpreview", "preview", choice.template.split("|", 1)[1], choice.node, choice.storage
            )
            mode = await chosen.clone_mode(spec)
            catalog.clone_note = clone_mode(mode.linked, mode.reason)
    except BackendError as exc:
        catalog.problems.append(f"{chosen.name}: {exc.message}")
    return catalog


def initial_choice(settings: Settings, prefs: UserPrefs) -> Choice:
    backend = settings.default_backend
    template = prefs.default_template or settings.defaults.template
    return Choice(template=template_value(backend, template), placement=backend)
