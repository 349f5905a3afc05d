"""`deploybot deploy` against the fake Proxmox running real guests, end to end.

The fake's VMs are QEMU guests here (`tests/support/fakepve/realvm.py`): a template's disk is
the guest image, a clone is a qcow2 overlay of it, start renders Proxmox's NoCloud seed
from the cloud-init fields deploybot set and boots QEMU, the guest agent endpoints are
answered by the real qemu-guest-agent and the fake's jump host leads ADDRESS:22 to the
guest's SSH forward on 127.0.0.1. The real CLI (a separate process, unchanged) deploys
three guests at once from one template: two must end with an SSH line that works (the
deploy's key logs in through the jump host) on a guest that is what was asked, checked
inside it (`tests/support/realguest/guestchecks.py`: hostname and FQDN, user, key and locked
password, address, route and DNS on deploybot's NIC, no upgrade, Proxmox's
instance-id, the printed host key its own: the one the real qemu-guest-agent read, whose
known_hosts line is the guest's key file), and are distinct instances. The real OpenSSH
client, with only that known_hosts line and StrictHostKeyChecking=yes, logs in without a
question and refuses another key under the same names. The third guest boots, but the jump
host leads its address to an impostor's sshd (another host key: an address conflict or an
interceptor): the deploy must refuse that key, naming the address and both fingerprints,
and its rollback must leave no VM, QEMU process or disk behind.
Every subnet of the deploys' config has its segment on pve (vmbr0) and there is a
second lab subnet, lab20 (10.0.20.0/24 on vmbr0 VLAN 20): web02 asks for a NIC more
there (`+10.0.20.51`), which deploybot writes as `net1` on that VLAN and `ipconfig1`
without a gateway, and the same guest boots with both NICs (the second on a restricted
user-mode network of its own): each address on the NIC with its MAC, the default route
on the first, both subnets' resolvers and search domains. No boot more for it.
Afterwards `deploybot destroy` removes one of the two the same way, and a shutdown
through the API powers the other off by its guest agent.

Skips, saying why, without QEMU or the image; under DEPLOYBOT_REQUIRE_REALGUEST=1 (CI)
that is a failure. Nothing leaves loopback: 10.0.0.x exist only inside QEMU's
restricted user-mode networks and are reached only through the jump host.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncssh
import pytest
import pytest_asyncio
from asyncssh.public_key import SSHOpenSSHCertificate

from tests.support.fakepve import testing
from tests.support.fakepve.realvm import RealMachines
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import run_deploybot, start_fake
from tests.support.realguest import nocloud, openssh, support
from tests.support.realguest.guestchecks import DNS, DOMAIN, GATEWAY, Seen, check_guest
from tests.support.realguest.impostor import Impostor
from tests.support.realguest.lane import (
    DEADLINE_S,
    LOGIN,
    Deploy,
    assert_gone,
    deploy,
    login,
    out,
    process_ended,
)
from tests.support.realguest.support import require_image, unavailable

pytestmark = [pytest.mark.realguest, pytest.mark.asyncio(loop_scope="module")]

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

GOOD = {"web01": "10.0.0.50", "web02": "10.0.0.51"}
# Its guest boots, but the jump host leads its address to an impostor's sshd.
INTERCEPTED = ("web03", "10.0.0.52")
# web02's second NIC: in lab20 (config_text's, with segments), on vmbr0 VLAN 20.
SECOND_NIC = ("web02", "10.0.20.51")
DNS2, DOMAIN2 = "10.0.20.2", "lab20.example"  # lab20's
# web01 asks for no upgrade in so many words; web02 gets the default (no upgrade either)
# and a NIC more.
OPTIONS = {"web01": ("upgrade=no",), "web02": (f"+{SECOND_NIC[1]}",)}
# The variable holding the host CA's private key: not DEPLOYBOT_*, which `run_deploybot`
# keeps from the CLI; every other variable of this process reaches it.
CA_ENV = "REALGUEST_SSH_HOST_CA"
DAY_S = 86400


@dataclass
class Lab:
    fake: FakePVE
    machines: RealMachines
    key: asyncssh.SSHKey
    identity: Path  # the deploy's private key as a file, for the real ssh client
    impostor: Impostor
    ca: asyncssh.SSHKey  # the host CA the deploys sign with (`[ssh] host_ca_env`)
    deploys: dict[str, Deploy]
    seen: dict[str, Seen] = field(default_factory=dict)  # each good guest, checked once


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Lab]:
    disk = require_image()
    root = tmp_path_factory.mktemp("pvguest")
    workdir = Path(tempfile.mkdtemp(prefix="pvg-"))  # short: QEMU's unix sockets
    machines = RealMachines(disk, workdir)
    if not openssh.available():
        unavailable(f"no OpenSSH client at {openssh.SSH} (apt-get install openssh-client)")
    key = asyncssh.generate_private_key("ssh-ed25519")
    public = key.export_public_key().decode().strip()
    identity = root / "deploy-key"
    key.write_private_key(str(identity))
    identity.chmod(0o600)
    ca = asyncssh.generate_private_key("ssh-ed25519")
    with_ca = f'\n[ssh]\nhost_ca_env = "{CA_ENV}"\n'
    impostor = await Impostor().start()
    try:
        fake_lab = start_fake(
            pve_schema, pve_tls, jump_dir=root / "jump", machines=lambda _cluster: machines
        )
        with pytest.MonkeyPatch.context() as env:
            env.setenv(CA_ENV, ca.export_private_key("openssh").decode())
            async with fake_lab as fake:
                assert fake.jump is not None
                fake.jump.redirected[INTERCEPTED[1]] = impostor.endpoint
                wanted = [*GOOD.items(), INTERCEPTED]

                async def one(name: str, address: str) -> Deploy:
                    options = OPTIONS.get(name, ())
                    return await deploy(
                        fake, root, public, name, address, *options,
                        extra_toml=with_ca, segments=True,
                    )  # fmt: skip

                done = await asyncio.gather(*(one(n, a) for n, a in wanted))
                deploys = {d.name: d for d in done}
                yield Lab(fake, machines, key, identity, impostor, ca, deploys)
    finally:
        await impostor.close()
        shutil.rmtree(workdir, ignore_errors=True)


async def _check(lab: Lab, name: str) -> Seen:
    """The guest NAME is what its deploy asked for (checked inside it once)."""
    if name not in lab.seen:
        lab.seen[name] = await check_guest(lab.fake, lab.machines, lab.key, lab.deploys[name])
    return lab.seen[name]


async def test_deploy_ends_on_a_real_guest_as_printed(
    lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = lab.deploys["web01"]
    await _check(lab, deploy.name)
    with capsys.disabled():
        times = ", ".join(f"{d.name} {d.seconds:.0f} s" for d in lab.deploys.values())
        print(f"\nreal-guest deploys (together, {lab.machines.accel}): {times}")


async def test_second_deploy_from_the_template_is_another_instance(lab: Lab) -> None:
    first = await _check(lab, "web01")
    second = await _check(lab, "web02")
    assert first.instance_id != second.instance_id
    assert first.host_key != second.host_key
    # Both are linked clones: overlays whose backing file is the template's disk.
    for name in GOOD:
        info = await _qemu_img_info(lab.machines.disk(lab.deploys[name].vmid))
        assert f"backing file: {lab.machines.image / 'disk.qcow2'}" in info


async def test_a_real_ssh_client_trusts_the_known_hosts_line_alone(
    lab: Lab, tmp_path: Path
) -> None:
    """`ssh` with StrictHostKeyChecking=yes and BatchMode (no prompt possible) and a
    known_hosts holding only the line deploybot printed logs in; the same names with
    another key in that file are refused (so the client really checked)."""
    assert lab.fake.jump is not None
    deploy, seen = lab.deploys["web01"], await _check(lab, "web01")
    names, _key = seen.known_hosts.split(" ", 1)
    for host in names.split(","):  # the name and the address: either is in the line
        trusted = tmp_path / "known_hosts"
        trusted.write_text(seen.known_hosts + "\n", encoding="utf-8")
        code, err = await openssh.login(
            lab.fake.jump, user=LOGIN, host=host, address=deploy.address,
            identity=lab.identity, known_hosts=trusted,
        )  # fmt: skip
        assert code == 0, err
    other = tmp_path / "known_hosts_other"
    other.write_text(f"{names} {lab.impostor.public}\n", encoding="utf-8")
    code, err = await openssh.login(
        lab.fake.jump, user=LOGIN, host=deploy.name, address=deploy.address,
        identity=lab.identity, known_hosts=other,
    )  # fmt: skip
    assert code == 255 and "Host key verification failed." in err, (code, err)


async def test_with_the_host_ca_line_alone_ssh_asks_nothing(lab: Lab, tmp_path: Path) -> None:
    """The deploys certified the keys the agent confirmed and installed the certificates
    through the agent: the real ssh client, whose known_hosts holds only the line
    `deploybot ssh-ca` prints, logs in to each by its FQDN without a question."""
    assert lab.fake.jump is not None
    authority = await _authority_line(lab)
    ca_public = " ".join(lab.ca.export_public_key("openssh").decode().split()[:2])
    # Every subnet's search domain (the default `ca_hosts`): lab's and lab20's.
    hosts = f"*.{DOMAIN},*.{DOMAIN2}"
    assert authority == f"@cert-authority {hosts} {ca_public} deploybot-host-ca"
    trusted = tmp_path / "known_hosts"
    trusted.write_text(authority + "\n", encoding="utf-8")
    for name in GOOD:
        deploy, seen = lab.deploys[name], await _check(lab, name)
        fqdn = f"{name}.{DOMAIN}"
        said = " ".join(deploy.output.split())
        assert "certified by deploybot's host CA until " in said, deploy.output
        assert f"for {name}, {fqdn}, {deploy.address}:" in said, deploy.output
        # The certificate sshd presents: the guest's own key (the one the agent read),
        # signed by the CA, for the VM's name, FQDN and address, valid now.
        cert = await _installed_certificate(lab, deploy)
        assert " ".join(seen.known_hosts.split()[1:]) == _public(cert.key)
        assert cert.signing_key.get_fingerprint("sha256") == lab.ca.get_fingerprint("sha256")
        assert list(cert.principals) == [name, fqdn, deploy.address]
        code, err = await openssh.login(
            lab.fake.jump, user=LOGIN, host=fqdn, address=deploy.address,
            identity=lab.identity, known_hosts=trusted,
        )  # fmt: skip
        assert code == 0, err


async def test_a_certificate_past_its_validity_is_refused(lab: Lab, tmp_path: Path) -> None:
    """The same client refuses the guest once sshd presents a certificate of its key by
    the same CA whose validity has ended (written over the installed one, sshd
    reloaded): the @cert-authority line no longer vouches for it, and nothing else does."""
    assert lab.fake.jump is not None
    deploy = lab.deploys["web02"]
    await _check(lab, deploy.name)
    fqdn = f"{deploy.name}.{DOMAIN}"
    trusted = tmp_path / "known_hosts"
    trusted.write_text(await _authority_line(lab) + "\n", encoding="utf-8")
    bastion, conn = await login(lab.fake, lab.key, deploy.address)
    async with bastion, conn:
        path = await _certificate_path(conn)
        host_key = asyncssh.import_public_key(
            await out(conn, "cat /etc/ssh/ssh_host_ed25519_key.pub")
        )
        now = int(time.time())
        expired = lab.ca.generate_host_certificate(
            host_key, f"expired:{deploy.name}",
            principals=[deploy.name, fqdn, deploy.address],
            valid_after=now - 2 * DAY_S, valid_before=now - DAY_S,
        )  # fmt: skip
        line = expired.export_certificate("openssh").decode()
        await conn.run(f"sudo -n tee {path} >/dev/null", input=line, check=True)
        await out(conn, "sudo -n systemctl reload ssh")
        await _presented(conn, line.split()[1])
    code, err = await openssh.login(
        lab.fake.jump, user=LOGIN, host=fqdn, address=deploy.address,
        identity=lab.identity, known_hosts=trusted,
    )  # fmt: skip
    assert code == 255, err
    assert "Certificate invalid: expired" in err and "Host key verification failed." in err, err


async def _authority_line(lab: Lab) -> str:
    """The @cert-authority line `deploybot ssh-ca` prints with the deploys' config."""
    state = lab.deploys["web01"].state
    returncode, output = await run_deploybot(lab.fake, state / "deploybot.toml", state, "ssh-ca")
    assert returncode == 0, output
    lines = [line for line in output.splitlines() if line.startswith("@cert-authority ")]
    assert len(lines) == 1, output
    return lines[0]


