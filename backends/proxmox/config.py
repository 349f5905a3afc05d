"""The `[[backends]]` entry of `kind = "proxmox"`, its OS profiles and its credentials.

Secrets are never fields: the config names the environment variables that hold the API
token secret or the password, and `credentials` reads them, naming the variable that is
missing when neither is there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.advice import nic_model_choice
from backends.base import PermanentError
from backends.config import BackendConfig, readable_file
from backends.proxmox.http import ApiSettings, Credentials
from backends.proxmox.pacing import PollTiming

log = logging.getLogger(__name__)


NIC_MODELS: tuple[str, ...] = ("virtio", "e1000", "vmxnet3", "rtl8139")


class OSProfile(BaseModel):
    """Per guest OS family: CPU baseline (None: the site default), login user, NIC model
    (None: the template's own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu: str | None = None
    user: str = "ubuntu"
    # Whether the guest has a driver for it cannot be read from the API: virtio is in
    # every Linux kernel, so it is trusted for Linux profiles; a Windows guest needs the
    # virtio-win drivers in its template, otherwise its profile must say e1000.
    nic_model: Literal["virtio", "e1000", "vmxnet3", "rtl8139"] | None = None

    @field_validator("nic_model", mode="before")
    @classmethod
    def _known_nic(cls, value: object) -> object:
        if value is not None and value not in NIC_MODELS:
            raise ValueError(nic_model_choice(value, NIC_MODELS, "Proxmox"))
        return value


DEFAULT_PROFILES: dict[str, OSProfile] = {
    "ubuntu": OSProfile(user="ubuntu"),
    "debian": OSProfile(user="debian"),
    # EL9 glibc needs x86-64-v2, EL10 x86-64-v3: on kvm64 PID 1 dies and the kernel panics.
    "el9": OSProfile(cpu="x86-64-v2-AES", user="cloud-user"),
    "el10": OSProfile(cpu="x86-64-v3", user="cloud-user"),
}


# What a first deploy expects when nothing is recorded (a new database): a linked clone
# of a cloud image and its first boot on a small cluster (and the fake's defaults).
# Too short costs a look or two (the looks after it back off geometrically); too long
# costs time, so these are on the short side of typical.
TYPICAL_S: dict[str, float] = {
    "clone": 2.0,
    "config": 0.2,
    "resize": 0.3,
    "start": 1.0,
    "stop": 0.5,
    "delete": 0.3,
    "boot": 3.0,
}


class Config(BackendConfig):
    """`kind = "proxmox"`. An API token (`token_id`, its secret in `$token_secret_env`)
    is used when its secret is set; otherwise a password login (`$password_env`).
    A template's OS family comes from an `os-<family>` tag on it, else `template_os`,
    else its name (ubuntu*, debian*, rocky-9 -> el9, ...)."""

    segment_keys: ClassVar[frozenset[str]] = frozenset({"bridge", "vlan", "firewall"})

    kind: Literal["proxmox"]
    host: str = Field(min_length=1)
    port: int = Field(default=8006, ge=1, le=65535)
    user: str = Field(default="root@pam", pattern=r"^[^@!\s:]+@[A-Za-z][A-Za-z0-9.\-_]+$")
    token_id: str | None = Field(default=None, pattern=r"^[A-Za-z][A-Za-z0-9.\-_]*$")
    token_secret_env: str = "PVE_TOKEN_SECRET"
    password_env: str | None = "PVE_PASSWORD"
    verify_tls: bool = True  # false is the explicit insecure choice, logged at start
    ca_bundle: Path | None = None  # *_PROXY and REQUESTS_CA_BUNDLE are never consulted
    node: str | None = None  # default node: discovery, and clones of shared templates
    storage: str | None = None  # default target storage; None: the template's own
    bridge: str | None = None  # None: keep the template's bridge
    cpu: str = "x86-64-v2-AES"  # the site default CPU model, for profiles without one
    os_profiles: dict[str, OSProfile] = Field(default_factory=lambda: dict(DEFAULT_PROFILES))
    template_os: dict[str, str] = Field(default_factory=dict)
    request_timeout_s: float = Field(default=15.0, gt=0)
    max_parallel_requests: int = Field(default=8, ge=1, le=64)  # connections at once
    ticket_renew_s: float = Field(default=3600.0, gt=0, lt=7200)  # tickets live 2 h
    # Task polls: every initial_s at first, then every `ratio` of the time waited so far
    # (so a poll adds at most ~5% to a task), capped at max_s.
    task_poll_initial_s: float = Field(default=0.1, gt=0)
    task_poll_ratio: float = Field(default=0.05, gt=0, le=1)
    task_poll_max_s: float = Field(default=2.0, gt=0)
    # Until a kind of wait has a history (this template's, else another template's on
    # this backend), its first look comes at this many seconds (operations: clone,
    # config, resize, start, stop, delete, boot = start to the guest agent's first
    # answer); an operation not named is polled fast. Setting it replaces the typical
    # durations below. Afterwards the look comes when the same operation usually ended
    # (see `pacing`).
    expect_s: dict[str, float] = Field(default_factory=lambda: dict(TYPICAL_S))
    task_timeout_s: float = Field(default=3600.0, gt=0)
    task_log_lines: int = Field(default=5, ge=0)
    lock_retries: int = Field(default=3, ge=0)  # a clone whose request got no answer
    lock_backoff_s: float = Field(default=1.0, ge=0)  # first pause; doubles, up to 10 s
    # How long a lock someone else holds (`lock: backup`, or a file lock that stays taken)
    # is waited for before the call fails naming it; well within the step timeouts, so
    # the job says which lock rather than "timed out". Our own clone is waited for longer.
    lock_wait_s: float = Field(default=60.0, ge=0)
    agent_poll_initial_s: float = Field(default=0.1, gt=0)  # guests take seconds to boot
    # wait_for_address polls this long, then reports how the agent is doing (a
    # RetryableError the pipeline records) and is called again: long against the
    # pipeline's retry pause, so the agent is rarely left unwatched.
    agent_poll_window_s: float = Field(default=30.0, gt=0)
    discovery_cache_s: float = Field(default=60.0, ge=0)
    # addresses_in_use reads every VM's config (and running guests' agents): one sweep
    # serves the callers of this long, at most this many of its requests at once.
    addresses_cache_s: float = Field(default=30.0, ge=0)
    addresses_parallel: int = Field(default=4, ge=1, le=64)

    @field_validator("ca_bundle")
    @classmethod
    def _ca_readable(cls, path: Path | None) -> Path | None:
        return readable_file(path) if path is not None else None

    @field_validator("os_profiles")
    @classmethod
    def _over_defaults(cls, value: dict[str, OSProfile]) -> dict[str, OSProfile]:
        return {**DEFAULT_PROFILES, **value}

    @model_validator(mode="after")
    def _tls(self) -> Config:
        if self.ca_bundle is not None and not self.verify_tls:
            raise ValueError("ca_bundle is set but verify_tls = false: choose one")
        return self

    def api_settings(self) -> ApiSettings:
        verify: bool | str = str(self.ca_bundle) if self.ca_bundle else self.verify_tls
        return ApiSettings(
            host=self.host,
            port=self.port,
            verify=verify,
            request_timeout_s=self.request_timeout_s,
            max_parallel=self.max_parallel_requests,
            ticket_renew_s=self.ticket_renew_s,
            polling=PollTiming(
                self.task_poll_initial_s, self.task_poll_ratio, self.task_poll_max_s
            ),
            task_timeout_s=self.task_timeout_s,
            log_lines=self.task_log_lines,
        )


def credentials(config: Config, environ: Mapping[str, str]) -> Credentials:
    """The token if its secret is set, else the password; an error naming the variable."""
    if config.token_id and environ.get(config.token_secret_env):
        return Credentials(
            config.user,
            config.token_id,
            token_secret=environ[config.token_secret_env],
            secret_source=config.token_secret_env,
        )
    if config.password_env and environ.get(config.password_env):
        if config.token_id:
            log.warning(
                "%s: $%s is not set; logging in with the password instead of the API token",
                config.name,
                config.token_secret_env,
            )
        return Credentials(
            config.user, password=environ[config.password_env], secret_source=config.password_env
        )
    wanted = [f"${config.token_secret_env}"] if config.token_id else []
    wanted += [f"${config.password_env}"] if config.password_env else []
    hint = " or ".join(wanted) or "a token_id and its secret variable"
    raise PermanentError(
        f"backend {config.name}: no Proxmox credentials: set {hint} in the environment"
    )
