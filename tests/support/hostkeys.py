"""Host key pairs as deploybot chooses them for a guest (ed25519, by asyncssh), for the
backends' tests: the same exports the core's identity step hands to a backend."""

from __future__ import annotations

import time

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


def host_certificate(
    public: str, principals: tuple[str, ...] = ("web01",), ca: asyncssh.SSHKey | None = None
) -> str:
    """An OpenSSH host certificate line of `public`, signed by `ca` (a throw-away one when
    not given), as deploybot's host CA signs one, valid from an hour ago for a day."""
    ca = ca or asyncssh.generate_private_key("ssh-ed25519")
    now = int(time.time())
    certificate = ca.generate_host_certificate(
        asyncssh.import_public_key(public),
        "deploybot:test:web01",
        principals=list(principals),
        valid_after=now - 3600,
        valid_before=now + 86400,
    )
    line = certificate.export_certificate("openssh").decode("ascii")
    return " ".join(line.split()[:2])  # no comment, as deploybot's CA writes it