async def _certificate_path(conn: asyncssh.SSHClientConnection) -> str:
    """The one HostCertificate file sshd's effective configuration names."""
    config = (await out(conn, "sudo -n sshd -T")).splitlines()
    paths = [line.split(" ", 1)[1] for line in config if line.startswith("hostcertificate ")]
    assert len(paths) == 1, paths
    return paths[0]


async def _installed_certificate(lab: Lab, deploy: Deploy) -> SSHOpenSSHCertificate:
    bastion, conn = await login(lab.fake, lab.key, deploy.address)
    async with bastion, conn:
        path = await _certificate_path(conn)
        line = await out(conn, f"sudo -n cat {path}")
    cert = asyncssh.import_certificate(line)
    assert isinstance(cert, SSHOpenSSHCertificate), line
    return cert


async def _presented(conn: asyncssh.SSHClientConnection, blob: str) -> None:
    """Wait until the guest's sshd, reloaded, presents the certificate `blob` (a reload
    re-executes sshd: a moment when it presents the old one or none)."""
    deadline = time.monotonic() + DEADLINE_S
    scan = "ssh-keyscan -c -t ed25519 127.0.0.1 2>/dev/null || true"
    while blob not in await out(conn, scan):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"sshd does not present the new certificate: {await out(conn, scan)}"
            )
        await asyncio.sleep(1.0)  # between polls of a condition bound by `deadline`


