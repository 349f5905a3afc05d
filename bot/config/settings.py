"""Configuration: one TOML file plus environment variables for secrets.

The file comes from `DEPLOYBOT_CONFIG`, else `./deploybot.toml`, else the example bundled
with the package, so `deploybot demo` works on a fresh machine with no file at all. A bad
file stops the start with the file, the key and the reason: a bot that guesses at its
own configuration deploys to the wrong place.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from backends.config import BackendConfig
from backends.ipam.config import IpamConfig
from bot.addresses.subnets import Subnet
from bot.config.sections import (
    ApprovalPolicy,
    Defaults,
    Limits,
    MetricsSettings,
    MigrationSettings,
    OwnershipSettings,
    Recovery,
    SlackSettings,
    SshSettings,
    StoreSettings,
    Timeouts,
)
from bot.images.profiles import ImagesSettings
from bot.leases.terms import LeaseSettings
from bot.models.errors import ConfigError, format_errors
from bot.requests.quotas import QuotaSettings
from store.db import POSTGRES_SCHEMES

BUNDLED_CONFIG = Path(__file__).with_name("deploybot.example.toml")


# Each kind is one module in backends/ with a `Config` model and a `create` factory.
BACKEND_MODULES = {
    "sim": "backends.sim",
    "proxmox": "backends.proxmox",
    "vsphere": "backends.vsphere",
}


def backend_module(kind: str) -> ModuleType:
    return importlib.import_module(BACKEND_MODULES[kind])


def _backend_configs(raw: object) -> tuple[list[BackendConfig], list[ErrorDetails]]:
    """Validate each `[[backends]]` entry against its own kind's model."""
    if not isinstance(raw, list | tuple):
        return [], []  # Settings reports the wrong type itself
    configs: list[BackendConfig] = []
    errors: list[ErrorDetails] = []
    for index, entry in enumerate(raw):
        kind = entry.get("kind") if isinstance(entry, dict) else None
        if kind not in BACKEND_MODULES:
            kinds = ", ".join(repr(k) for k in BACKEND_MODULES)
            message = f"unknown or missing kind {kind!r}; use one of {kinds}"
            errors.append(
                {
                    "type": "value_error",
                    "loc": ("backends", index, "kind"),
                    "msg": message,
                    "input": kind,
                    "ctx": {},
                }
            )
            continue
        try:
            configs.append(backend_module(kind).Config.model_validate(entry))
        except ValidationError as exc:
            for error in exc.errors(include_url=False):
                errors.append({**error, "loc": ("backends", index, *error["loc"])})
    return configs, errors


