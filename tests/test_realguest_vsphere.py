"""Real guests become what the vSphere backend wrote into guestinfo (issue 16, item 3).

The backend clones two VMs on vcsim with an identity; the test reads back, through the
vSphere API, the exact `guestinfo.*` values it left in each clone's extraConfig, and the
MAC vCenter gave each NIC. Two Debian 12 guests then boot under QEMU with that MAC and
those values, concurrently: the ENI image (ifupdown, what Debian's cloud-init renders)
and the netplan image (netplan.io + systemd-networkd + systemd-resolved, as on Ubuntu).

The transport: cloud-init's VMware datasource (22.4) reads guestinfo from environment
variables too (`VMX_GUESTINFO=1`, then `VMX_GUESTINFO_METADATA`, `..._ENCODING`, ...,
each named by `get_guestinfo_envvar_key_name`), and systemd hands `systemd.setenv=`
from the kernel command line to every unit, cloud-init's included. `ci.ds=VMware` makes
ds-identify write `datasource_list: [ VMware, None ]` to /run/cloud-init/cloud.cfg,
which outranks the image's `[NoCloud, None]`. The values are not re-encoded: the kernel
command line carries the very strings vCenter stored (their length is checked against
the kernel's own `cmdline_size` and printed).

Each guest has a second NIC, as a deploy with a second address gets it: added in the
clone spec, with the MAC vCenter gave it, on a restricted QEMU user-mode network of its
own; the metadata lists both by MAC, the gateway on the first only.

Inside each guest (over SSH on the 127.0.0.1 forward, as the user with the key): the
datasource and the instance-id, the user-data cloud-init read (byte for byte the
document the backend wrote), hostname and FQDN, the address, gateway and DNS on the NIC
with vCenter's MAC (named eth0 by cloud-init), the second NIC's address on eth1 and
no default route through it, what each renderer wrote, cloud-init done and no failed unit.

The host key (issue 28): each identity carries a host key pair deploybot chose (as a
deploy's identity step makes it); the guest's sshd presents exactly that key, to this
test's login and to the backend's own SSH check, and holds no other. Then, as a deploy
does once SSH answered, the backend forgets it: the clone's extraConfig in vcsim holds no
private key afterwards. The chosen key comes with its host certificate (deploybot's
`HostCA` signs it, the cloud-config installs it): the real OpenSSH client, whose
known_hosts holds only the CA's `@cert-authority` line, logs in to each guest by its FQDN
with StrictHostKeyChecking=yes. Skips without QEMU, an image or vcsim; CI fails instead.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import ipaddress
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from pyVmomi import vim

from backends.base import CloneSpec, Identity, Nic, VMRef
from backends.sshcheck import fingerprint, new_host_key, public_line
from backends.vsphere import VSphereBackend
from backends.vsphere import guestinfo as written_guestinfo
from bot.sshca.authority import HostCA
from tests.support.realguest import image, openssh, qemu, support
from tests.support.vsphere.simulator import (
    TEMPLATE,
    Simulated,
    TlsFiles,
    simulator,
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

DOMAIN, USER = "example.test", "deploy"
GATEWAY, DNS = "10.0.0.1", "10.0.0.3"  # where QEMU's user-mode network answers
ADDRESSES = {"eni": "10.0.0.50", "netplan": "10.0.0.51"}
# The second NIC's network: QEMU answers there at .2; the guests have no gateway there.
NETWORK2, HOST2 = "10.0.20.0/24", "10.0.20.2"
ADDRESSES2 = {"eni": "10.0.20.50", "netplan": "10.0.20.51"}
BOOT_SECONDS = 480.0  # TCG, two guests on two cores shared with other work


@dataclass(frozen=True)
class Client:
    """What the real ssh client logs in with: the user's key and a known_hosts file
    holding only the host CA's line."""

    identity: Path
    known_hosts: Path


@dataclass(frozen=True)
class Written:
    """What the backend left on one clone, read back from vCenter."""

    variant: image.Variant
    identity: Identity
    ref: VMRef
    vm_id: str
    mac: str
    guestinfo: dict[str, str]  # every `guestinfo.*` key of the clone's extraConfig
    mac2: str  # the second NIC's, vCenter's too