def _public(key: asyncssh.SSHKey) -> str:
    return " ".join(key.export_public_key("openssh").decode().split()[:2])


async def test_a_second_nic_comes_up_on_its_subnet_in_the_guest(lab: Lab) -> None:
    """web02 asked for `+10.0.20.51`: deploybot put the first NIC on its subnet's segment
    (vmbr0, untagged) and the second on lab20's (vmbr0 VLAN 20), firewall off, with
    `ipconfig1` carrying no gateway and both subnets' DNS merged; the guest has each
    address on the NIC with that MAC, the default route on the first only, and both
    resolvers and search domains; the real agent reports both addresses."""
    name, address2 = SECOND_NIC
    deploy = lab.deploys[name]
    await _check(lab, name)  # the first NIC, and everything else, as for every deploy
    vm = lab.fake.cluster.vms[deploy.vmid]
    config = vm.config
    mac, mac2 = nocloud.mac_of(config["net0"]), nocloud.mac_of(config["net1"])
    assert mac != mac2
    assert config["net0"] == f"virtio={mac},bridge=vmbr0,firewall=0", config
    assert config["net1"] == f"virtio={mac2},bridge=vmbr0,tag=20,firewall=0", config
    assert config["ipconfig0"] == f"ip={deploy.address}/24,gw={GATEWAY}", config
    assert config["ipconfig1"] == f"ip={address2}/24", config
    assert (config["nameserver"], config["searchdomain"]) == (
        f"{DNS} {DNS2}",
        f"{DOMAIN} {DOMAIN2}",
    ), config
    assert (
        "net2" not in config
        and "net1" not in lab.fake.cluster.vms[lab.deploys["web01"].vmid].config
    )
    assert address2 in deploy.output, deploy.output
    bastion, conn = await login(lab.fake, lab.key, deploy.address)
    async with bastion, conn:
        first, second = await support.net_view(conn, mac), await support.net_view(conn, mac2)
        assert (first.nic, second.nic) == ("eth0", "eth1"), (first, second)
        assert f"inet {deploy.address}/24 " in first.addresses, first
        assert f"inet {address2}/24 " in second.addresses, second
        defaults = (await out(conn, "ip -4 route show default")).splitlines()
        assert [r.split()[:5] for r in defaults] == [["default", "via", GATEWAY, "dev", "eth0"]]
        assert {f"nameserver {DNS}", f"nameserver {DNS2}"} <= set(first.resolv), first.resolv
        search = [line.split()[1:] for line in first.resolv if line.split()[:1] == ["search"]]
        assert search and {DOMAIN, DOMAIN2} <= set(search[0]), first.resolv
        state = await out(conn, "systemctl show -p Result,ActiveState networking.service")
        assert state.split() == ["Result=success", "ActiveState=active"], state
        fqdn = await out(conn, "hostname -f")
    assert fqdn == f"{name}.{DOMAIN}", fqdn
    interfaces = await lab.machines.agent(vm, "guest-network-get-interfaces")
    by_mac = {i.get("hardware-address"): i for i in interfaces}
    for nic_mac, address in ((mac, deploy.address), (mac2, address2)):
        assert address in [a["ip-address"] for a in by_mac[nic_mac.lower()]["ip-addresses"]]


