"""A real Debian guest boots from the NoCloud seed Proxmox would write, and becomes it.

The seed is rendered from Proxmox-style cloud-init fields (tests/support/realguest/nocloud.py),
the guest runs under QEMU (tests/support/realguest/qemu.py) with the image from
`make guest-image`; everything is checked from outside the way deploybot would see it
(the guest agent, SSH on the forwarded port with the deploy's key) and then inside the
guest over that SSH session. Boot times are printed.

The guest has two NICs, as a deploy with a second address gets them: `net1` and
`ipconfig1` as the Proxmox backend writes them (no gateway: the default route stays on
the first NIC), the second on a restricted user-mode network of its own.

Skips, saying why, without QEMU or the image; under DEPLOYBOT_REQUIRE_REALGUEST=1 (CI)
that is a failure. Nothing leaves loopback: the guest's only network is QEMU's
restricted user-mode network, and its SSH forward listens on 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path
from urllib.parse import quote

import asyncssh
import pytest

from backends.base import Identity, Nic, Segment
from backends.proxmox.identity import more_nics
from tests.support.realguest import nocloud, qemu, support

pytestmark = pytest.mark.realguest

NAME, DOMAIN, USER = "web01", "example.test", "deploy"
ADDRESS, GATEWAY, DNS = "10.0.0.50", "10.0.0.1", "10.0.0.3"
MAC = "BC:24:11:5E:00:32"
ADDRESS2, MAC2, NETWORK2 = "10.0.20.5", "BC:24:11:5E:00:33", "10.0.20.0/24"
BOOT_SECONDS = 480.0  # TCG on 2 busy cores: cloud-init is done at ~100 s when idle


@pytest.fixture
def guest_image() -> Path:
    return support.require_image()


async def test_guest_becomes_what_the_seed_says(
    guest_image: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    public = key.export_public_key().decode().strip()
    config: dict[str, str | int] = {
        "name": NAME,
        "net0": f"virtio={MAC},bridge=vmbr0",
        "ipconfig0": f"ip={ADDRESS}/24,gw={GATEWAY}",
        "nameserver": DNS,
        "searchdomain": DOMAIN,
        "ciuser": USER,
        "sshkeys": quote(public + "\n", safe=""),  # as Proxmox stores it
        "ciupgrade": 0,  # no mirror to upgrade from
    }
    config |= second_nic(config)
    assert (config["net1"], config["ipconfig1"]) == (
        f"virtio={MAC2},bridge=vmbr1,tag=20,firewall=0",
        f"ip={ADDRESS2}/24",
    )
    seed = nocloud.render(config, vmid=101)
    guest = qemu.Guest(
        image=guest_image,
        workdir=tmp_path,
        seed=nocloud.write_iso(seed, tmp_path / "seed.iso"),
        mac=MAC,
        address=ADDRESS,
        gateway=GATEWAY,
        dns=DNS,
        more_nics=(qemu.MoreNic(MAC2, NETWORK2, "10.0.20.2"),),
    )
    guest.start()
    try:
        deadline = guest.started + BOOT_SECONDS
        qga_up = await guest.wait_qga(deadline)
        conn = await support.ssh_login(guest, USER, key, deadline)
        ssh_up = time.monotonic() - guest.started
        async with conn:
            status = await support.out(conn, "cloud-init status --wait --long")
            ci_done = time.monotonic() - guest.started
            assert "status: done" in status, status
            seen = conn.get_server_host_key()
            assert seen is not None
            own = asyncssh.import_public_key(
                await support.out(conn, "cat /etc/ssh/ssh_host_ed25519_key.pub")
            )
            assert seen.get_fingerprint() == own.get_fingerprint()

            assert (await support.out(conn, "hostname")).strip() == NAME
            assert (await support.out(conn, "hostname --fqdn")).strip() == f"{NAME}.{DOMAIN}"
            assert public in (await support.out(conn, "cat ~/.ssh/authorized_keys")).splitlines()
            assert (await support.out(conn, f"sudo -n passwd --status {USER}")).split()[1] == "L"
            assert (await support.out(conn, "cat /var/lib/cloud/data/instance-id")).strip() == (
                seed.instance_id
            )

            # The address on the NIC with the seed's MAC (renamed eth0 by cloud-init).
            net = await support.net_view(conn, MAC)
            assert f"inet {ADDRESS}/24" in net.addresses
            assert f"default via {GATEWAY} dev {net.nic}" in net.routes
            assert f"nameserver {DNS}" in net.resolv, net.resolv
            assert any(line.split()[:1] == ["search"] and DOMAIN in line for line in net.resolv)
            # The second NIC: its address, and no default route through it.
            second = await support.net_view(conn, MAC2)
            assert second.nic != net.nic and f"inet {ADDRESS2}/24" in second.addresses
            defaults = (await support.out(conn, "ip -4 route show default")).splitlines()
            assert [r.split()[:5] for r in defaults] == [
                ["default", "via", GATEWAY, "dev", net.nic]
            ], defaults

        # The agent reports the address the way Proxmox's agent/network-get-interfaces does.
        interfaces = await guest.qga("guest-network-get-interfaces")
        by_mac = {i.get("hardware-address"): i for i in interfaces}
        addresses = [a["ip-address"] for a in by_mac[MAC.lower()].get("ip-addresses", [])]
        assert ADDRESS in addresses
        addresses = [a["ip-address"] for a in by_mac[MAC2.lower()].get("ip-addresses", [])]
        assert ADDRESS2 in addresses
    finally:
        guest.stop()
    assert not guest.running()
    with capsys.disabled():
        print(
            f"\nreal guest ({guest.accel}): agent up {qga_up:.0f} s, SSH up {ssh_up:.0f} s, "
            f"cloud-init done {ci_done:.0f} s after QEMU started"
        )


def second_nic(config: dict[str, str | int]) -> dict[str, str]:
    """`net1` and `ipconfig1` as the Proxmox backend writes them for a second NIC with a
    fixed MAC on vmbr1 VLAN 20 (`backends.proxmox.identity.more_nics`)."""
    nic = Nic(ipaddress.IPv4Interface(f"{ADDRESS2}/24"), None, Segment("vmbr1", 20), MAC2)
    identity = Identity(
        hostname=NAME,
        user=USER,
        ssh_keys=(),
        address=ipaddress.IPv4Interface(f"{ADDRESS}/24"),
        gateway=ipaddress.IPv4Address(GATEWAY),
        dns=(),
        search_domain=DOMAIN,
        upgrade=False,
        cores=1,
        memory_mib=1024,
        more_nics=(nic,),
    )
    return more_nics({k: str(v) for k, v in config.items()}, identity, None)
