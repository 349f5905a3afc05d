"""SSH public keys as deploybot accepts them: parsed as the key they claim to be."""

from __future__ import annotations

import base64
import binascii
import struct

import asyncssh

SSH_KEY_TYPES = frozenset(
    {
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)
MAX_SSH_KEYS = 10


def check_ssh_key(text: str) -> str:
    """Validate one OpenSSH public key line; return it normalised as `TYPE BODY [COMMENT]`.

    The body is parsed as the key it claims to be (asyncssh), so a key pasted with the
    wrong prefix, cut short or damaged is refused here instead of locking its owner out
    of the VM later. A private key is refused outright, with a warning, because pasting
    one is a leak.
    """
    words = text.strip().split()
    if not words:
        raise ValueError("the key is empty: paste the line from ~/.ssh/id_ed25519.pub")
    if "PRIVATE" in text.upper() and "KEY" in text.upper():
        raise ValueError(
            "that looks like a private key: never paste it anywhere; paste the .pub line"
        )
    kind = words[0]
    if kind not in SSH_KEY_TYPES:
        known = ", ".join(sorted(SSH_KEY_TYPES))
        raise ValueError(f"{kind[:40]!r} is not an SSH public key type; use one of {known}")
    if len(words) < 2:
        raise ValueError(f"the {kind} key has no body: paste the whole line")
    body = words[1]
    try:
        blob = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {kind} key's body is not valid base64") from None
    if _blob_type(blob) != kind:
        raise ValueError(f"the key's body does not hold a {kind} key: paste the line unchanged")
    _parse_key(kind, body)
    comment = " ".join(words[2:])
    return f"{kind} {body}" + (f" {comment}" if comment else "")


def _parse_key(kind: str, body: str) -> None:
    try:
        key = asyncssh.import_public_key(f"{kind} {body}")
    except ValueError:  # asyncssh's KeyImportError and the decoders' errors all are
        key = None
    if key is None or key.get_algorithm() != kind:
        raise ValueError(
            f"the {kind} key is cut short or damaged: copy the whole line from your .pub "
            "file again (cat ~/.ssh/id_ed25519.pub)"
        )


def _blob_type(blob: bytes) -> str | None:
    if len(blob) < 4:
        return None
    (length,) = struct.unpack(">I", blob[:4])
    if length > 64 or len(blob) < 4 + length:
        return None
    try:
        return blob[4 : 4 + length].decode("ascii")
    except UnicodeDecodeError:
        return None