async def test_an_impostor_on_the_address_is_refused_and_rolled_back(lab: Lab) -> None:
    """The guest booted and the agent read its keys, but ADDRESS:22 answered with the
    impostor's key: the deploy fails naming the address and both fingerprints, and its
    rollback leaves nothing behind."""
    assert lab.fake.jump is not None
    deploy, (_name, address) = lab.deploys[INTERCEPTED[0]], INTERCEPTED
    assert deploy.returncode == 1, deploy.output
    # The real agent reported the address before the SSH check went to the impostor.
    assert re.search(rf"✓ wait for address .*{re.escape(address)}", deploy.output), deploy.output
    assert (address, 22) in lab.fake.jump.requests and lab.impostor.connections > 0
    found = re.search(
        rf"{re.escape(address)} answered with host key (SHA256:\S+), which is not the new "
        r"VM's \(((?:SHA256:\S+, )+)confirmed through the QEMU guest agent\): possible "
        r"address conflict or interception",
        " ".join(deploy.output.split()),  # however the terminal wrapped it
    )
    assert found, deploy.output
    theirs = found.group(2).removesuffix(", ").split(", ")
    assert found.group(1) == lab.impostor.fingerprint
    assert theirs and lab.impostor.fingerprint not in theirs, theirs
    assert len(set(theirs)) == len(theirs), theirs  # one per key file the agent read
    assert_gone(lab.fake, lab.machines, deploy.vmid)