@pytest.fixture(name="images")
def images_fixture() -> dict[str, Path]:
    return {v.name: support.require_image(v) for v in (image.ENI, image.NETPLAN)}


def certified(ident: Identity, ca: HostCA) -> Identity:
    """`ident` with the host certificate of its chosen key, signed as deploybot signs it:
    for the name, the FQDN and the address, from five minutes ago."""
    assert ident.host_key is not None
    now = datetime.now(UTC)
    line = ca.sign(
        ident.host_key.public,
        principals=[ident.hostname, written_guestinfo.fqdn(ident), str(ident.address.ip)],
        valid_after=now - timedelta(minutes=5),
        valid_before=now + timedelta(days=1),
        key_id=f"deploybot:test:{ident.hostname}",
    )
    return replace(ident, host_certificate=line)


def identity(variant: str, key: str) -> Identity:
    return Identity(
        hostname=f"web-{variant}",
        user=USER,
        ssh_keys=(key,),
        address=ipaddress.IPv4Interface(f"{ADDRESSES[variant]}/24"),
        gateway=ipaddress.IPv4Address(GATEWAY),
        dns=(ipaddress.IPv4Address(DNS),),
        search_domain=DOMAIN,
        upgrade=False,  # no mirror to upgrade from
        cores=1,
        memory_mib=1024,
        host_key=new_host_key(),  # what a deploy's identity step gives a ChoosesHostKeys backend
        more_nics=(Nic(ipaddress.IPv4Interface(f"{ADDRESSES2[variant]}/24")),),
    )


async def clone_on_vcsim(lab: Simulated, identities: dict[str, Identity]) -> list[Written]:
    """Clone through the backend as a deploy does (clone, then apply_identity), then read
    each clone's extraConfig and NIC through the API, as the operator would."""
    backend = lab.sim.backend()
    written = []
    try:
        for number, (variant, ident) in enumerate(identities.items(), start=1):
            spec = CloneSpec(
                f"jvsrg{number:02d}",
                ident.hostname,
                TEMPLATE,
                identity=ident,
                more_nics=ident.more_nics,
            )
            ref = await backend.prepare_clone(spec)
            await backend.clone(spec, ref)
            await backend.apply_identity(ref, ident)
            vm = lab.sim.vm(ref.vm_id)
            card = vim.vm.device.VirtualEthernetCard
            nic, nic2 = [d for d in vm.config.hardware.device if isinstance(d, card)]
            extra = lab.sim.extra(vm)
            guestinfo = {k: v for k, v in extra.items() if k.startswith("guestinfo.")}
            mac, mac2 = str(nic.macAddress), str(nic2.macAddress)
            written.append(
                Written(image.VARIANTS[variant], ident, ref, ref.vm_id, mac, guestinfo, mac2)
            )
    finally:
        await backend.close()
    return written


def envvar(key: str) -> str:
    """cloud-init's `get_guestinfo_envvar_key_name`: guestinfo.a.b -> VMX_GUESTINFO_A_B."""
    return ("vmx." + key).upper().replace(".", "_")


def cmdline(guestinfo: dict[str, str]) -> str:
    """The kernel arguments that hand `guestinfo` to the VMware datasource unchanged."""
    words = ["ci.ds=VMware", "systemd.setenv=VMX_GUESTINFO=1"]
    for key, value in sorted(guestinfo.items()):
        # One word each: the kernel splits at blanks and strips quotes.
        assert value and not any(c.isspace() or c in "\"'\\" for c in value), (key, value)
        words.append(f"systemd.setenv={envvar(key)}={value}")
    return " ".join(words)


def document(guestinfo: dict[str, str], name: str) -> str:
    """A guestinfo document as the datasource decodes it (gzip+base64 is all we write)."""
    assert guestinfo[f"guestinfo.{name}.encoding"] == "gzip+base64"
    return gzip.decompress(base64.b64decode(guestinfo[f"guestinfo.{name}"])).decode()


