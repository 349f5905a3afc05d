"""Inside a guest a deploy built on the fake Proxmox with real guests: is it what was asked?

`check_guest` logs in as the deploy printed (the deploy's key, through the jump host)
and checks, inside the guest, everything issue 16 names: hostname and FQDN, the login
user with the key and a locked password, the static address, default route and DNS on
the NIC that has the MAC deploybot set, no package upgrade (`upgrade=no`), the
instance-id Proxmox derives for that VM, and the printed host key being the guest's own:
the one deploybot confirmed through the real qemu-guest-agent, whose known_hosts line
(`deploybot known-hosts NAME`) is the guest's /etc/ssh/ssh_host_ed25519_key.pub.
The expected values come from the deploy's subnet in `config_text` and from the VM's
config in the fake (what deploybot set), not from the guest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import asyncssh
import yaml

from tests.support.fakepve.realvm import RealMachines
from tests.support.fakepve.server import FakePVE
from tests.support.realguest import nocloud
from tests.support.realguest.lane import LOGIN, Deploy, known_hosts_line, login, out

# The 10.0.0.0/24 subnet of tests/support/fakepve/testing.py's config_text.
GATEWAY, DNS, DOMAIN = "10.0.0.1", "10.0.0.2", "lab.example"


@dataclass(frozen=True)
class Seen:
    instance_id: str
    host_key: str
    known_hosts: str  # the line `deploybot known-hosts NAME` printed ("name,address KEY")


async def check_guest(
    fake: FakePVE, machines: RealMachines, key: asyncssh.SSHKey, deploy: Deploy
) -> Seen:
    """The SSH line works and the guest is what the deploy asked for."""
    assert deploy.returncode == 0, deploy.output
    assert f"ssh {LOGIN}@{deploy.address}" in deploy.output
    config = fake.cluster.vms[deploy.vmid].config
    mac = nocloud.mac_of(config["net0"]).lower()
    public = key.export_public_key().decode().strip()
    bastion, conn = await login(fake, key, deploy.address)
    async with bastion, conn:
        status = await out(conn, "cloud-init status --wait")  # everything below is done
        assert "status: done" in status, status
        own = await _host_key(conn, deploy)
        assert await out(conn, "hostname") == deploy.name
        assert await out(conn, "hostname -f") == f"{deploy.name}.{DOMAIN}"
        await _login_user(conn, public)
        await _network(conn, mac, deploy.address)
        await _no_upgrade(conn, config)
        instance_id = await out(conn, "cloud-init query instance_id")
        assert await out(conn, "cat /run/cloud-init/.instance-id") == instance_id
    # What Proxmox derives from the VM's cloud-init fields (sha1 of user-data and
    # network-config), and what the fake booted it with.
    assert instance_id == nocloud.render(config, deploy.vmid).instance_id
    assert instance_id == machines.seeds[deploy.vmid].instance_id
    known = await known_hosts_line(fake, deploy)
    assert known == f"{deploy.name},{deploy.address} {own}", (known, own)
    return Seen(instance_id, deploy.host_key, known)


async def _host_key(conn: asyncssh.SSHClientConnection, deploy: Deploy) -> str:
    """The printed fingerprint is the guest's own ed25519 host key, the one this
    connection saw (not the jump host's), and the deploy says the guest agent confirmed
    it. Returns the key file's line without its comment ("ssh-ed25519 AAAA...")."""
    server_key = conn.get_server_host_key()
    assert server_key is not None
    assert server_key.get_fingerprint("sha256") == deploy.host_key, deploy.output
    line = await out(conn, "cat /etc/ssh/ssh_host_ed25519_key.pub")
    own = asyncssh.import_public_key(line)
    assert own.get_fingerprint("sha256") == deploy.host_key, deploy.output
    confirmed = f"host key {deploy.host_key} (confirmed through the QEMU guest agent)"
    assert confirmed in deploy.output, deploy.output
    return " ".join(line.split()[:2])


async def _login_user(conn: asyncssh.SSHClientConnection, public: str) -> None:
    """Logged in as LOGIN, whose authorized key is the deploy's and who has no
    password: locked (`passwd -S` says L, the shadow field starts with ! or *)."""
    assert await out(conn, "id -un") == LOGIN
    assert public in (await out(conn, "cat ~/.ssh/authorized_keys")).splitlines()
    assert (await out(conn, f"sudo -n passwd -S {LOGIN}")).split()[1] == "L"
    shadow = (await out(conn, f"sudo -n getent shadow {LOGIN}")).split(":")[1]
    assert shadow.startswith(("!", "*")), shadow


async def _network(conn: asyncssh.SSHClientConnection, mac: str, address: str) -> None:
    """The static address and the default route on the NIC with deploybot's MAC, and
    the subnet's resolver and search domain."""
    links = (await out(conn, "ip -o link show")).splitlines()
    nics = [line.split(": ")[1] for line in links if f"link/ether {mac} " in line]
    assert len(nics) == 1, links
    nic = nics[0]
    assert f"inet {address}/24 " in await out(conn, f"ip -o -4 addr show dev {nic}")
    routes = (await out(conn, "ip -4 route show default")).splitlines()
    assert [r.split()[:5] for r in routes] == [["default", "via", GATEWAY, "dev", nic]], routes
    resolv = (await out(conn, "cat /etc/resolv.conf")).splitlines()
    assert f"nameserver {DNS}" in resolv, resolv
    assert any(line.split()[:1] == ["search"] and DOMAIN in line.split() for line in resolv)


async def _no_upgrade(conn: asyncssh.SSHClientConnection, config: dict[str, str]) -> None:
    """upgrade=no: Proxmox was told ciupgrade=0, the user-data cloud-init ran with has
    no package_upgrade, its package module ran no apt, and apt upgraded nothing."""
    assert config["ciupgrade"] == "0", config
    user_data = yaml.safe_load(await out(conn, "sudo -n cat /var/lib/cloud/instance/user-data.txt"))
    assert not user_data.get("package_upgrade", False), user_data
    log = (await out(conn, "sudo -n cat /var/log/cloud-init.log")).splitlines()
    # cloud-init's package module ran (or was skipped: nothing in the config asks it),
    # and no apt command ran at all.
    module = [line for line in log if re.search(r"package.update.upgrade.install", line)]
    assert any(re.search(r"Running module|Skipping modules", line) for line in module), module
    apt = [line for line in log if "apt-get" in line or "upgrade" in line.lower()]
    assert not [line for line in apt if line not in module], apt
    history = await out(conn, "cat /var/log/apt/history.log 2>/dev/null || true")
    assert "Upgrade:" not in history, history
