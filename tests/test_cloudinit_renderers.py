"""What Debian's real cloud-init (22.4, the system package) makes of the guestinfo the
vSphere backend writes: the network config rendered by all five Linux renderers, the
host name, FQDN and /etc/hosts.

The documents come from the backend's own builder (`guestinfo.extra_config`); the guest
side is `tests/support/cloudinit_guest.py`, run by Debian's /usr/bin/python3 with the system's
cloudinit package (never a pip copy), offline, writing only into a temporary folder.
Every renderer must configure the guest's real NIC: found by its MAC, or by the name
cloud-init gives the NIC with that MAC at boot, with the address, gateway, DNS servers
and search domain. Where Debian's cloud-init is missing the tests skip with the reason,
except under DEPLOYBOT_REQUIRE_CLOUDINIT=1 (CI), where that is a failure.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from backends import base
from backends.base import Identity
from backends.vsphere.guestinfo import NIC_NAME, extra_config
from tests.support import mountns
from tests.support.hostkeys import chosen_host_key, host_certificate, public_of

SYSTEM_PYTHON = Path("/usr/bin/python3")
GUEST = Path(__file__).with_name("support") / "cloudinit_guest.py"
MAC = "00:50:56:0a:1b:2c"
INSTANCE_ID = "5029c9f2-d6a4-4d57-9b65-7d1f2c1e0a11"
IDENTITY = Identity(
    hostname="web01",
    user="ubuntu",
    ssh_keys=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 a",
    ),
    address=ipaddress.IPv4Interface("127.0.20.50/24"),
    gateway=ipaddress.IPv4Address("127.0.20.1"),
    dns=(ipaddress.IPv4Address("127.0.20.2"), ipaddress.IPv4Address("127.0.20.3")),
    search_domain="lab.test",
    upgrade=False,
    cores=2,
    memory_mib=2048,
)
MAC2 = "00:50:56:0a:1b:2d"
TWO_NICS = dataclasses.replace(
    IDENTITY,
    more_nics=(base.Nic(ipaddress.IPv4Interface("127.0.30.60/24")),),
    search_domains=("lab30.test",),
)
RENDERERS = ["netplan", "networkd", "eni", "sysconfig", "network-manager"]


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("DEPLOYBOT_REQUIRE_CLOUDINIT") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_CLOUDINIT=1 forbids skipping these tests")
    pytest.skip(reason)


def cloud_init_version() -> str:
    """The version of the system's cloud-init, as its own Python reads it."""
    if not SYSTEM_PYTHON.exists():
        unavailable(f"{SYSTEM_PYTHON} is missing (a Debian system's Python 3)")
    done = subprocess.run(
        [
            SYSTEM_PYTHON,
            "-I",
            "-c",
            "from cloudinit import version; print(version.version_string())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        unavailable("Debian's cloud-init is not installed (apt-get install cloud-init)")
    return done.stdout.strip()


def boot(extra: dict[str, str], where: Path, etc_ssh: Path | None = None) -> dict[str, Any]:
    """Run the guest's cloud-init on these guestinfo keys, as the VMware datasource reads
    them from the environment (`VMX_GUESTINFO_*`); what it found and wrote. With
    `etc_ssh`, cc_ssh runs too, in a mount namespace where that folder is /etc/ssh."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "VMX_GUESTINFO": "1"}
    env.update({("vmx." + key).upper().replace(".", "_"): value for key, value in extra.items()})
    command: list[Any] = [SYSTEM_PYTHON, "-I", GUEST, where]
    if etc_ssh is not None:
        if (reason := mountns.unavailable(("/etc/ssh", "/root"))) is not None:
            unavailable(f"cc_ssh needs a mount namespace of its own: {reason}")
        (home := where.parent / f"{where.name}-root").mkdir()
        binds = {"/etc/ssh": etc_ssh, "/root": home}
        command = mountns.confined(binds, [*map(str, command), "--ssh"])
    done = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"the guest's cloud-init failed:\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout)
    return found


@pytest.fixture(scope="module", name="cloud_init")
def cloud_init_fixture() -> str:
    version = cloud_init_version()
    if not version.startswith("22.4"):
        unavailable(f"the system's cloud-init is {version}; these tests are about 22.4 (Debian 12)")
    return version


@pytest.fixture(scope="module", name="guest")
def guest_fixture(cloud_init: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The guest web01 in lab.test, booted once for the module's tests."""
    return boot(extra_config(INSTANCE_ID, IDENTITY, MAC), tmp_path_factory.mktemp("guest"))


@pytest.fixture(scope="module", name="two_nics")
def two_nics_fixture(cloud_init: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """web01 with a second NIC in 127.0.30.0/24 (no gateway there), booted once."""
    extra = extra_config(INSTANCE_ID, TWO_NICS, MAC, more_macs=(MAC2,))
    return boot(extra, tmp_path_factory.mktemp("two-nics"))


# --- what each renderer wrote, read back into one shape ---------------------------------


@dataclasses.dataclass(frozen=True)
class Nic:
    """A renderer's config for one NIC: the device name it names (None: it names none)
    and the MAC it matches (None: it matches none), then what it configures."""

    name: str | None
    mac: str | None
    address: str | None  # with its prefix
    gateway: str | None
    dns: tuple[str, ...]
    search: tuple[str, ...]


def sections(text: str) -> dict[str, dict[str, str]]:
    """An INI-like file (systemd-networkd, NetworkManager keyfile); a section that occurs
    twice is one."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = found.setdefault(line[1:-1], {})
        elif "=" in line and not line.startswith(("#", ";")):
            key, value = line.split("=", 1)
            current[key.strip()] = value.strip()
    return found


def udev_names(files: dict[str, str]) -> dict[str, str]:
    """MAC -> name from the persistent-net rules a renderer wrote (renames at next boot)."""
    rules = files.get("etc/udev/rules.d/70-persistent-net.rules", "")
    pairs = re.findall(r'ATTR\{address\}=="([^"]+)", NAME="([^"]+)"', rules)
    return {mac.lower(): name for mac, name in pairs}


def netplan(files: dict[str, str]) -> list[Nic]:
    document = yaml.safe_load(files["etc/netplan/50-cloud-init.yaml"])["network"]
    found = []
    for key, eth in document["ethernets"].items():
        routes = {r["to"]: r["via"] for r in eth.get("routes", [])}
        nameservers = eth.get("nameservers", {})
        found.append(
            Nic(
                eth.get("set-name") or (key if "match" not in eth else None),
                eth.get("match", {}).get("macaddress"),
                (eth.get("addresses") or [None])[0],
                eth.get("gateway4") or routes.get("default") or routes.get("0.0.0.0/0"),
                tuple(nameservers.get("addresses", ())),
                tuple(nameservers.get("search", ())),
            )
        )
    return found


def networkd(files: dict[str, str]) -> list[Nic]:
    found = []
    for path in sorted(f for f in files if f.startswith("etc/systemd/network/")):
        ini = sections(files[path])
        network = ini.get("Network", {})
        found.append(
            Nic(
                ini["Match"].get("Name"),
                (ini["Match"].get("MACAddress") or "").lower() or None,
                ini.get("Address", {}).get("Address"),
                ini.get("Route", {}).get("Gateway"),
                tuple(network.get("DNS", "").split()),
                tuple(network.get("Domains", "").split()),
            )
        )
    return found


def eni(files: dict[str, str]) -> list[Nic]:
    text = files["etc/network/interfaces.d/50-cloud-init"]
    found = []
    for name in re.findall(r"^iface (\S+) inet static$", text, re.M):
        stanza = text.split(f"iface {name} inet static\n", 1)[1].split("\n\n", 1)[0]
        options = dict(line.strip().split(" ", 1) for line in stanza.splitlines() if line.strip())
        macs = [mac for mac, renamed in udev_names(files).items() if renamed == name]
        found.append(
            Nic(
                name,
                macs[0] if macs else options.get("hwaddress"),
                options.get("address"),
                options.get("gateway"),
                tuple(options.get("dns-nameservers", "").split()),
                tuple(options.get("dns-search", "").split()),
            )
        )
    return found


def sysconfig(files: dict[str, str]) -> list[Nic]:
    found = []
    for path in sorted(f for f in files if f.startswith("etc/sysconfig/network-scripts/ifcfg-")):
        lines = [line.split("=", 1) for line in files[path].splitlines() if "=" in line]
        cfg = {key: value.strip('"') for key, value in lines if not key.startswith("#")}
        netmask = cfg.get("NETMASK", "255.255.255.255")
        prefix = cfg.get("PREFIX") or ipaddress.IPv4Network(f"0.0.0.0/{netmask}").prefixlen
        found.append(
            Nic(
                cfg.get("DEVICE"),
                (cfg.get("HWADDR") or "").lower() or None,
                f"{cfg['IPADDR']}/{prefix}" if "IPADDR" in cfg else None,
                cfg.get("GATEWAY"),
                tuple(cfg[k] for k in ("DNS1", "DNS2", "DNS3") if k in cfg),
                tuple(cfg.get("DOMAIN", "").split()),
            )
        )
    return found


def network_manager(files: dict[str, str]) -> list[Nic]:
    found = []
    for path in sorted(f for f in files if f.endswith(".nmconnection")):
        ini = sections(files[path])
        ipv4 = ini.get("ipv4", {})
        address, _, gateway = ipv4.get("address1", "").partition(",")
        found.append(
            Nic(
                ini["connection"].get("interface-name"),
                (ini.get("ethernet", {}).get("mac-address") or "").lower() or None,
                address or None,
                ipv4.get("gateway") or gateway or None,
                tuple(d for d in ipv4.get("dns", "").split(";") if d),
                tuple(d for d in ipv4.get("dns-search", "").split(";") if d),
            )
        )
    return found


READ_ALL: dict[str, Callable[[dict[str, str]], list[Nic]]] = {
    "netplan": netplan,
    "networkd": networkd,
    "eni": eni,
    "sysconfig": sysconfig,
    "network-manager": network_manager,
}


def read_one(renderer: str, files: dict[str, str]) -> Nic:
    """The one NIC a renderer configured (a second one fails the test)."""
    (nic,) = READ_ALL[renderer](files)
    return nic


# --- the tests ----------------------------------------------------------------------------


def test_the_datasource_reads_the_documents_and_names_the_nic_by_its_mac(
    guest: dict[str, Any],
) -> None:
    """cloud-init's VMware datasource decodes the metadata to a network config that
    finds the NIC by MAC; cloud-init renames that NIC to eth0 at boot (`extract_physdevs`
    lists the renames it waits for and applies before any config is written)."""
    (nic,) = guest["network_config"]["config"]
    assert (nic["type"], nic["mac_address"]) == ("physical", MAC)
    assert guest["physdevs"] == [[MAC, NIC_NAME, None, None]]


@pytest.mark.parametrize("renderer", RENDERERS)
def test_each_renderer_configures_the_nic_with_that_mac(
    renderer: str, guest: dict[str, Any]
) -> None:
    """The config of every renderer finds the NIC by its MAC, or by the name cloud-init
    gives the NIC with that MAC; never by a name the guest's NIC does not have."""
    seen = read_one(renderer, guest["rendered"][renderer])
    renamed = {mac: name for mac, name, _driver, _id in guest["physdevs"]}
    assert seen.mac == MAC, f"{renderer}: no MAC match for the NIC: {seen}"
    assert seen.name in (None, renamed[MAC]), f"{renderer}: names {seen.name}, not the NIC"
    assert (seen.address, seen.gateway) == ("127.0.20.50/24", "127.0.20.1"), seen
    assert (seen.dns, seen.search) == (("127.0.20.2", "127.0.20.3"), ("lab.test",)), seen


def test_eni_sets_the_gateway_itself(guest: dict[str, Any]) -> None:
    """ENI's own `gateway` option (ifupdown adds the route with iproute2); a default route
    would be `post-up route add`, which needs net-tools, not in Debian's cloud images."""
    text = guest["rendered"]["eni"]["etc/network/interfaces.d/50-cloud-init"]
    assert "    gateway 127.0.20.1\n" in text and "route add" not in text


def test_the_guest_is_web01_in_lab_test_with_its_etc_hosts(guest: dict[str, Any]) -> None:
    """The datasource's host name and FQDN (from local-hostname), what cc_set_hostname
    would set (user-data's hostname and fqdn win), and /etc/hosts as cc_update_etc_hosts
    writes it with manage_etc_hosts: true; the user-data passes cloud-init's schema."""
    assert (guest["datasource_hostname"], guest["datasource_fqdn"]) == ("web01", "web01.lab.test")
    assert (guest["hostname"], guest["fqdn"]) == ("web01", "web01.lab.test")
    assert guest["userdata"]["manage_etc_hosts"] is True
    assert "127.0.1.1 web01.lab.test web01" in guest["etc_hosts"].splitlines()
    assert guest["schema_error"] is None


def test_without_a_search_domain_or_dns_the_name_is_bare(cloud_init: str, tmp_path: Path) -> None:
    """No domain, no DNS: web01 is web01, every renderer still sets the address and
    gateway; a `localhost` policy leaves the rest of /etc/hosts alone."""
    bare = dataclasses.replace(IDENTITY, dns=(), search_domain="")
    guest = boot(extra_config(INSTANCE_ID, bare, MAC, "localhost"), tmp_path)
    assert (guest["hostname"], guest["fqdn"], guest["datasource_fqdn"]) == ("web01",) * 3
    assert guest["schema_error"] is None
    assert "127.0.1.1\tweb01\tweb01" in guest["etc_hosts"].splitlines()
    for renderer in RENDERERS:
        seen = read_one(renderer, guest["rendered"][renderer])
        assert seen.mac == MAC and seen.address == "127.0.20.50/24", (renderer, seen)
        assert (seen.gateway, seen.dns, seen.search) == ("127.0.20.1", (), ()), (renderer, seen)


def test_the_host_key_deploybot_chose_is_the_guests_only_host_key(
    guest: dict[str, Any], tmp_path: Path
) -> None:
    """With `Identity.host_key`, the user-data passes cloud-init's schema and cc_ssh
    would delete the image's host keys and write exactly that pair, the private key
    0600, the public key its own half: sshd then presents the key deploybot knows."""
    pair = chosen_host_key()
    # Without a chosen key (the module's guest), nothing of the kind: the image's own.
    assert guest["ssh_key_files"] == {} and "ssh_deletekeys" not in guest["userdata"]
    guest = boot(
        extra_config(INSTANCE_ID, dataclasses.replace(IDENTITY, host_key=pair), MAC), tmp_path
    )
    assert guest["schema_error"] is None
    assert guest["userdata"]["ssh_deletekeys"] is True
    private, public = "/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ed25519_key.pub"
    assert guest["ssh_key_files"] == {
        private: [pair.private_openssh, 0o600],
        public: [pair.public, 0o600],
    }
    assert public_of(guest["ssh_key_files"][private][0]) == pair.public


DEBIAN_SSHD_CONFIG = """Include /etc/ssh/sshd_config.d/*.conf

KbdInteractiveAuthentication no
UsePAM yes
X11Forwarding yes
"""


@pytest.mark.parametrize("includes", [True, False], ids=["drop-in", "sshd_config"])
def test_cc_ssh_installs_the_host_certificate_and_sets_host_certificate(
    cloud_init: str, tmp_path: Path, includes: bool
) -> None:
    """With `Identity.host_certificate`, Debian's cc_ssh (run for real on a folder that is
    /etc/ssh in its own mount namespace) deletes the image's keys, writes the chosen pair
    and the certificate (ssh_host_ed25519_key-cert.pub) and points sshd's HostCertificate
    at it: in sshd_config.d/50-cloud-init.conf when sshd_config includes that folder
    (Debian 12), else in sshd_config itself."""
    pair = chosen_host_key()
    certificate = host_certificate(pair.public, ("web01", "web01.lab.test", "127.0.20.50"))
    identity = dataclasses.replace(IDENTITY, host_key=pair, host_certificate=certificate)
    etc_ssh = tmp_path / "etc-ssh"
    (etc_ssh / "sshd_config.d").mkdir(parents=True)
    config = DEBIAN_SSHD_CONFIG if includes else DEBIAN_SSHD_CONFIG.split("\n", 2)[2]
    (etc_ssh / "sshd_config").write_text(config)
    (etc_ssh / "ssh_host_rsa_key").write_text("the image's own key\n")
    (etc_ssh / "ssh_host_rsa_key.pub").write_text("ssh-rsa AAAA image\n")
    (guest_dir := tmp_path / "guest").mkdir()
    guest = boot(extra_config(INSTANCE_ID, identity, MAC), guest_dir, etc_ssh)
    assert guest["schema_error"] is None
    assert guest["userdata"]["ssh_keys"]["ed25519_certificate"] == certificate + "\n"
    files = guest["etc_ssh"]
    cert = "/etc/ssh/ssh_host_ed25519_key-cert.pub"
    assert files[cert] == [certificate + "\n", 0o600]
    assert files["/etc/ssh/ssh_host_ed25519_key"] == [pair.private_openssh, 0o600]
    assert "/etc/ssh/ssh_host_rsa_key" not in files  # ssh_deletekeys
    drop_in = "/etc/ssh/sshd_config.d/50-cloud-init.conf"
    if includes:
        assert files[drop_in][0].splitlines() == [f"HostCertificate {cert}"]
        assert files["/etc/ssh/sshd_config"][0] == config
    else:
        assert drop_in not in files
        assert files["/etc/ssh/sshd_config"][0] == config + f"HostCertificate {cert}\n"


def test_two_nics_are_each_renamed_by_their_mac(two_nics: dict[str, Any]) -> None:
    macs = [nic["mac_address"] for nic in two_nics["network_config"]["config"]]
    assert macs == [MAC, MAC2]
    assert two_nics["physdevs"] == [[MAC, NIC_NAME, None, None], [MAC2, "eth1", None, None]]


@pytest.mark.parametrize("renderer", RENDERERS)
def test_each_renderer_configures_both_nics_the_default_route_on_the_first(
    renderer: str, two_nics: dict[str, Any]
) -> None:
    """Each NIC found by its MAC (or the name cloud-init gives it) with its own address;
    the gateway only on the first (the default route: ifupdown would refuse a second and
    leave that NIC down); DNS and the merged search list once, with the first."""
    renamed = {mac: name for mac, name, _driver, _id in two_nics["physdevs"]}
    seen = {nic.mac: nic for nic in READ_ALL[renderer](two_nics["rendered"][renderer])}
    assert set(seen) == {MAC, MAC2}, f"{renderer}: {seen}"
    first, second = seen[MAC], seen[MAC2]
    assert first.name in (None, renamed[MAC]) and second.name in (None, renamed[MAC2])
    assert (first.address, first.gateway) == ("127.0.20.50/24", "127.0.20.1"), first
    assert first.search == ("lab.test", "lab30.test"), first
    assert (second.address, second.gateway) == ("127.0.30.60/24", None), second
    assert first.dns == ("127.0.20.2", "127.0.20.3")
