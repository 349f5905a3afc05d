"""What every `[[backends]]` entry has: the base model each kind subclasses, the jump
host of its SSH check, and the check that a file it names can be read at start.
(Part of the backend contract beside backends/base.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import asyncssh
from pydantic import BaseModel, ConfigDict, Field, field_validator


def readable_file(path: Path) -> Path:
    """A file named in the configuration (a CA bundle, a key) must be readable at start,
    not found missing at the first deploy."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file: give the path of the file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path} cannot be read by this process: check its permissions")
    return path


class SshJump(BaseModel):
    """A jump host (bastion) for the SSH check, for a bot that cannot reach the guests'
    network itself: the check asks it to open the TCP connection to the guest, as
    `ssh -J` does. The bot's key is a file it can read (a path, like a CA bundle, never
    the key itself); the jump host's own key must be in `known_hosts`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(min_length=1)
    key_file: Path
    known_hosts: Path

    @field_validator("key_file", "known_hosts")
    @classmethod
    def _readable(cls, path: Path) -> Path:
        return readable_file(path)

    @field_validator("key_file")
    @classmethod
    def _a_private_key(cls, path: Path) -> Path:
        try:
            asyncssh.read_private_key(path)
        except (OSError, ValueError) as exc:  # KeyImportError is a ValueError
            raise ValueError(
                f"{path} holds no SSH private key deploybot can use ({exc}); "
                "keys with a passphrase are not supported"
            ) from None
        return path

    def __str__(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


class BackendConfig(BaseModel):
    """One `[[backends]]` entry. Each backend module subclasses it as `Config`, with
    `kind` narrowed to its own literal, and offers `create(config, environ)`.

    Secrets are never fields: a config names the environment variable that holds one
    (e.g. `token_secret_env`), and `create` reads it from `environ`. `ssh_jump` is for
    every kind: the SSH check of this backend's guests goes through that jump host.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    # The keys of a subnet's `[subnets.segments.NAME]` this kind reads (bot/addresses/subnets.py).
    segment_keys: ClassVar[frozenset[str]] = frozenset({"bridge", "vlan", "firewall", "network"})

    kind: str
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")
    ssh_jump: SshJump | None = None
