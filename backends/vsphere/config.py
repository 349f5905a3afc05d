"""The `[[backends]]` entry of a vCenter or a standalone ESXi host."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from backends.base import PermanentError
from backends.config import BackendConfig, readable_file
from backends.vsphere.guestinfo import EtcHosts
from backends.vsphere.nic import OSProfile, check_template_os
from backends.vsphere.session import WAIT_SLICE_S, Endpoint

log = logging.getLogger(__name__)


class Config(BackendConfig):
    """`kind = "vsphere"`: a vCenter or a standalone ESXi host (the server says which).

    Disk provisioning is vSphere's two flags: thin, thick lazy-zeroed (both false) or
    thick eager-zeroed; thin excludes eager. `verify_tls = false` is the explicit
    insecure choice and is logged as a warning at start.
    """

    segment_keys: ClassVar[frozenset[str]] = frozenset({"network"})

    kind: Literal["vsphere"]
    host: str = Field(min_length=1)
    port: int = Field(default=443, ge=1, le=65535)
    user: str = Field(min_length=1)
    password_env: str = Field(default="VSPHERE_PASSWORD", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    verify_tls: bool = True
    ca_bundle: Path | None = None
    datacenter: str | None = None
    compute: str | None = None  # cluster or host; default: the first cluster, else host
    resource_pool: str | None = None  # a pool path inside `compute`, e.g. "deploy/web"
    datastore: str | None = None  # default: the template's
    network: str | None = None  # standard or distributed portgroup; default: the template's
    vm_folder: str | None = None  # under the datacenter's VM folder
    template_folder: str | None = None
    template_annotation: str | None = None  # templates whose annotation contains this
    thin_provisioned: bool = True
    eagerly_scrub: bool = False
    # cloud-init's manage_etc_hosts for the guests: true rewrites /etc/hosts (with the
    # FQDN) at every boot, "localhost" keeps only its own line, false leaves it alone.
    manage_etc_hosts: EtcHosts = True
    # NIC model per OS profile (`nic`): a profile is a guest OS family or a name that
    # template_os gives a template. No profile or no nic_model: the template's NIC.
    os_profiles: dict[str, OSProfile] = Field(default_factory=dict)
    template_os: dict[str, str] = Field(default_factory=dict)
    api_threads: int = Field(default=32, ge=4, le=256)
    request_timeout_s: float = Field(default=90, gt=WAIT_SLICE_S)
    cancel_wait_s: float = Field(default=60, gt=0)

    @field_validator("ca_bundle")
    @classmethod
    def _ca_readable(cls, path: Path | None) -> Path | None:
        return readable_file(path) if path is not None else None

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.thin_provisioned and self.eagerly_scrub:
            raise ValueError(
                "thin_provisioned excludes eagerly_scrub: use thin (thin_provisioned = true), "
                "thick lazy-zeroed (both false) or thick eager-zeroed (eagerly_scrub = true, "
                "thin_provisioned = false)"
            )
        if self.ca_bundle is not None and not self.verify_tls:
            raise ValueError("ca_bundle is set but verify_tls = false: drop one of the two")
        check_template_os(self.template_os, self.os_profiles)
        return self

    @property
    def disk_format(self) -> str:
        if self.thin_provisioned:
            return "thin"
        return "thick eager-zeroed" if self.eagerly_scrub else "thick lazy-zeroed"


def password_of(config: Config, environ: Mapping[str, str]) -> str:
    """The password of a backend entry, from `environ` (a `PermanentError` naming the
    variable when it is not set); a warning is logged when TLS is not verified."""
    password = environ.get(config.password_env)
    if not password:
        raise PermanentError(
            f"backend {config.name}: the password of {config.user} on {config.host} comes "
            f"from the environment variable {config.password_env}, which is not set"
        )
    if not config.verify_tls:
        log.warning(
            "backend %s: TLS certificate verification is OFF for %s (verify_tls = false)",
            config.name,
            config.host,
        )
    return password


def endpoint_of(config: Config) -> Endpoint:
    return Endpoint(
        config.name,
        config.host,
        config.port,
        config.user,
        config.password_env,
        config.verify_tls,
        config.ca_bundle,
        config.api_threads,
        config.request_timeout_s,
        config.cancel_wait_s,
    )