@dataclass
class Seen:
    """What one guest became, from inside, and when (seconds after QEMU started)."""

    written: Written
    accel: str = ""
    ssh_up: float = 0.0
    ci_done: float = 0.0
    status: str = ""
    query: str = ""  # platform, subplatform, instance-id as `cloud-init query` has them
    userdata: str = ""
    hostname: str = ""
    fqdn: str = ""
    authorized_keys: str = ""
    net: support.NetView | None = None
    net2: support.NetView | None = None  # the second NIC's
    rendered: str = ""  # what the renderer wrote
    dns: str = ""  # netplan: resolved's upstream servers and domains for the NIC
    system: str = ""  # `systemctl is-system-running --wait`
    failed: str = ""  # `systemctl --failed`
    network_unit: str = ""  # the unit that brings the NIC up and waits for it: its state
    warnings: list[str] | None = None  # cloud-init's WARNING lines
    presented: str = ""  # the host key sshd showed this test's login
    openssh: tuple[int, str] = (-1, "")  # the real ssh client's login: exit code, stderr
    probed: str | None = None  # the host key the backend's SSH check read (probe_ssh)
    key_files: str = ""  # /etc/ssh/ssh_host_*_key.pub
    ed25519: str = ""  # /etc/ssh/ssh_host_ed25519_key.pub


async def boot(
    written: Written,
    folder: Path,
    workdir: Path,
    key: asyncssh.SSHKey,
    backend: VSphereBackend,
    client: Client,
) -> Seen:
    seen = Seen(written)
    guest = qemu.Guest(
        image=folder,
        workdir=workdir,
        seed=None,
        mac=written.mac,
        address=str(written.identity.address.ip),
        gateway=GATEWAY,
        dns=DNS,
        cpus=1,  # two guests on two cores
        append=cmdline(written.guestinfo),
        more_nics=(qemu.MoreNic(written.mac2, NETWORK2, HOST2),),
    )
    guest.start()
    try:
        seen.accel = guest.accel
        conn = await support.ssh_login(guest, USER, key, guest.started + BOOT_SECONDS)
        seen.ssh_up = time.monotonic() - guest.started
        async with conn:
            server_key = conn.get_server_host_key()
            assert server_key is not None
            seen.presented = public_line(server_key)
            await observe(conn, seen, guest.started)
        local = ipaddress.IPv4Address("127.0.0.1")  # the forward to the guest's port 22
        seen.probed = await backend.probe_ssh(written.ref, local, guest.ssh_port)
        seen.openssh = await openssh.login(
            None, user=USER, host=written_guestinfo.fqdn(written.identity),
            address=str(local), port=guest.ssh_port,
            identity=client.identity, known_hosts=client.known_hosts,
        )  # fmt: skip
        return seen
    finally:
        guest.stop()


async def observe(conn: asyncssh.SSHClientConnection, seen: Seen, started: float) -> None:
    async def out(command: str) -> str:
        return (await support.out(conn, command)).strip()

    seen.status = await support.out(conn, "cloud-init status --wait --long", check=False)
    seen.ci_done = time.monotonic() - started
    fields = "{{v1.platform}} {{v1.subplatform}} {{v1.instance_id}}"
    seen.query = await out(f"sudo -n cloud-init query --format '{fields}'")
    seen.userdata = await support.out(conn, "sudo -n cat /var/lib/cloud/instance/user-data.txt")
    seen.hostname = await out("hostname")
    seen.fqdn = await out("hostname --fqdn")
    seen.authorized_keys = await out("cat ~/.ssh/authorized_keys")
    seen.net = await support.net_view(conn, seen.written.mac)
    seen.net2 = await support.net_view(conn, seen.written.mac2)
    if seen.written.variant is image.NETPLAN:
        seen.rendered = await out("cat /etc/netplan/50-cloud-init.yaml")
        seen.dns = await out(f"resolvectl dns {seen.net.nic}; resolvectl domain {seen.net.nic}")
        unit = "systemd-networkd-wait-online.service"
    else:
        eni = "/etc/network/interfaces.d/50-cloud-init"
        seen.rendered = await out(f"cat {eni} /etc/udev/rules.d/70-persistent-net.rules")
        unit = "networking.service"  # `ifup -a`; Debian leaves ifupdown-wait-online off
    seen.system = await support.out(conn, "systemctl is-system-running --wait", check=False)
    seen.failed = await out("systemctl --failed --plain --no-legend")
    props = "Result,ActiveState,InactiveExitTimestampMonotonic,ActiveEnterTimestampMonotonic"
    seen.network_unit = await out(f"systemctl show -p {props} {unit}")
    log = await out("sudo -n grep -F '[WARNING]' /var/log/cloud-init.log || true")
    seen.warnings = log.splitlines()
    seen.key_files = await out("ls /etc/ssh/ssh_host_*_key.pub")
    # cloud-init 22.4 writes an `ssh_keys` public key 0600 (cc_ssh's CONFIG_KEY_TO_FILE).
    seen.ed25519 = await out("sudo -n cat /etc/ssh/ssh_host_ed25519_key.pub")


