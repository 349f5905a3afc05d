"""Address managers (IPAM): where the next free address comes from and who holds one.

`base.py` is the contract, `builtin.py` the default (deploybot's own store is the
record; no server), `netbox.py` NetBox. `open_ipam` builds the one a configuration names.
"""

from __future__ import annotations

from collections.abc import Mapping

from backends.ipam.base import Ipam
from backends.ipam.builtin import Builtin
from backends.ipam.config import IpamConfig


def open_ipam(config: IpamConfig, environ: Mapping[str, str]) -> Ipam:
    """The configured address manager; NetBox's token is read from `environ` here."""
    if config.provider == "netbox":
        from backends.ipam.netbox import NetBox  # pynetbox is loaded only when used

        return NetBox.create(config, environ)
    return Builtin()
