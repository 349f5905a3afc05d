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
import zlib
from collections.abc import Sequence
from typing import Any, Literal

import asyncssh

from backends.base import HostKeyPair, Identity, Nic, PermanentError

ENCODING = "gzip+base64"
METADATA_KEY = "guestinfo.metadata"
USERDATA_KEY = "guestinfo.userdata"
# The name cloud-init gives the guest's NIC (found by MAC): the kernel's own name for a
# single NIC, and the one Proxmox's generated cloud-init data uses too; the further NICs
# are eth1, eth2, ... in `Identity.more_nics`' order.
NIC_NAME = "eth0"
# The OpenSSH certificate of an ed25519 host key (the only host key type deploybot chooses).
CERTIFICATE_TYPE = "ssh-ed25519-cert-v01@openssh.com"
# A later NIC's gateway (its subnet's `gateway_when_not_first`): a default route with a
# metric above the first NIC's, so the default route stays on the first.
LATER_GATEWAY_METRIC = 200
# cloud-init's `manage_etc_hosts`: true, false or "localhost".
EtcHosts = bool | Literal["localhost"]

# What YAML reads differently from JSON inside a double-quoted string (see module doc).
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff]")
# A key is one line of authorized_keys: a line break would smuggle in a second key.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A private key's text is lines: any control character but the line break is damage.
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
# What a cloud-config holding a private host key contains: cloud-init's `ssh_keys`
# entries (cc_ssh's CONFIG_KEY_TO_FILE) or a PEM/OpenSSH private key block.
_PRIVATE_KEY = re.compile(r"\b(?:rsa|dsa|ecdsa|ed25519)_private\b|PRIVATE KEY-----")
# guestinfo.userdata once `forget` has run: both keys blank (vSphere removes a key set
# to ""; the datasource reads an empty value as no user-data, whatever the encoding).
FORGOTTEN = {USERDATA_KEY: "", f"{USERDATA_KEY}.encoding": ""}


def to_yaml(document: Any) -> str:
    """Serialize `document` as JSON that a YAML 1.1 reader (PyYAML, cloud-init) reads back
    to exactly the same data."""
    text = json.dumps(document, ensure_ascii=False, sort_keys=True)
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def fqdn(identity: Identity) -> str:
    """The guest's fully qualified name: its host name in the subnet's search domain
    (a trailing dot dropped), or the bare host name when the subnet has none."""
    domain = identity.search_domain.strip().strip(".")
    return f"{identity.hostname}.{domain}" if domain else identity.hostname


def network(identity: Identity, mac: str, more_macs: Sequence[str] = ()) -> dict[str, Any]:
    """cloud-init network config v1 listing every NIC by its MAC: the first (`mac`) named
    `NIC_NAME`, then `identity.more_nics` with `more_macs` (same order) eth1, eth2, ...

    Why this shape (each renderer of cloud-init 22.4 checked by
    tests/test_cloudinit_renderers.py): a `physical` entry with `mac_address` makes
    cloud-init rename the NIC with that MAC to its name at boot, before it writes
    any config, so every renderer's output names the real device: netplan matches the
    MAC and sets the name, networkd `[Match] MACAddress=` + `Name=`, NetworkManager
    `mac-address=`, sysconfig `HWADDR=` + `DEVICE=`, ENI `iface eth0` + a udev rule.
    A name glob (`e*`) reaches only netplan. The subnet's `gateway` (not a 0.0.0.0/0
    route) becomes ENI's own `gateway` line; ENI renders such a route as `post-up route
    add ... || true`, which needs net-tools (priority optional in Debian 12) and fails
    silently without it. Only the first NIC has the `gateway` (ifupdown refuses a second
    default route and leaves that interface down); the merged DNS servers and search
    list go with it (every renderer writes them for the whole guest or per NIC alike).
    """
    if len(more_macs) != len(identity.more_nics):
        raise PermanentError(
            f"the VM has {1 + len(more_macs)} network adapter(s) with a MAC address, the "
            f"deploy asks for {1 + len(identity.more_nics)}: this is a fault in deploybot"
        )
    subnet: dict[str, Any] = {
        "type": "static",
        "address": identity.address.with_prefixlen,
        "gateway": str(identity.gateway),
    }
    if identity.dns:
        subnet["dns_nameservers"] = [str(ip) for ip in identity.dns]
    if identity.searches:
        subnet["dns_search"] = list(identity.searches)
    nic = {"type": "physical", "name": NIC_NAME, "mac_address": mac.lower(), "subnets": [subnet]}
    pairs = zip(identity.more_nics, more_macs, strict=True)
    more = [_later(index, later, other) for index, (later, other) in enumerate(pairs, start=1)]
    return {"version": 1, "config": [nic, *more]}


