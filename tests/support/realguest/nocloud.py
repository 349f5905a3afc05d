"""The NoCloud seed Proxmox VE builds from a VM's cloud-init fields, rendered in Python.

Matched line by line against qemu-server's `PVE/QemuServer/Cloudinit.pm` (the
`generate_nocloud` path: `cloudinit_userdata`, `nocloud_network`, `nocloud_gen_metadata`,
`get_hostname_fqdn`, `get_dns_conf`, `commit_cloudinit_disk`), without `cicustom`
snippets:

* user-data: `#cloud-config` with hostname, `manage_etc_hosts: true`, fqdn (the VM name,
  `.searchdomain` appended when the name has no dot; else the name alone), `user:`
  (ciuser), `disable_root: False` for root, `password:` (cipassword), the unescaped
  `sshkeys` one per line (blank lines dropped), `chpasswd: expire: False`, `users: -
  default` unless the user is root, and `package_upgrade: true` unless `ciupgrade` is 0
  (it defaults to 1);
* network-config: version 1, one `physical` entry per `netN` that has an `ipconfigN`
  (in Perl's string order of the keys), named `ethN`, keyed by the lower-cased MAC,
  with static (address and dotted netmask, gateway), dhcp4, static6, dhcp6 or
  ipv6_slaac subnets; then always one `nameserver` entry (its address and search lists
  only when non-empty) whose values fall back to the host's resolv.conf;
* meta-data: `instance-id: ` + sha1_hex(user-data + network-config), so any change to
  a field gives a new instance;
* vendor-data: empty;
* the disk: `genisoimage -quiet -iso-level 3 -J -R -V cidata` of those four files.

Not matched: Perl's `split(/\\s+/)` keeps an empty first item for a value with leading
blanks (`nameserver " 1.1.1.1"`); here the lists hold no empty items.
"""

from __future__ import annotations

import hashlib
import ipaddress
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

Config = Mapping[str, str | int]


@dataclass(frozen=True)
class Seed:
    user_data: str
    network_config: str
    meta_data: str
    vendor_data: str = ""

    @property
    def instance_id(self) -> str:
        return self.meta_data.removeprefix("instance-id: ").strip()


@dataclass(frozen=True)
class HostDns:
    """The Proxmox node's own resolv.conf, used when the VM sets no nameserver/searchdomain."""

    search: tuple[str, ...] = ()
    nameservers: tuple[str, ...] = ()


def property_string(value: str, default_key: str | None = None) -> dict[str, str]:
    """`k=v,k=v` as Proxmox parses it; a bare item is the format's default key."""
    parsed: dict[str, str] = {}
    for item in value.split(","):
        key, eq, val = item.partition("=")
        if eq:
            parsed[key] = val
        elif default_key is not None:
            parsed[default_key] = key
    return parsed


def mac_of(net: str) -> str:
    """The MAC of `netN` (`virtio=BC:24:11:..,bridge=vmbr0`: the model key holds it)."""
    parsed = property_string(net, "model")
    if "macaddr" in parsed:
        return parsed["macaddr"]
    for model in ("virtio", "e1000", "e1000e", "rtl8139", "vmxnet3"):
        if model in parsed:
            return parsed[model]
    raise ValueError(f"network interface has no mac address: {net}")


def hostname_fqdn(config: Config, vmid: int) -> tuple[str, str]:
    hostname = str(config.get("name", f"VM{vmid}"))
    if "." in hostname:
        return hostname.split(".", 1)[0], hostname
    if search := str(config.get("searchdomain", "")):
        return hostname, f"{hostname}.{search}"
    return hostname, hostname


def dns(config: Config, host: HostDns) -> tuple[list[str], list[str]]:
    search = config.get("searchdomain")
    servers = config.get("nameserver")
    return (
        str(search).split() if search is not None else list(host.search),
        str(servers).split() if servers is not None else list(host.nameservers),
    )


