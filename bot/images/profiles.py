"""OS build profiles: what the template builder needs to know about one upstream image.

The shipped catalogue (`catalogue.toml`, read with tomllib) names each profile's upstream
cloud image, how to verify it, and what the hypervisor needs to boot it; the `[images]`
section of deploybot.toml overrides any key of a shipped profile or adds profiles of its
own (`[images.profiles.NAME]`). Every profile is validated with pydantic: a bad one
stops the start naming the profile, the key and the reason.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bot.images.fetch import Timeouts
from bot.models.errors import UserError

CATALOGUE = Path(__file__).with_name("catalogue.toml")

_URL = r"^https?://[^\s/]+/\S*$"
_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")
# Proxmox's `ostype` enum (qemu-server's PVE::QemuServer confdesc).
OsType = Literal[
    "other", "wxp", "w2k", "w2k3", "w2k8", "wvista", "win7", "win8", "win10", "win11",
    "l24", "l26", "solaris",
]  # fmt: skip
# The guest agents deploybot can check for in an image (bot/images/customize.AGENT_PROGRAMS).
AgentPackage = Literal["qemu-guest-agent", "open-vm-tools"]
# Platforms an image is prepared for, and the cloud-init datasource each gives a guest.
Platform = Literal["proxmox", "vsphere"]
PLATFORM_DATASOURCE: dict[str, str] = {"proxmox": "NoCloud", "vsphere": "VMware"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _digest(value: str) -> str:
    value = value.strip().lower()
    if not _DIGEST.match(value):
        raise ValueError(
            f"{value!r} is not a digest: write sha256:<64 hex digits> or sha512:<128 hex digits>"
        )
    return value


class PackageFile(_Model):
    """A package file added to the image offline (a .deb or .rpm), pinned by its digest."""

    url: str = Field(pattern=_URL)
    checksum: str

    @field_validator("checksum")
    @classmethod
    def _checksum(cls, value: str) -> str:
        return _digest(value)

    @property
    def file_name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]


class Profile(_Model):
    """One OS: its upstream image and how a template of it is built and booted."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    description: str = ""
    os_family: Literal["debian", "ubuntu", "el"]
    version: str
    url: str = Field(pattern=_URL)
    # Exactly one of: a fixed digest, or the URL of a checksum file (SHA256SUMS, CHECKSUM)
    # holding the image's line, hashed with `checksum_algorithm`.
    checksum: str | None = None
    checksum_url: str | None = Field(default=None, pattern=_URL)
    checksum_algorithm: Literal["sha256", "sha512"] = "sha256"
    format: Literal["qcow2", "raw", "vmdk", "ova"] = "qcow2"
    cpu: Literal["x86-64-v2-AES", "x86-64-v3"] = "x86-64-v2-AES"
    selinux: bool | Literal["detect"] = "detect"
    user: str = Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    ostype: OsType = "l26"
    nic: Literal["virtio", "e1000", "vmxnet3"] = "virtio"
    disk_bus: Literal["scsi", "virtio", "sata", "ide"] = "scsi"
    # The guest agent: present in the image, or installed offline from `packages`. On
    # vSphere the agent is VMware Tools (deploybot reads the guest's address from it).
    agent_package: AgentPackage = "qemu-guest-agent"
    packages: tuple[PackageFile, ...] = ()
    vsphere_agent_package: AgentPackage = "open-vm-tools"
    vsphere_packages: tuple[PackageFile, ...] = ()
    # Datasources cloud-init must be allowed to use; the target platform's is added.
    datasources: tuple[str, ...] = ("NoCloud", "ConfigDrive", "VMware", "None")

    @field_validator("checksum")
    @classmethod
    def _fixed(cls, value: str | None) -> str | None:
        return None if value is None else _digest(value)

    @field_validator("datasources")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", name):
                raise ValueError(f"{name!r} is not a cloud-init datasource name (e.g. NoCloud)")
        return value

    @model_validator(mode="after")
    def _one_checksum(self) -> Profile:
        if (self.checksum is None) == (self.checksum_url is None):
            raise ValueError(
                "give exactly one of `checksum` (sha256:<hex>) and `checksum_url` (the URL "
                "of a SHA256SUMS-style file): an image is never used unverified"
            )
        return self

    @property
    def file_name(self) -> str:
        """The image's file name, as its line in the checksum file names it."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def package_format(self) -> Literal["deb", "rpm"]:
        return "rpm" if self.os_family == "el" else "deb"

    def agent_for(self, platform: Platform) -> tuple[str, tuple[PackageFile, ...], str]:
        """The agent `platform` needs in the guest: its package name, the package files
        that install it offline, and the profile key that lists them."""
        if platform == "vsphere":
            return self.vsphere_agent_package, self.vsphere_packages, "vsphere_packages"
        return self.agent_package, self.packages, "packages"

    def datasources_for(self, platform: Platform) -> tuple[str, ...]:
        """What the image's datasource_list must allow on `platform` (its own first)."""
        own = PLATFORM_DATASOURCE[platform]
        rest = [d for d in self.datasources if d not in (own, "None")]
        return (own, *rest, "None")