async def test_destroy_stops_and_removes_the_real_guest(lab: Lab) -> None:
    deploy = lab.deploys["web02"]
    assert deploy.vmid in lab.machines.machines  # running
    returncode, output = await run_deploybot(
        lab.fake, deploy.state / "deploybot.toml", deploy.state,
        "destroy", deploy.name, "--user", "alice",
    )  # fmt: skip
    assert returncode == 0, output
    assert_gone(lab.fake, lab.machines, deploy.vmid)
    assert lab.deploys["web01"].vmid in lab.machines.machines  # the other one runs on


async def test_the_agent_answers_and_shutdown_powers_the_guest_off(lab: Lab) -> None:
    """Through the API: the real agent's interfaces, then a shutdown (the guest agent's
    guest-shutdown, QEMU exits by itself) that leaves the VM and its disk."""
    fake, deploy = lab.fake, lab.deploys["web01"]
    base = f"{fake.url}/nodes/pve1/qemu/{deploy.vmid}"
    headers = {"Authorization": f"PVEAPIToken={fake.token_id}={fake.token_secret}"}
    context = ssl.create_default_context(cafile=str(fake.tls.ca_path))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=context), headers=headers
    ) as http:
        async with http.get(f"{base}/agent/network-get-interfaces") as answer:
            assert answer.status == 200, answer.reason
            interfaces = (await answer.json())["data"]["result"]
        mac = fake.cluster.vms[deploy.vmid].config["net0"].split(",")[0].split("=")[1]
        nic = next(i for i in interfaces if i["hardware-address"] == mac.lower())
        assert deploy.address in [a["ip-address"] for a in nic["ip-addresses"]]

        pid = lab.machines.pids[deploy.vmid]
        async with http.post(f"{base}/status/shutdown", data={"timeout": "300"}) as answer:
            assert answer.status == 200, answer.reason
            upid = (await answer.json())["data"]
        async with asyncio.timeout(DEADLINE_S):
            await fake.cluster.task(upid).done.wait()
        assert fake.cluster.task(upid).exitstatus == "OK", fake.cluster.task(upid).log
        async with http.get(f"{base}/status/current") as answer:
            assert (await answer.json())["data"]["status"] == "stopped"
    assert deploy.vmid not in lab.machines.machines
    assert process_ended(pid)
    assert lab.machines.disk(deploy.vmid).exists()  # a shutdown keeps the disk


async def _qemu_img_info(path: Path) -> str:
    process = await asyncio.create_subprocess_exec(
        "qemu-img", "info", "-U", str(path), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    return out.decode()
