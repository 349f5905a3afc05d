"""A real Debian guest boots from the NoCloud seed Proxmox would write, and becomes it.

The seed is rendered from Proxmox-style cloud-init fields (tests/support/realguest/nocloud.py),
the guest runs under QEMU (tests/support/realguest/qemu.py) with the image from
`make guest-image`; everything is checked from outside the way deploybot would see it
(the guest agent, SSH on the forwarded port with the deploy's key) and then inside the
guest over that SSH session. Boot times are printed.

The guest has two NICs, as a deploy with a second address gets them: `net1` and
`ipconfig1` as the Proxmox backend writes them (no gateway: the default route stays on
the first NIC), the second on a restricted user-mode network of its own. The test runs
once per image, one boot each: `eni` (ifupdown + resolvconf, Debian's renderer) and
`netplan` (netplan.io + systemd-networkd + systemd-resolved, Ubuntu's); each must put
both addresses on the NICs with their MACs and the default route on the first.

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
from tests.support.realguest import image, nocloud, qemu, support

pytestmark = pytest.mark.realguest

NAME, DOMAIN, USER = "web01", "example.test", "deploy"
ADDRESS, GATEWAY, DNS = "10.0.0.50", "10.0.0.1", "10.0.0.3"
MAC = "BC:24:11:5E:00:32"
ADDRESS2, MAC2, NETWORK2 = "10.0.20.5", "BC:24:11:5E:00:33", "10.0.20.0/24"
BOOT_SECONDS = 480.0  # TCG on 2 busy cores: cloud-init is done at ~100 s when idle


@pytest.fixture(params=[image.ENI, image.NETPLAN], ids=lambda v: v.name)
def variant(request: pytest.FixtureRequest) -> image.Variant:
    assert isinstance(request.param, image.Variant)
    return request.param


async def test_guest_becomes_what_the_seed_says(
    variant: image.Variant, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    guest_image = support.require_image(variant)
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

            await check_network(conn, variant)

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
            f"\nreal guest, {variant.name} ({guest.accel}): agent up {qga_up:.0f} s, "
            f"SSH up {ssh_up:.0f} s, cloud-init done {ci_done:.0f} s after QEMU started"
        )


async def check_network(conn: asyncssh.SSHClientConnection, variant: image.Variant) -> None:
    """Both addresses on the NICs with the seed's MACs (renamed eth0 and eth1 by
    cloud-init, as the seed names them), the default route on the first only, DNS and
    the search domain, and what the image's renderer wrote for that."""
    net = await support.net_view(conn, MAC)
    assert net.nic == "eth0", net
    assert f"inet {ADDRESS}/24" in net.addresses, net
    assert f"default via {GATEWAY} dev eth0" in net.routes, net
    assert any(line.split()[:1] == ["search"] and DOMAIN in line for line in net.resolv)
    # The second NIC: its address, and no default route through it.
    second = await support.net_view(conn, MAC2)
    assert second.nic == "eth1" and f"inet {ADDRESS2}/24" in second.addresses, second
    defaults = (await support.out(conn, "ip -4 route show default")).splitlines()
    assert [r.split()[:5] for r in defaults] == [["default", "via", GATEWAY, "dev", "eth0"]], (
        defaults
    )
    if variant is image.NETPLAN:
        # netplan matches each MAC and sets the name; resolved holds the DNS behind its stub.
        rendered = await support.out(conn, "cat /etc/netplan/50-cloud-init.yaml")
        for mac, name in ((MAC, "eth0"), (MAC2, "eth1")):
            assert f"macaddress: {mac.lower()}" in rendered, rendered
            assert f"set-name: {name}" in rendered, rendered
        assert "nameserver 127.0.0.53" in net.resolv, net.resolv
        dns = await support.out(conn, "resolvectl dns; resolvectl domain")
        assert DNS in dns and DOMAIN in dns, dns
        unit = "systemd-networkd-wait-online.service"
    else:
        rendered = await support.out(
            conn,
            "cat /etc/network/interfaces.d/50-cloud-init /etc/udev/rules.d/70-persistent-net.rules",
        )
        assert "iface eth0 inet static" in rendered and "iface eth1 inet static" in rendered
        for mac, name in ((MAC, "eth0"), (MAC2, "eth1")):
            assert f'ATTR{{address}}=="{mac.lower()}", NAME="{name}"' in rendered, rendered
        assert f"nameserver {DNS}" in net.resolv, net.resolv
        unit = "networking.service"  # `ifup -a`: it fails when a NIC does not come up
    state = await support.out(conn, f"systemctl show -p Result,ActiveState {unit}")
    assert state.split() == ["Result=success", "ActiveState=active"], state


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
