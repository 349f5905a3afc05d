"""The cloud-init documents for guestinfo decode, the way cloud-init reads them (base64,
gunzip, a YAML parser), to exactly what was asked, whatever characters the values hold."""

from __future__ import annotations

import base64
import dataclasses
import gzip
import ipaddress
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Identity, PermanentError
from backends.vsphere.guestinfo import extra_config

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8"
# Every character that means something in YAML, in a host name and a key comment.
NASTY = "web: 01 #x - [a, b] {c: d} &anchor *alias !tag | > ' \" % @ ` ? ,\\ --- ..."
IDENTITY = Identity(
    hostname=NASTY,
    user="ops_1",
    ssh_keys=(f"{KEY} alice@laptop: {NASTY}", f"{KEY} bob"),
    address=ipaddress.IPv4Interface("127.0.20.50/24"),
    gateway=ipaddress.IPv4Address("127.0.20.1"),
    dns=(ipaddress.IPv4Address("127.0.20.2"), ipaddress.IPv4Address("127.0.20.3")),
    search_domain="lab.example",
    upgrade=True,
    cores=2,
    memory_mib=2048,
)


def read(extra: dict[str, str], name: str) -> tuple[str, Any]:
    """What cloud-init's VMware datasource does with guestinfo.<name>."""
    assert extra[f"guestinfo.{name}.encoding"] == "gzip+base64"
    text = gzip.decompress(base64.b64decode(extra[f"guestinfo.{name}"])).decode("utf-8")
    return text, yaml.safe_load(text)


def test_the_four_keys_and_nothing_else() -> None:
    extra = extra_config("5029c9f2-d6a4-4d57-9b65-7d1f2c1e0a11", IDENTITY)
    assert sorted(extra) == [
        "guestinfo.metadata",
        "guestinfo.metadata.encoding",
        "guestinfo.userdata",
        "guestinfo.userdata.encoding",
    ]


def test_metadata_decodes_to_exactly_what_was_asked() -> None:
    _text, metadata = read(extra_config("iid-5029c9f2", IDENTITY), "metadata")
    assert metadata == {
        "instance-id": "iid-5029c9f2",
        "local-hostname": NASTY,
        "network": {
            "version": 2,
            "ethernets": {
                "nic0": {
                    "match": {"name": "e*"},
                    "dhcp4": False,
                    "dhcp6": False,
                    "addresses": ["127.0.20.50/24"],
                    "routes": [{"to": "0.0.0.0/0", "via": "127.0.20.1"}],
                    "nameservers": {
                        "addresses": ["127.0.20.2", "127.0.20.3"],
                        "search": ["lab.example"],
                    },
                }
            },
        },
    }


def test_userdata_is_cloud_config_with_the_user_keys_sudo_and_upgrade() -> None:
    text, userdata = read(extra_config("iid-1", IDENTITY), "userdata")
    assert text.startswith("#cloud-config\n")
    assert userdata == {
        "users": [
            {
                "name": "ops_1",
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "shell": "/bin/bash",
                "lock_passwd": True,
                "ssh_authorized_keys": [f"{KEY} alice@laptop: {NASTY}", f"{KEY} bob"],
            }
        ],
        "ssh_pwauth": False,
        "package_update": True,
        "package_upgrade": True,
    }


def test_no_upgrade_unless_asked_and_no_nameservers_without_dns() -> None:
    plain = dataclasses.replace(IDENTITY, upgrade=False, dns=(), search_domain="")
    extra = extra_config("iid-2", plain)
    _text, userdata = read(extra, "userdata")
    assert userdata["package_upgrade"] is False and userdata["package_update"] is False
    _text, metadata = read(extra, "metadata")
    assert "nameservers" not in metadata["network"]["ethernets"]["nic0"]


def test_the_same_identity_encodes_the_same_way() -> None:
    assert extra_config("iid-3", IDENTITY) == extra_config("iid-3", IDENTITY)


@pytest.mark.parametrize("bad", ["\n", "\r", "\x00", "\x85", "\u2028"])
def test_a_key_with_a_line_break_is_refused(bad: str) -> None:
    """One key must stay one authorized_keys line, or it smuggles in a second key."""
    smuggler = dataclasses.replace(IDENTITY, ssh_keys=(f"{KEY} x{bad}ssh-rsa AAAAB3 evil",))
    with pytest.raises(PermanentError, match="line break"):
        extra_config("iid-4", smuggler)


# Printable text of every script and symbol (YAML's own line breaks and C1 controls are
# escaped by the serializer, so they belong here too).
any_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
key_text = st.text(
    st.characters(exclude_categories=["Cs", "Cc", "Zl", "Zp"]), min_size=1, max_size=60
)


@settings(max_examples=200, deadline=None)
@given(hostname=any_text, user=any_text, search=any_text, keys=st.lists(key_text, max_size=3))
def test_any_text_comes_back_unchanged(
    hostname: str, user: str, search: str, keys: list[str]
) -> None:
    identity = dataclasses.replace(
        IDENTITY, hostname=hostname, user=user, search_domain=search, ssh_keys=tuple(keys)
    )
    extra = extra_config("iid-5", identity)
    _text, metadata = read(extra, "metadata")
    _text, userdata = read(extra, "userdata")
    assert metadata["local-hostname"] == hostname
    assert metadata["network"]["ethernets"]["nic0"].get("nameservers", {}).get("search") == (
        [search] if search else None
    )
    assert userdata["users"][0]["name"] == user
    assert userdata["users"][0]["ssh_authorized_keys"] == keys