def user_data(config: Config, vmid: int) -> str:
    hostname, fqdn = hostname_fqdn(config, vmid)
    lines = ["#cloud-config", f"hostname: {hostname}", "manage_etc_hosts: true", f"fqdn: {fqdn}"]
    user = config.get("ciuser")
    if user is not None:
        lines.append(f"user: {user}")
        if user == "root":
            lines.append("disable_root: False")
    if (password := config.get("cipassword")) is not None:
        lines.append(f"password: {password}")
    if (keys := config.get("sshkeys")) is not None:
        lines.append("ssh_authorized_keys:")
        # Perl's chomp takes only the trailing newline, which split already removed:
        # a \r stays, as it does in Proxmox.
        lines += [f"  - {k}" for k in unquote(str(keys)).split("\n") if k.strip()]
    lines += ["chpasswd:", "  expire: False"]
    if user is None or user != "root":
        lines += ["users:", "  - default"]
    if str(config.get("ciupgrade", 1)) not in ("0", ""):
        lines.append("package_upgrade: true")
    return "\n".join(lines) + "\n"


def _net_ids(config: Config) -> list[str]:
    # Perl sorts the keys as strings (net10 before net2); so does sorted().
    return [key[3:] for key in sorted(config) if key.startswith("net") and key[3:].isdigit()]


def network_config(config: Config, host: HostDns = HostDns()) -> str:
    out = "version: 1\nconfig:\n"
    i = "    "
    for n in _net_ids(config):
        if not config.get(f"ipconfig{n}"):
            continue
        ipconfig = property_string(str(config[f"ipconfig{n}"]))
        mac = mac_of(str(config[f"net{n}"])).lower()
        out += f"{i}- type: physical\n{i}  name: eth{n}\n{i}  mac_address: '{mac}'\n"
        out += f"{i}  subnets:\n"
        j = i + "  "
        if (ip := ipconfig.get("ip")) is not None:
            if ip == "dhcp":
                out += f"{j}- type: dhcp4\n"
            else:
                addr, bits = ip.split("/")
                mask = ipaddress.IPv4Network(f"0.0.0.0/{bits}").netmask
                out += f"{j}- type: static\n{j}  address: '{addr}'\n{j}  netmask: '{mask}'\n"
                if (gw := ipconfig.get("gw")) is not None:
                    out += f"{j}  gateway: '{gw}'\n"
        if (ip6 := ipconfig.get("ip6")) is not None:
            if ip6 == "dhcp":
                out += f"{j}- type: dhcp6\n"
            elif ip6 == "auto":
                out += f"{j}- type: ipv6_slaac\n"
            else:
                out += f"{j}- type: static6\n{j}  address: '{ip6}'\n"
                if (gw6 := ipconfig.get("gw6")) is not None:
                    out += f"{j}  gateway: '{gw6}'\n"
    search, servers = dns(config, host)
    # Proxmox tests two array references here, which are always true: the entry is
    # always written, even with nothing in it.
    out += f"{i}- type: nameserver\n"
    if servers:
        out += f"{i}  address:\n" + "".join(f"{i}  - '{s}'\n" for s in servers)
    if search:
        out += f"{i}  search:\n" + "".join(f"{i}  - '{s}'\n" for s in search)
    return out


def render(config: Config, vmid: int, host: HostDns = HostDns()) -> Seed:
    user = user_data(config, vmid)
    network = network_config(config, host)
    instance = hashlib.sha1((user + network).encode()).hexdigest()
    return Seed(user_data=user, network_config=network, meta_data=f"instance-id: {instance}\n")


def write_iso(seed: Seed, path: Path) -> Path:
    """The seed as Proxmox's cloud-init drive: an ISO 9660 image labelled `cidata`."""
    tool = shutil.which("genisoimage")
    if tool is None:
        raise FileNotFoundError("genisoimage is missing (apt-get install genisoimage)")
    with tempfile.TemporaryDirectory() as folder:
        files = {
            "user-data": seed.user_data,
            "network-config": seed.network_config,
            "meta-data": seed.meta_data,
            "vendor-data": seed.vendor_data,
        }
        for name, content in files.items():
            (Path(folder) / name).write_text(content)
        argv = [tool, "-quiet", "-iso-level", "3", "-J", "-R", "-V", "cidata", "-o", str(path)]
        subprocess.run([*argv, folder], check=True, timeout=30)
    return path