def check(seen: Seen, public: str) -> None:
    """Everything the guest became, against what the backend wrote."""
    w, ident = seen.written, seen.written.identity
    name = ident.hostname
    assert "status: done" in seen.status, seen.status
    assert seen.query == f"vmware envvar (VMX_GUESTINFO_METADATA) {w.vm_id}", seen.query
    # The user-data cloud-init acted on is the document in vCenter, byte for byte.
    assert seen.userdata == document(w.guestinfo, "userdata")
    assert seen.hostname == name
    assert seen.fqdn == f"{name}.{DOMAIN}"
    assert public in seen.authorized_keys.splitlines()
    net = seen.net
    assert net is not None
    assert net.nic == "eth0", net  # cloud-init renamed the NIC with vCenter's MAC
    assert f"inet {ident.address.with_prefixlen}" in net.addresses, net
    assert f"default via {GATEWAY} dev eth0" in net.routes, net
    # The second NIC: renamed eth1 by its MAC, its address, no default route through it.
    assert seen.net2 is not None and seen.net2.nic == "eth1", seen.net2
    assert f"inet {ident.more_nics[0].address.with_prefixlen}" in seen.net2.addresses
    defaults = [r.split()[:5] for r in net.routes.splitlines() if r.startswith("default")]
    assert defaults == [["default", "via", GATEWAY, "dev", "eth0"]], net.routes
    search = [line for line in net.resolv if line.split()[:1] == ["search"]]
    assert search and DOMAIN in search[0].split(), net.resolv
    if w.variant is image.NETPLAN:
        # netplan matches the MAC and sets the name; resolved has the DNS for the NIC.
        assert f"macaddress: {w.mac}" in seen.rendered and "set-name: eth0" in seen.rendered
        assert f"macaddress: {w.mac2}" in seen.rendered and "set-name: eth1" in seen.rendered
        assert "nameserver 127.0.0.53" in net.resolv, net.resolv  # resolved's stub
        assert DNS in seen.dns and DOMAIN in seen.dns, seen.dns
    else:
        assert "iface eth0 inet static" in seen.rendered, seen.rendered
        assert f'ATTR{{address}}=="{w.mac}", NAME="eth0"' in seen.rendered, seen.rendered
        assert f'ATTR{{address}}=="{w.mac2}", NAME="eth1"' in seen.rendered, seen.rendered
        assert f"nameserver {DNS}" in net.resolv, net.resolv
    assert seen.system.strip() == "running", (seen.system, seen.failed)
    assert seen.failed == "", seen.failed
    unit = dict(line.split("=", 1) for line in seen.network_unit.splitlines())
    assert (unit["Result"], unit["ActiveState"]) == ("success", "active"), unit
    # cloud-init 22.4's one complaint: without vmware-rpctool (no VMware Tools, no
    # hypervisor to tell) it cannot publish local-ipv4/-ipv6 back into guestinfo.
    # Any other warning is the documents' fault until shown otherwise.
    unexpected = [
        line
        for line in seen.warnings or []
        if "while trying to set guestinfo key=local-" not in line
    ]
    assert unexpected == [], unexpected


