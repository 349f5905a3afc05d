"""The `[ipam]` section: which address manager, and how to reach NetBox."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.config import readable_file


class IpamConfig(BaseModel):
    """`provider = "builtin"` (the default) needs nothing else. `netbox` needs `url`;
    its API token is read from the environment variable `token_env`, never from here.

    `probe` (off by default) also asks, before a clone, whether something answers on the
    address (a TCP connection to `probe_ports` from the bot, or from the backend's jump
    host): a host that answers, even with a refusal, holds the address. Only addresses
    inside the configured subnets are ever probed.

    `vlan_field` (NetBox only; unset: no VLAN is recorded) names a custom field on NetBox's
    IP addresses, of type Object with related object type IPAM > VLAN: each address
    deploybot reserves gets its subnet's VLAN there, the VLAN of the subnet's NetBox
    prefix (NetBox 4 has no VLAN on an address of its own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: Literal["builtin", "netbox"] = "builtin"
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/@]+(:\d+)?(/[^\s@]*)?$")
    token_env: str = Field(default="DEPLOYBOT_NETBOX_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    verify_tls: bool = True
    ca_bundle: Path | None = None
    tags: tuple[str, ...] = ("deploybot",)
    timeout_s: float = Field(default=10.0, gt=0)
    # A reservation a crash left behind (its job never recorded) is released only after
    # this long: another process may be between reserving and recording it.
    stale_after_s: float = Field(default=600.0, ge=60)
    # NetBox's custom field (on IPAM > IP address, type Object -> IPAM > VLAN) that each
    # reserved address gets its prefix's VLAN in; unset: no VLAN is recorded.
    vlan_field: str | None = None
    probe: bool = False
    probe_ports: tuple[int, ...] = (22,)
    probe_timeout_s: float = Field(default=1.0, gt=0, le=10)

    @field_validator("ca_bundle")
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        return None if path is None else readable_file(path)

    @field_validator("vlan_field")
    @classmethod
    def _field_name(cls, name: str | None) -> str | None:
        # NetBox's own rule for a custom field's name (extras.CustomField.name).
        if name is not None and (not re.fullmatch(r"[a-z0-9_]{1,50}", name) or "__" in name):
            raise ValueError(
                f"{name!r} is not a NetBox custom field name: its Name (not its label), of "
                "lower-case letters, digits and single underscores, e.g. vlan"
            )
        return name

    @field_validator("tags")
    @classmethod
    def _slugs(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        for tag in tags:
            if not tag or not all(c.isascii() and (c.isalnum() or c in "-_") for c in tag):
                raise ValueError(f"{tag!r} is not a tag slug: use letters, digits, - and _")
        return tags

    @model_validator(mode="after")
    def _netbox_needs_url(self) -> IpamConfig:
        if self.provider == "netbox" and not self.url:
            raise ValueError(
                'provider = "netbox" needs url = "https://netbox.example/" (the NetBox '
                "server, without /api)"
            )
        if self.vlan_field is not None and self.provider != "netbox":
            raise ValueError(
                'vlan_field names a NetBox custom field: it goes with provider = "netbox" '
                "(the built-in provider records no VLAN); remove it"
            )
        return self