class ProfileError(UserError):
    """A profile that does not validate; the message names the profile and the key."""


def _describe(name: str, exc: ValidationError) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        key = ".".join(str(part) for part in error["loc"]) or "(profile)"
        lines.append(f"profile {name!r}: {key}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def build_profile(name: str, data: dict[str, Any]) -> Profile:
    try:
        return Profile.model_validate({**data, "name": name})
    except ValidationError as exc:
        raise ProfileError(_describe(name, exc)) from None


@cache
def _catalogue_raw(path: Path = CATALOGUE) -> dict[str, dict[str, Any]]:
    with path.open("rb") as file:
        data = tomllib.load(file)
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict):
        raise ProfileError(f"{path}: [profiles] must be a table of profiles")
    return profiles


_VERIFICATION = ("checksum", "checksum_url")


def catalogue(overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Profile]:
    """The shipped profiles with `overrides` applied key by key (a new name adds one)."""
    raw = {name: dict(data) for name, data in _catalogue_raw().items()}
    for name, changes in (overrides or {}).items():
        if not isinstance(changes, dict):
            raise ProfileError(f"profile {name!r}: must be a table of keys")
        base = raw.get(name, {})
        if any(key in changes for key in _VERIFICATION):
            # `checksum` and `checksum_url` exclude each other, and TOML cannot unset a
            # key: an override naming one replaces the shipped profile's way of verifying.
            base = {k: v for k, v in base.items() if k not in _VERIFICATION}
        raw[name] = {**base, **changes}
    return {name: build_profile(name, data) for name, data in raw.items()}


class ImagesSettings(_Model):
    """`[images]` in deploybot.toml: where images are cached, how long steps may take,
    and `[images.profiles.NAME]` tables that override or add build profiles."""

    cache_dir: Path = Path("images-cache")
    download_timeout_s: float = Field(default=3600, gt=0)
    connect_timeout_s: float = Field(default=30, gt=0)
    customize_timeout_s: float = Field(default=1800, gt=0)
    # A build's upload, import and conversion to a template; its smoke deploy, end to end.
    create_timeout_s: float = Field(default=3600, gt=0)
    smoke_timeout_s: float = Field(default=1800, gt=0)
    # Where the smoke deploy's address comes from (a [[subnets]] name or CIDR; None: the
    # backend's default subnet, as for a deploy without an address).
    smoke_subnet: str | None = None
    # Older versions of a template `deploybot template gc` keeps (besides those in use):
    # a way back to the last one that worked.
    keep_previous: int = Field(default=1, ge=0)
    # How libguestfs boots its appliance: "tcg" where /dev/kvm exists but cannot run a
    # kernel (nested virtualisation); "auto" lets libguestfs choose.
    accelerator: Literal["auto", "kvm", "tcg"] = "auto"
    profiles: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid_profiles(self) -> ImagesSettings:
        try:
            catalogue(self.profiles)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def fetch_timeouts(self) -> Timeouts:
        return Timeouts(connect_s=self.connect_timeout_s, total_s=self.download_timeout_s)

    def all_profiles(self) -> dict[str, Profile]:
        return catalogue(self.profiles)

    def profile(self, name: str) -> Profile:
        profiles = self.all_profiles()
        if name not in profiles:
            known = ", ".join(sorted(profiles))
            raise ProfileError(f"no build profile {name!r}; known profiles: {known}")
        return profiles[name]
