"""The NoCloud seed renderer and the image script's mirror lookup, without a guest.

The expected documents are what qemu-server's Cloudinit.pm prints for the same fields
(read from its `cloudinit_userdata` and `nocloud_network`); the boot test proves a real
cloud-init takes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support.realguest import image, nocloud

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2d5bJbYzWbS1qL3M0wq3hC1Zg7Y7Zs1uJx0lFq4f4A a@b"
CONFIG: dict[str, str | int] = {
    "name": "web01",
    "net0": "virtio=BC:24:11:5E:00:32,bridge=vmbr0",
    "net1": "virtio=BC:24:11:5E:00:33,bridge=vmbr1",  # no ipconfig1: not rendered
    "ipconfig0": "ip=10.0.0.50/24,gw=10.0.0.1",
    "nameserver": "10.0.0.3 10.0.0.4",
    "searchdomain": "example.test",
    "ciuser": "deploy",
    "sshkeys": quote(f"{KEY}\n\n", safe=""),
    "ciupgrade": 0,
}


def test_user_data_is_proxmoxs() -> None:
    assert nocloud.user_data(CONFIG, 101) == (
        "#cloud-config\n"
        "hostname: web01\n"
        "manage_etc_hosts: true\n"
        "fqdn: web01.example.test\n"
        "user: deploy\n"
        "ssh_authorized_keys:\n"
        f"  - {KEY}\n"
        "chpasswd:\n"
        "  expire: False\n"
        "users:\n"
        "  - default\n"
    )


def test_upgrade_is_the_default_and_names_decide_the_fqdn() -> None:
    bare = {"net0": "virtio=BC:24:11:5E:00:32"}
    text = nocloud.user_data(bare, 105)
    assert "hostname: VM105\n" in text and "fqdn: VM105\n" in text
    assert text.endswith("package_upgrade: true\n")
    dotted = nocloud.user_data({"name": "db.example.org", "searchdomain": "x.test"}, 1)
    assert "hostname: db\n" in dotted and "fqdn: db.example.org\n" in dotted
    root = nocloud.user_data({"ciuser": "root", "ciupgrade": "1"}, 1)
    assert "disable_root: False\n" in root and "users:" not in root


def test_network_config_is_v1_keyed_by_mac() -> None:
    assert nocloud.network_config(CONFIG) == (
        "version: 1\n"
        "config:\n"
        "    - type: physical\n"
        "      name: eth0\n"
        "      mac_address: 'bc:24:11:5e:00:32'\n"
        "      subnets:\n"
        "      - type: static\n"
        "        address: '10.0.0.50'\n"
        "        netmask: '255.255.255.0'\n"
        "        gateway: '10.0.0.1'\n"
        "    - type: nameserver\n"
        "      address:\n"
        "      - '10.0.0.3'\n"
        "      - '10.0.0.4'\n"
        "      search:\n"
        "      - 'example.test'\n"
    )


def test_dhcp_ipv6_and_the_hosts_dns() -> None:
    config = {"net0": "virtio=BC:24:11:5E:00:32", "ipconfig0": "ip=dhcp,ip6=auto"}
    host = nocloud.HostDns(search=("lan",), nameservers=("192.0.2.53",))
    text = nocloud.network_config(config, host)
    assert "      - type: dhcp4\n      - type: ipv6_slaac\n" in text
    assert text.endswith(
        "    - type: nameserver\n      address:\n      - '192.0.2.53'\n"
        "      search:\n      - 'lan'\n"
    )
    # Proxmox writes the nameserver entry even when it has nothing to say.
    assert nocloud.network_config({}).endswith("config:\n    - type: nameserver\n")


def test_instance_id_hashes_user_and_network() -> None:
    seed = nocloud.render(CONFIG, 101)
    digest = hashlib.sha1((seed.user_data + seed.network_config).encode()).hexdigest()
    assert seed.meta_data == f"instance-id: {digest}\n" and seed.instance_id == digest
    changed = nocloud.render({**CONFIG, "nameserver": "10.0.0.9"}, 101)
    assert changed.instance_id != seed.instance_id


@pytest.mark.skipif(shutil.which("isoinfo") is None, reason="isoinfo (genisoimage) is missing")
def test_seed_iso_is_labelled_cidata(tmp_path: Path) -> None:
    iso = nocloud.write_iso(nocloud.render(CONFIG, 101), tmp_path / "seed.iso")
    info = subprocess.run(["isoinfo", "-d", "-i", iso], capture_output=True, text=True).stdout
    assert "Volume id: cidata" in info
    listing = subprocess.run(["isoinfo", "-R", "-f", "-i", iso], capture_output=True, text=True)
    assert set(listing.stdout.split()) == {
        "/user-data",
        "/network-config",
        "/meta-data",
        "/vendor-data",
    }


def test_mirror_from_either_sources_format() -> None:
    one_line = "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://m.test/debian bookworm main\n"
    deb822 = (
        "Types: deb\nURIs: http://other.test/debian\nSuites: bookworm-updates\nComponents: main\n\n"
        "Types: deb deb-src\nURIs: http://m2.test/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main contrib\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    assert image.mirror([one_line]) == "http://m.test/debian"
    assert image.mirror([deb822]) == "http://m2.test/debian"
    with pytest.raises(SystemExit):
        image.mirror(["deb http://m.test/debian trixie main\n"])


def test_cache_key_follows_the_inputs() -> None:
    key = image.cache_key()
    assert image.cache_key(image.ENI) == key
    more = dataclasses.replace(image.ENI, packages=(*image.ENI.packages, "vim-tiny"))
    linked = dataclasses.replace(image.ENI, links={"etc/resolv.conf": "elsewhere"})
    assert len({key, image.cache_key(more), image.cache_key(linked)}) == 3
    # Each variant is an image of its own, in a folder of its own.
    assert image.cache_key(image.NETPLAN) != key
    assert image.image_dir(image.NETPLAN).name.startswith("guest-netplan-")
    assert image.image_dir().name == f"guest-{key}"
