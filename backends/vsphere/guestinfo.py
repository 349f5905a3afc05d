"""cloud-init documents for VMware's guestinfo channel (the VMware datasource).

The guest's cloud-init (>= 21.3) reads `guestinfo.metadata` and `guestinfo.userdata`,
each decoded as its `.encoding` key says. Both documents are built as data and
serialized, never pasted together from strings: a host name, user name or SSH key can
then hold any character without changing the document's structure.

JSON is YAML, so the serializer is `json.dumps` (no runtime YAML dependency), with one
correction: a YAML reader folds the line breaks NEL, LS and PS and refuses C1 control
characters inside a quoted string, where JSON keeps them raw; those few are written as
`\\uXXXX` escapes, which both languages read back as the same character.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from typing import Any

from backends.base import Identity, PermanentError

ENCODING = "gzip+base64"
METADATA_KEY = "guestinfo.metadata"
USERDATA_KEY = "guestinfo.userdata"

# What YAML reads differently from JSON inside a double-quoted string (see module doc).
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff]")
# A key is one line of authorized_keys: a line break would smuggle in a second key.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def to_yaml(document: Any) -> str:
    """Serialize `document` as JSON that a YAML 1.1 reader (PyYAML, cloud-init) reads back
    to exactly the same data."""
    text = json.dumps(document, ensure_ascii=False, sort_keys=True)
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def metadata(instance_id: str, identity: Identity) -> dict[str, Any]:
    """instance-id, local-hostname and a netplan v2 network for the single NIC.

    `match: {name: "e*"}` finds the NIC whatever the guest calls it (ens192, ens160,
    eth0); no `set-name`, so nothing is renamed.
    """
    ethernet: dict[str, Any] = {
        "match": {"name": "e*"},
        "dhcp4": False,
        "dhcp6": False,
        "addresses": [str(identity.address)],
        "routes": [{"to": "0.0.0.0/0", "via": str(identity.gateway)}],
    }
    nameservers: dict[str, Any] = {}
    if identity.dns:
        nameservers["addresses"] = [str(ip) for ip in identity.dns]
    if identity.search_domain:
        nameservers["search"] = [identity.search_domain]
    if nameservers:
        ethernet["nameservers"] = nameservers
    return {
        "instance-id": instance_id,
        "local-hostname": identity.hostname,
        "network": {"version": 2, "ethernets": {"nic0": ethernet}},
    }


def userdata(identity: Identity) -> dict[str, Any]:
    """The login user with its keys and passwordless sudo; packages upgraded only if asked."""
    for key in identity.ssh_keys:
        if _CONTROL.search(key):
            raise PermanentError(
                f"an SSH key for {identity.user} contains a line break or control character; "
                "give each key as one line"
            )
    return {
        "users": [
            {
                "name": identity.user,
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "shell": "/bin/bash",
                "lock_passwd": True,
                "ssh_authorized_keys": list(identity.ssh_keys),
            }
        ],
        "ssh_pwauth": False,
        "package_update": identity.upgrade,
        "package_upgrade": identity.upgrade,
    }


def encode(text: str) -> str:
    """gzip then base64; mtime=0 so the same document always encodes the same way."""
    return base64.b64encode(gzip.compress(text.encode("utf-8"), mtime=0)).decode("ascii")


def extra_config(instance_id: str, identity: Identity) -> dict[str, str]:
    """The four guestinfo keys: each document and its `.encoding`.

    Without the `.encoding` key cloud-init reads the base64 text as the document itself
    and boots with garbage, silently.
    """
    meta = to_yaml(metadata(instance_id, identity))
    user = "#cloud-config\n" + to_yaml(userdata(identity))
    return {
        METADATA_KEY: encode(meta),
        f"{METADATA_KEY}.encoding": ENCODING,
        USERDATA_KEY: encode(user),
        f"{USERDATA_KEY}.encoding": ENCODING,
    }
