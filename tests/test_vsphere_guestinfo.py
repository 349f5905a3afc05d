"""The cloud-init documents for guestinfo decode, the way cloud-init reads them (base64,
gunzip, a YAML parser), to exactly what was asked, whatever characters the values hold.
What cloud-init 22.4 itself makes of them: tests/test_cloudinit_renderers.py."""

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
from backends.vsphere.guestinfo import EtcHosts, extra_config

MAC = "00:50:56:0a:1b:2c"
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
    extra = extra_config("5029c9f2-d6a4-4d57-9b65-7d1f2c1e0a11", IDENTITY, MAC)
    assert sorted(extra) == [
        "guestinfo.metadata",
        "guestinfo.metadata.encoding",
        "guestinfo.userdata",
        "guestinfo.userdata.encoding",
    ]


def test_metadata_decodes_to_exactly_what_was_asked() -> None:
    """The NIC is found by its MAC (cloud-init renames it eth0), the host name is the
    FQDN in the subnet's search domain."""
    _text, metadata = read(extra_config("iid-5029c9f2", IDENTITY, MAC.upper()), "metadata")
    assert metadata == {
        "instance-id": "iid-5029c9f2",
        "local-hostname": f"{NASTY}.lab.example",
        "network": {
            "version": 1,
            "config": [
                {
                    "type": "physical",
                    "name": "eth0",
                    "mac_address": MAC,
                    "subnets": [
                        {
                            "type": "static",
                            "address": "127.0.20.50/24",
                            "gateway": "127.0.20.1",
                            "dns_nameservers": ["127.0.20.2", "127.0.20.3"],
                            "dns_search": ["lab.example"],
                        }
                    ],
                }
            ],
        },
    }


def test_userdata_is_cloud_config_with_the_user_keys_sudo_upgrade_and_names() -> None:
    text, userdata = read(extra_config("iid-1", IDENTITY, MAC), "userdata")
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
        "hostname": NASTY,
        "fqdn": f"{NASTY}.lab.example",
        "manage_etc_hosts": True,
    }


def test_no_upgrade_unless_asked_no_dns_and_no_domain_without_them() -> None:
    plain = dataclasses.replace(IDENTITY, hostname="web01", upgrade=False, dns=(), search_domain="")
    extra = extra_config("iid-2", plain, MAC)
    _text, userdata = read(extra, "userdata")
    assert userdata["package_upgrade"] is False and userdata["package_update"] is False
    assert (userdata["hostname"], userdata["fqdn"]) == ("web01", "web01")
    _text, metadata = read(extra, "metadata")
    assert metadata["local-hostname"] == "web01"
    (subnet,) = metadata["network"]["config"][0]["subnets"]
    assert subnet == {"type": "static", "address": "127.0.20.50/24", "gateway": "127.0.20.1"}


@pytest.mark.parametrize("policy", [True, False, "localhost"])
def test_etc_hosts_follows_the_backends_policy(policy: EtcHosts) -> None:
    _text, userdata = read(extra_config("iid-6", IDENTITY, MAC, policy), "userdata")
    assert userdata["manage_etc_hosts"] == policy


def test_a_trailing_dot_is_not_part_of_the_fqdn() -> None:
    dotted = dataclasses.replace(IDENTITY, hostname="web01", search_domain="lab.example.")
    _text, metadata = read(extra_config("iid-7", dotted, MAC), "metadata")
    assert metadata["local-hostname"] == "web01.lab.example"


def test_the_same_identity_encodes_the_same_way() -> None:
    assert extra_config("iid-3", IDENTITY, MAC) == extra_config("iid-3", IDENTITY, MAC)


@pytest.mark.parametrize("bad", ["\n", "\r", "\x00", "\x85", "\u2028"])
def test_a_key_with_a_line_break_is_refused(bad: str) -> None:
    """One key must stay one authorized_keys line, or it smuggles in a second key."""
    smuggler = dataclasses.replace(IDENTITY, ssh_keys=(f"{KEY} x{bad}ssh-rsa AAAAB3 evil",))
    with pytest.raises(PermanentError, match="line break"):
        extra_config("iid-4", smuggler, MAC)


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
    extra = extra_config("iid-5", identity, MAC)
    _text, metadata = read(extra, "metadata")
    _text, userdata = read(extra, "userdata")
    domain = search.strip().strip(".")
    assert (
        metadata["local-hostname"]
        == userdata["fqdn"]
        == (f"{hostname}.{domain}" if domain else hostname)
    )
    assert userdata["hostname"] == hostname
    (subnet,) = metadata["network"]["config"][0]["subnets"]
    assert subnet.get("dns_search") == ([search] if search else None)
    assert userdata["users"][0]["name"] == user
    assert userdata["users"][0]["ssh_authorized_keys"] == keys