class Settings(BaseSettings):
    # DEPLOYBOT_LIMITS__MAX_RUNNING=3 sets [limits] max_running, and wins over the file:
    # container operators set what differs per deployment in the environment.
    model_config = SettingsConfigDict(
        env_prefix="DEPLOYBOT_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The environment first (it wins), then the file's values (passed in by
        `load_settings`); sections are merged key by key, not replaced whole."""
        return (env_settings, init_settings)

    # A SQLite file, or postgresql://user@host:port/dbname?sslmode=... for replicas
    # (the password is read from the variable named by database_password_env).
    database: Path | str = Path("deploybot.db")
    database_password_env: str = "DEPLOYBOT_DATABASE_PASSWORD"
    log_file: Path = Path("deploybot.log")
    log_format: Literal["text", "json"] = "text"  # json: one object a line, with job fields
    backends: tuple[BackendConfig, ...] = Field(min_length=1)
    subnets: tuple[Subnet, ...] = Field(min_length=1)
    defaults: Defaults = Defaults()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    approval: ApprovalPolicy = ApprovalPolicy()
    recovery: Recovery = Recovery()
    ownership: OwnershipSettings = OwnershipSettings()
    slack: SlackSettings = SlackSettings()
    metrics: MetricsSettings = MetricsSettings()
    store: StoreSettings = StoreSettings()
    ipam: IpamConfig = IpamConfig()
    quotas: QuotaSettings = QuotaSettings()  # bot/requests/quotas.py
    leases: LeaseSettings = LeaseSettings()
    images: ImagesSettings = ImagesSettings()  # bot/images/: template build profiles
    ssh: SshSettings = SshSettings()  # bot/sshca/: host certificates
    migration: MigrationSettings = MigrationSettings()  # bot/migration/: `migrate apply`

    @field_validator("database", mode="before")
    @classmethod
    def _database(cls, value: Any) -> Any:
        if not isinstance(value, str) or not value.startswith(POSTGRES_SCHEMES):
            return Path(value) if isinstance(value, str) else value
        parts = urlsplit(value)
        query = parse_qs(parts.query)
        if parts.password is not None or "password" in query:
            raise ValueError(
                "the URL holds a password: remove it, and put the password in the "
                "environment variable named by database_password_env "
                "(DEPLOYBOT_DATABASE_PASSWORD by default); the URL is shown in logs"
            )
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError(
                "a PostgreSQL URL names a host and a database, as in "
                "postgresql://deploybot@db.example.com:5432/deploybot"
            )
        return value

    @property
    def database_password(self) -> str | None:
        """PostgreSQL's password from the environment (None: libpq's PGPASSWORD or
        ~/.pgpass may still supply one)."""
        return os.environ.get(self.database_password_env) or None

    @field_validator("log_file")
    @classmethod
    def _log_folder(cls, path: Path) -> Path:
        if not path.parent.is_dir():
            raise ValueError(
                f"the folder {path.parent} does not exist: create it, or point log_file "
                "at a file in a folder that does"
            )
        return path

    @field_validator("subnets")
    @classmethod
    def _apart(cls, subnets: tuple[Subnet, ...]) -> tuple[Subnet, ...]:
        """An address in two subnets would take its gateway and DNS from whichever comes
        first: the file must say which."""
        for i, one in enumerate(subnets):
            for other in subnets[i + 1 :]:
                if one.cidr.overlaps(other.cidr):
                    what = "is listed twice" if one.cidr == other.cidr else f"overlaps {other.cidr}"
                    raise ValueError(f"{one.cidr} {what}: each address must belong to one subnet")
                if one.name and one.name == other.name:
                    raise ValueError(f"two subnets are named {one.name!r}: names must be unique")
        return subnets

    @model_validator(mode="after")
    def _references(self) -> Settings:
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique, got {names}")
        if self.defaults.backend is not None and self.defaults.backend not in names:
            raise ValueError(f"defaults.backend {self.defaults.backend!r} is not one of {names}")
        for unknown in set(self.approval.backends) - set(names):
            raise ValueError(f"approval.backends names {unknown!r}, not one of {names}")
        if (
            self.quotas.over == "approval"
            and not self.approval.approvers + self.approval.approver_groups
        ):
            raise ValueError(
                'quotas.over = "approval" needs approval.approvers (or approver_groups)'
            )
        self._defaults_within_limits()
        smoke = self.images.smoke_subnet
        if smoke is not None and not any(smoke in (s.name, str(s.cidr)) for s in self.subnets):
            known = ", ".join(str(s) for s in self.subnets)
            raise ValueError(f"images.smoke_subnet {smoke!r} is not a subnet; use one of {known}")
        for subnet in self.subnets:
            for unknown in set(subnet.backends + subnet.vms_on) - set(names):
                raise ValueError(
                    f"subnet {subnet.label} names backend {unknown!r}, not one of {names}"
                )
            self._segments_fit(subnet)
        return self

    def _segments_fit(self, subnet: Subnet) -> None:
        """Each `[subnets.segments.NAME]` names a backend and gives what its kind reads:
        a Proxmox bridge (vlan, firewall), a vSphere network."""
        for name, segment in subnet.segments.items():
            backend = self.backend(name)
            where = f"subnet {subnet.cidr}: [subnets.segments.{name}]"
            if backend is None:
                known = ", ".join(b.name for b in self.backends)
                raise ValueError(f"{where} names no backend: use one of {known}")
            takes = type(backend).segment_keys
            wrong = sorted(segment.keys() - takes)
            if not wrong:
                continue
            if takes == {"network"}:
                what = (
                    "network (a standard network or distributed portgroup by name; its VLAN "
                    "comes with the portgroup)"
                )
            else:
                what = ", ".join(sorted(takes))
            raise ValueError(
                f"{where}: {name} is a {backend.kind} backend, which takes {what}, "
                f"not {', '.join(wrong)}"
            )

    def _defaults_within_limits(self) -> None:
        """A default over its limit would refuse every deploy that does not set it."""
        d, limits = self.defaults, self.limits
        for key, value, limit, unit in (
            ("cores", d.cores, limits.max_cores, ""),
            ("memory_mib", d.memory_mib, limits.max_memory_mib, " MiB"),
            ("disk_grow_gib", d.disk_grow_gib, limits.max_disk_grow_gib, " GiB"),
        ):
            if value > limit:
                raise ValueError(
                    f"defaults.{key} ({value}{unit}) is over limits.max_{key} ({limit}{unit}), "
                    f"so every deploy that does not set it would be refused: lower one or "
                    f"raise the other"
                )

    @property
    def default_backend(self) -> str:
        return self.defaults.backend or self.backends[0].name

    def backend(self, name: str) -> BackendConfig | None:
        return next((b for b in self.backends if b.name == name), None)

    def subnet_for(self, address: ipaddress.IPv4Address) -> Subnet | None:
        return next((s for s in self.subnets if address in s.cidr), None)


def config_path(explicit: str | Path | None = None) -> Path:
    """Which file to read: argument, `DEPLOYBOT_CONFIG`, ./deploybot.toml, bundled example."""
    chosen = explicit or os.environ.get("DEPLOYBOT_CONFIG")
    if chosen:
        return Path(chosen)
    local = Path("deploybot.toml")
    return local if local.exists() else BUNDLED_CONFIG


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read and validate the configuration; a `ConfigError` names the file, key and reason."""
    source = config_path(path)
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{source}: no such file. Set DEPLOYBOT_CONFIG to your deploybot.toml, or unset it "
            "to use the bundled example."
        ) from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    data.update(overrides)
    raw = data.get("backends")
    configs, errors = _backend_configs(raw)
    if isinstance(raw, list | tuple):
        data["backends"] = configs
    broken_backends = bool(errors)
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            # With a broken backend entry, "too few backends" and cross-checks against
            # the backend list would only repeat the real problem.
            if broken_backends and error["loc"] in (("backends",), ()):
                continue
            errors.append(error)
    if errors:
        raise ConfigError(format_errors(source, errors, _env_variable))
    return settings


def _env_variable(loc: tuple[str | int, ...]) -> str | None:
    """The environment variable that set the value at `loc` (or the section holding it),
    as `Settings` reads them: DEPLOYBOT_ + keys joined by __, in any case."""
    prefix = Settings.model_config.get("env_prefix", "")
    names = {name.upper(): name for name in os.environ}
    for end in range(len(loc), 0, -1):
        wanted = (prefix + "__".join(str(part) for part in loc[:end])).upper()
        if wanted in names:
            return names[wanted]
    return None