def _later(index: int, nic: Nic, mac: str) -> dict[str, Any]:
    """A NIC after the first: its address; a gateway only as a route of higher metric."""
    subnet: dict[str, Any] = {"type": "static", "address": nic.address.with_prefixlen}
    if nic.gateway is not None:
        subnet["routes"] = [
            {
                "network": "0.0.0.0",
                "netmask": "0.0.0.0",
                "gateway": str(nic.gateway),
                "metric": LATER_GATEWAY_METRIC,
            }
        ]
    name = f"eth{index}"
    return {"type": "physical", "name": name, "mac_address": mac.lower(), "subnets": [subnet]}


def metadata(
    instance_id: str, identity: Identity, mac: str, more_macs: Sequence[str] = ()
) -> dict[str, Any]:
    """instance-id, local-hostname (the FQDN: cloud-init's datasource splits it into
    host name and domain) and the network of the NICs whose MACs are `mac`, `more_macs`."""
    return {
        "instance-id": instance_id,
        "local-hostname": fqdn(identity),
        "network": network(identity, mac, more_macs),
    }


def userdata(identity: Identity, manage_etc_hosts: EtcHosts = True) -> dict[str, Any]:
    """The login user with its keys and passwordless sudo; packages upgraded only if
    asked; host name, FQDN and /etc/hosts as Proxmox's own cloud-init data has them.

    `hostname` and `fqdn` in user-data win over the metadata in cloud-init's
    `get_hostname_fqdn`, so the name does not depend on which one a module reads.
    `manage_etc_hosts` is the backend's policy for its guests: true rewrites /etc/hosts from
    cloud-init's template at every boot (`hostname -f` then answers the FQDN),
    "localhost" only keeps the 127.0.1.1 line, false leaves the file alone.
    """
    for key in identity.ssh_keys:
        if _CONTROL.search(key):
            raise PermanentError(
                f"an SSH key for {identity.user} contains a line break or control character; "
                "give each key as one line"
            )
    document: dict[str, Any] = {
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
        "hostname": identity.hostname,
        "fqdn": fqdn(identity),
        "manage_etc_hosts": manage_etc_hosts,
    }
    if identity.host_key is not None:
        document.update(host_key(identity.host_key))
        if identity.host_certificate is not None:
            document["ssh_keys"]["ed25519_certificate"] = certificate(
                identity.host_certificate, identity.host_key
            )
    elif identity.host_certificate is not None:
        raise PermanentError(
            "a host certificate was given without the host key it certifies; "
            "this is a fault in deploybot: report it"
        )
    return document


def host_key(pair: HostKeyPair) -> dict[str, Any]:
    """cloud-init's `ssh_keys` for the ed25519 pair deploybot chose, with `ssh_deletekeys`:
    cc_ssh deletes the template's host keys, then writes these two files
    (/etc/ssh/ssh_host_ed25519_key{,.pub}); with `ssh_keys` given it generates no
    others, so sshd presents this key and no other. The messages never quote the key."""
    if _CONTROL.search(pair.public) or not pair.public.startswith("ssh-ed25519 "):
        raise PermanentError(
            "the host key chosen for the guest is not one ssh-ed25519 line; "
            "this is a fault in deploybot: report it"
        )
    if _CONTROL_BUT_NEWLINE.search(pair.private_openssh) or not holds_private_key(
        pair.private_openssh
    ):
        raise PermanentError(
            "the host key chosen for the guest is not an OpenSSH private key; "
            "this is a fault in deploybot: report it"
        )
    return {
        "ssh_keys": {"ed25519_private": pair.private_openssh, "ed25519_public": pair.public},
        "ssh_deletekeys": True,
    }


