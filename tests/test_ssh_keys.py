"""Public SSH keys are parsed for real: a cut or damaged key is refused when it is saved."""

from __future__ import annotations

import base64

import asyncssh
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.app.service import Deployer
from bot.models.errors import RequestInvalid
from bot.models.keys import check_ssh_key

KINDS = ("ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384")


def public_line(kind: str, comment: str = "") -> str:
    options = {"key_size": 2048} if kind == "ssh-rsa" else {}
    key = asyncssh.generate_private_key(kind, comment=comment or None, **options)
    return key.export_public_key().decode().strip()


@pytest.fixture(scope="module")
def lines() -> dict[str, str]:
    return {kind: public_line(kind, "alice@laptop") for kind in KINDS}


def test_real_keys_are_kept_normalised(lines: dict[str, str]) -> None:
    for kind, line in lines.items():
        assert check_ssh_key(line) == line
        kind_, body, comment = line.split(" ", 2)
        assert check_ssh_key(f"  {kind_}   {body}\t{comment} extra ") == f"{line} extra"
        assert check_ssh_key(f"{kind_} {body}") == f"{kind} {body}"


def test_a_key_cut_short_is_refused(lines: dict[str, str]) -> None:
    for kind, line in lines.items():
        _kind, body, _comment = line.split(" ", 2)
        cut = body[: len(body) // 8 * 4]  # still valid base64: only the parse can tell
        base64.b64decode(cut, validate=True)
        with pytest.raises(ValueError, match=f"the {kind} key is cut short or damaged"):
            check_ssh_key(f"{kind} {cut}")


def test_a_damaged_key_is_refused(lines: dict[str, str]) -> None:
    kind, body, _comment = lines["ecdsa-sha2-nistp256"].split(" ", 2)
    blob = bytearray(base64.b64decode(body))
    blob[-5] ^= 0xFF  # the point is no longer on the curve
    damaged = base64.b64encode(bytes(blob)).decode()
    with pytest.raises(ValueError, match="cut short or damaged: copy the whole line"):
        check_ssh_key(f"{kind} {damaged}")


def test_the_old_refusals_still_hold(lines: dict[str, str]) -> None:
    _kind, body, _comment = lines["ssh-ed25519"].split(" ", 2)
    with pytest.raises(ValueError, match="does not hold a ssh-rsa key"):
        check_ssh_key(f"ssh-rsa {body}")
    with pytest.raises(ValueError, match="private key"):
        check_ssh_key("-----BEGIN OPENSSH PRIVATE KEY----- b3BlbnNzaC1rZXktdjEAAAAA")
    with pytest.raises(ValueError, match="not valid base64"):
        check_ssh_key("ssh-ed25519 AAAA!!")
    with pytest.raises(ValueError, match="is empty"):
        check_ssh_key("   ")


async def test_saving_a_cut_key_says_so(deployer: Deployer, lines: dict[str, str]) -> None:
    line = lines["ssh-ed25519"]
    kind, body, _comment = line.split(" ", 2)
    with pytest.raises(RequestInvalid, match="SSH key: the ssh-ed25519 key is cut short"):
        await deployer.save_ssh_key("alice", f"{kind} {body[:40]}")
    assert (await deployer.prefs("alice")).ssh_keys == ()
    saved = await deployer.save_ssh_key("alice", line)
    assert saved.ssh_keys == (line,)


_KIND = st.sampled_from(KINDS)


@settings(max_examples=300, deadline=None)
@given(_KIND, st.binary(max_size=200))
def test_any_body_is_refused_with_a_value_error_or_kept(kind: str, rest: bytes) -> None:
    """A body that starts with the right type but carries any bytes after it."""
    prefix = len(kind).to_bytes(4, "big") + kind.encode()
    body = base64.b64encode(prefix + rest).decode()
    try:
        kept = check_ssh_key(f"{kind} {body}")
    except ValueError:
        return
    assert kept == f"{kind} {body}"
    assert asyncssh.import_public_key(kept).get_algorithm() == kind


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_is_refused_with_a_value_error_or_normalised(text: str) -> None:
    try:
        kept = check_ssh_key(text)
    except ValueError:
        return
    assert check_ssh_key(kept) == kept
