"""Host key pairs as deploybot chooses them for a guest (ed25519, by asyncssh), for the
backends' tests: the same exports the core's identity step hands to a backend."""

from __future__ import annotations

import asyncssh

from backends.base import HostKeyPair


def chosen_host_key() -> HostKeyPair:
    key = asyncssh.generate_private_key("ssh-ed25519")
    private = key.export_private_key("openssh").decode("ascii")
    public = key.export_public_key("openssh").decode("ascii").strip()
    return HostKeyPair(private_openssh=private, public=public)


def public_of(private_openssh: str) -> str:
    """The public half of an OpenSSH private key, as one line without a comment."""
    key = asyncssh.import_private_key(private_openssh)
    return key.export_public_key("openssh").decode("ascii").strip()