def certificate(line: str, pair: HostKeyPair) -> str:
    """cloud-init's `ssh_keys: ed25519_certificate`: cc_ssh writes it to
    /etc/ssh/ssh_host_ed25519_key-cert.pub and sets sshd's `HostCertificate` to that file
    (in sshd_config.d/50-cloud-init.conf when sshd_config includes that folder). One
    line, an ed25519 host certificate of exactly the chosen key: anything else would
    make sshd present no certificate, silently."""
    text = line.strip()
    if _CONTROL.search(text) or not text.startswith(f"{CERTIFICATE_TYPE} "):
        raise PermanentError(
            f"the host certificate for the guest is not one {CERTIFICATE_TYPE} line; "
            "this is a fault in deploybot: report it"
        )
    try:
        certified = asyncssh.import_certificate(text).key.export_public_key("openssh")
    except (asyncssh.KeyImportError, ValueError):
        certified = b""
    if certified.decode("ascii", "replace").split()[:2] != pair.public.split()[:2]:
        raise PermanentError(
            "the host certificate for the guest does not certify the host key chosen for "
            "it; this is a fault in deploybot: report it"
        )
    return text + "\n"


def encode(text: str) -> str:
    """gzip then base64; mtime=0 so the same document always encodes the same way."""
    return base64.b64encode(gzip.compress(text.encode("utf-8"), mtime=0)).decode("ascii")


def read(value: str, encoding: str | None) -> str:
    """A guestinfo document as cloud-init's VMware datasource decodes it (its four
    encodings; anything else is plain text); ValueError when it does not decode."""
    try:
        if encoding in ("gzip+base64", "gz+b64"):
            raw = gzip.decompress(base64.b64decode(value, validate=True))
        elif encoding in ("base64", "b64"):
            raw = base64.b64decode(value, validate=True)
        else:
            return value
        return raw.decode("utf-8")
    except (OSError, EOFError, zlib.error, ValueError) as error:  # binascii, Unicode
        raise ValueError(f"not {encoding} text") from error


def holds_private_key(document: str) -> bool:
    """Whether a cloud-config (decoded) holds a private host key."""
    return _PRIVATE_KEY.search(document) is not None


def userdata_config(identity: Identity, manage_etc_hosts: EtcHosts = True) -> dict[str, str]:
    """guestinfo.userdata and its `.encoding`: known before the VM exists."""
    user = "#cloud-config\n" + to_yaml(userdata(identity, manage_etc_hosts))
    return {USERDATA_KEY: encode(user), f"{USERDATA_KEY}.encoding": ENCODING}


def metadata_config(
    instance_id: str, identity: Identity, mac: str, more_macs: Sequence[str] = ()
) -> dict[str, str]:
    """guestinfo.metadata and its `.encoding`: needs every NIC's MAC.

    Without the `.encoding` key cloud-init reads the base64 text as the document itself
    and boots with garbage, silently.
    """
    meta = to_yaml(metadata(instance_id, identity, mac, more_macs))
    return {METADATA_KEY: encode(meta), f"{METADATA_KEY}.encoding": ENCODING}


def extra_config(
    instance_id: str,
    identity: Identity,
    mac: str,
    manage_etc_hosts: EtcHosts = True,
    more_macs: Sequence[str] = (),
) -> dict[str, str]:
    """The four guestinfo keys: each document and its `.encoding`."""
    return {
        **metadata_config(instance_id, identity, mac, more_macs),
        **userdata_config(identity, manage_etc_hosts),
    }