def check_host_key(seen: Seen) -> None:
    """The guest's sshd presents exactly the key deploybot chose, to any client, and
    the guest has no other host key (cloud-init's `ssh_keys` with `ssh_deletekeys`)."""
    pair = seen.written.identity.host_key
    assert pair is not None
    chosen = fingerprint(pair.public)
    assert fingerprint(seen.presented) == chosen, (seen.presented, pair.public)
    assert seen.probed == pair.public, (seen.probed, pair.public)
    assert " ".join(seen.ed25519.split()[:2]) == pair.public, (seen.ed25519, pair.public)
    assert seen.key_files.split() == ["/etc/ssh/ssh_host_ed25519_key.pub"], seen.key_files
    # Its certificate, from the cloud-config, makes the @cert-authority line enough.
    code, err = seen.openssh
    assert code == 0, err


async def forget_host_keys(lab: Simulated, written: list[Written]) -> None:
    """What a deploy does once SSH answered with the chosen key: the backend blanks the
    private key in guestinfo; read back through the API, no extraConfig value holds one."""
    backend = lab.sim.backend()
    try:
        for w in written:
            await backend.forget_host_key(w.ref)
            assert not await backend.holds_host_key(w.ref)
            extra = lab.sim.extra(lab.sim.vm(w.vm_id))
            assert not extra.get(written_guestinfo.USERDATA_KEY), extra
            for key, value in extra.items():
                encoding = extra.get(f"{key}.encoding") or None
                text = written_guestinfo.read(value, encoding) if value else ""
                assert not written_guestinfo.holds_private_key(text), key
            # What the guest booted from is still there: only the user-data went.
            metadata = written_guestinfo.METADATA_KEY
            assert extra[metadata] == w.guestinfo[metadata]
    finally:
        await backend.close()


def network_unit_s(seen: Seen) -> float:
    """Seconds the network unit took from starting to active (wait-online: the wait)."""
    unit = dict(line.split("=", 1) for line in seen.network_unit.splitlines())
    start, end = (int(unit[f"{p}TimestampMonotonic"]) for p in ("InactiveExit", "ActiveEnter"))
    return (end - start) / 1e6


async def test_vsphere_guestinfo_on_real_guests(
    images: dict[str, Path],
    vcsim_binary: Path,
    vcsim_tls: TlsFiles,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    public = key.export_public_key().decode().strip()
    ca = HostCA(asyncssh.generate_private_key("ssh-ed25519"), [f"*.{DOMAIN}"], 1, "this test")
    identities = {name: certified(identity(name, public), ca) for name in images}
    client = Client(tmp_path / "id_ed25519", tmp_path / "known_hosts")
    key.write_private_key(str(client.identity))
    client.identity.chmod(0o600)
    client.known_hosts.write_text(ca.authority_line() + "\n", encoding="utf-8")
    # vcsim runs on through the boots: the host keys are forgotten once SSH answered.
    with simulator(vcsim_binary, vcsim_tls, tmp_path, esx=False) as lab:
        written = await clone_on_vcsim(lab, identities)

        lines = []
        for w in written:
            assert {"guestinfo.metadata", "guestinfo.userdata"} <= set(w.guestinfo), w.guestinfo
            assert written_guestinfo.holds_private_key(document(w.guestinfo, "userdata"))
            length = len(f"{qemu.BASE_CMDLINE} {cmdline(w.guestinfo)}")
            limit = qemu.cmdline_size(images[w.variant.name])
            sizes = ", ".join(f"{k} {len(v)}" for k, v in sorted(w.guestinfo.items()))
            lines.append(
                f"{w.variant.name}: kernel command line {length} of {limit} bytes ({sizes})"
            )
            assert length <= limit, lines[-1]

        checker = lab.sim.backend()  # its SSH check, as a deploy's ssh step runs it
        try:
            results: list[Any] = await asyncio.gather(
                *(
                    boot(w, images[w.variant.name], tmp_path / w.variant.name, key, checker, client)
                    for w in written
                ),
                return_exceptions=True,
            )
        finally:
            await checker.close()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for seen in results:
            check_host_key(seen)
        await forget_host_keys(lab, written)
    for seen in results:
        check(seen, public)
        lines.append(
            f"{seen.written.variant.name} ({seen.accel}): SSH up {seen.ssh_up:.0f} s, "
            f"cloud-init done {seen.ci_done:.0f} s, network unit {network_unit_s(seen):.1f} s"
        )
    with capsys.disabled():
        print("\nvSphere guestinfo on real guests:\n  " + "\n  ".join(lines))
