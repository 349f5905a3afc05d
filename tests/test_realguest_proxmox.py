"""`deploybot deploy` against the fake Proxmox running real guests, end to end.

The fake's VMs are QEMU guests here (`tests/fakepve/realvm.py`): a template's disk is
the guest image, a clone is a qcow2 overlay of it, start renders Proxmox's NoCloud seed
from the cloud-init fields deploybot set and boots QEMU, the guest agent endpoints are
answered by the real qemu-guest-agent and the fake's jump host leads ADDRESS:22 to the
guest's SSH forward on 127.0.0.1. The real CLI (a separate process, unchanged) deploys
three guests at once from one template: two must end with an SSH line that works (the
deploy's key logs in through the jump host, the guest is what was asked, its host key
is the one printed) and are distinct instances; the third is refused by the jump host
after its guest booted, and its rollback must leave no VM, QEMU process or disk behind.
Afterwards `deploybot destroy` removes one of the two the same way, and a shutdown
through the API powers the other off by its guest agent.

Skips, saying why, without QEMU or the image; under DEPLOYBOT_REQUIRE_REALGUEST=1 (CI)
that is a failure. Nothing leaves loopback: 10.0.0.x exist only inside QEMU's
restricted user-mode networks and are reached only through the jump host.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncssh
import pytest
import pytest_asyncio

from tests.fakepve import testing
from tests.fakepve.realvm import RealMachines
from tests.fakepve.schema import ApiSchema
from tests.fakepve.server import FakePVE, Tls
from tests.fakepve.testing import config_text, run_deploybot, start_fake
from tests.realguest import image, qemu

pytestmark = [pytest.mark.realguest, pytest.mark.asyncio(loop_scope="module")]

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

TEMPLATE, LOGIN = "debian-12", "deploy"
GOOD = {"web01": "10.0.0.50", "web02": "10.0.0.51"}
DOOMED = ("web03", "10.0.0.52")  # the jump host will not forward to it: SSH check fails
DEADLINE_S = 480.0  # per step that waits for a guest (TCG on 2 busy cores)


def _unavailable(reason: str) -> None:
    if os.environ.get("DEPLOYBOT_REQUIRE_REALGUEST") == "1":
        pytest.fail(f"{reason}; DEPLOYBOT_REQUIRE_REALGUEST=1 forbids skipping this test")
    pytest.skip(reason)


@dataclass
class Deploy:
    name: str
    address: str
    returncode: int
    output: str
    seconds: float
    state: Path  # its config, database and log

    @property
    def vmid(self) -> int:
        found = re.search(r"VM (\d+) on pve1", self.output)
        assert found, self.output
        return int(found.group(1))

    @property
    def host_key(self) -> str:
        found = re.search(r"host key (SHA256:[A-Za-z0-9+/=]+)", self.output)
        assert found, self.output
        return found.group(1)


@dataclass
class Lab:
    fake: FakePVE
    machines: RealMachines
    key: asyncssh.SSHKey
    deploys: dict[str, Deploy]


def _config(fake: FakePVE, state: Path, public_key: str) -> Path:
    """The config the fake writes for its demo, with the test's key and roomy timeouts."""
    text = config_text(fake, state, None)
    text = re.sub(r"(?m)^ssh_keys = .*$", f'ssh_keys = ["{public_key}"]', text)
    text += f"\n[timeouts]\npower_on_s = {DEADLINE_S}\naddress_s = {DEADLINE_S}\n"
    text += f"ssh_s = {DEADLINE_S}\n"
    path = state / "deploybot.toml"
    path.write_text(text, encoding="utf-8")
    return path


async def _deploy(fake: FakePVE, root: Path, public: str, name: str, address: str) -> Deploy:
    state = root / name
    state.mkdir()
    began = time.monotonic()
    returncode, output = await run_deploybot(
        fake, _config(fake, state, public), state,
        "deploy", name, address, f"template={TEMPLATE}", f"user={LOGIN}",
        "--backend", "pve", "--user", "alice",
    )  # fmt: skip
    return Deploy(name, address, returncode, output, time.monotonic() - began, state)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Lab]:
    if missing := qemu.missing_tools():
        _unavailable(f"missing {', '.join(missing)} (apt-get install qemu-system-x86 ...)")
    disk = image.built()
    if disk is None:
        _unavailable(f"no guest image in {image.image_dir()}: run `make guest-image`")
    assert disk is not None
    root = tmp_path_factory.mktemp("pvguest")
    workdir = Path(tempfile.mkdtemp(prefix="pvg-"))  # short: QEMU's unix sockets
    machines = RealMachines(disk, workdir)
    key = asyncssh.generate_private_key("ssh-ed25519")
    public = key.export_public_key().decode().strip()
    try:
        fake_lab = start_fake(
            pve_schema, pve_tls, jump_dir=root / "jump", machines=lambda _cluster: machines
        )
        async with fake_lab as fake:
            assert fake.jump is not None
            fake.jump.prohibited.add(DOOMED[1])
            wanted = [*GOOD.items(), DOOMED]
            done = await asyncio.gather(*(_deploy(fake, root, public, *w) for w in wanted))
            yield Lab(fake, machines, key, {d.name: d for d in done})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _login(lab: Lab, address: str) -> tuple[asyncssh.SSHClientConnection, ...]:
    """Through the jump host (as `ssh -J` would) to ADDRESS:22 with the deploy's key.
    The deploy ends once sshd shows its host key; the key to log in with is there
    before sshd starts (cloud-init's init stage), so this polls only against a
    transient refusal, within the deadline."""
    assert lab.fake.jump is not None
    jump = lab.fake.jump
    deadline = time.monotonic() + DEADLINE_S
    while True:
        bastion = await asyncssh.connect(
            jump.host,
            jump.port,
            username=jump.user,
            client_keys=[str(jump.key_file)],
            known_hosts=str(jump.known_hosts),
        )
        try:
            guest = await asyncssh.connect(
                address,
                22,
                tunnel=bastion,
                username=LOGIN,
                client_keys=[lab.key],
                known_hosts=None,  # compared with the printed fingerprint by the caller
                connect_timeout=30,
            )
            return bastion, guest
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            bastion.close()
            if time.monotonic() > deadline:
                raise AssertionError(f"no SSH login to {address}: {exc!r}") from exc
        await asyncio.sleep(2.0)  # between polls of a condition bound by `deadline`


async def _out(conn: asyncssh.SSHClientConnection, command: str) -> str:
    result = await conn.run(command, check=True, timeout=DEADLINE_S)
    return str(result.stdout).strip()


@dataclass(frozen=True)
class Seen:
    instance_id: str
    host_key: str


async def _check_guest(lab: Lab, deploy: Deploy) -> Seen:
    """The SSH line works and the guest is what the deploy asked for."""
    assert deploy.returncode == 0, deploy.output
    assert f"ssh {LOGIN}@{deploy.address}" in deploy.output
    bastion, conn = await _login(lab, deploy.address)
    async with bastion, conn:
        server_key = conn.get_server_host_key()
        assert server_key is not None
        seen = server_key.get_fingerprint("sha256")
        assert seen == deploy.host_key, (seen, deploy.output)
        own = await _out(conn, "cat /etc/ssh/ssh_host_*_key.pub")
        keys = [asyncssh.import_public_key(line) for line in own.splitlines()]
        guest_keys = {k.get_fingerprint("sha256") for k in keys}
        assert deploy.host_key in guest_keys  # the guest's own key, not the jump host's
        assert await _out(conn, "hostname") == deploy.name
        assert await _out(conn, "id -un") == LOGIN
        assert f"inet {deploy.address}/24" in await _out(conn, "ip -o -4 addr show")
        status = await _out(conn, "cloud-init status --wait")
        assert "status: done" in status, status
        instance_id = await _out(conn, "cat /var/lib/cloud/data/instance-id")
    assert instance_id == lab.machines.seeds[deploy.vmid].instance_id
    return Seen(instance_id, deploy.host_key)


async def test_deploy_ends_on_a_real_guest_as_printed(
    lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy = lab.deploys["web01"]
    await _check_guest(lab, deploy)
    with capsys.disabled():
        times = ", ".join(f"{d.name} {d.seconds:.0f} s" for d in lab.deploys.values())
        print(f"\nreal-guest deploys (together, {lab.machines.accel}): {times}")


async def test_second_deploy_from_the_template_is_another_instance(lab: Lab) -> None:
    first = await _check_guest(lab, lab.deploys["web01"])
    second = await _check_guest(lab, lab.deploys["web02"])
    assert first.instance_id != second.instance_id
    assert first.host_key != second.host_key
    # Both are linked clones: overlays whose backing file is the template's disk.
    for name in GOOD:
        info = await _qemu_img_info(lab.machines.disk(lab.deploys[name].vmid))
        assert f"backing file: {lab.machines.image / 'disk.qcow2'}" in info


async def test_failure_after_the_boot_rolls_the_guest_back(lab: Lab) -> None:
    deploy = lab.deploys[DOOMED[0]]
    assert deploy.returncode == 1, deploy.output
    assert "will not connect" in deploy.output, deploy.output
    # The real agent reported the address before the SSH check failed.
    assert re.search(rf"✓ wait for address .*{re.escape(DOOMED[1])}", deploy.output), deploy.output
    _assert_gone(lab, deploy.vmid)


async def test_destroy_stops_and_removes_the_real_guest(lab: Lab) -> None:
    deploy = lab.deploys["web02"]
    assert deploy.vmid in lab.machines.machines  # running
    returncode, output = await run_deploybot(
        lab.fake, deploy.state / "deploybot.toml", deploy.state,
        "destroy", deploy.name, "--user", "alice",
    )  # fmt: skip
    assert returncode == 0, output
    _assert_gone(lab, deploy.vmid)
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
    assert _process_ended(pid)
    assert lab.machines.disk(deploy.vmid).exists()  # a shutdown keeps the disk


def _assert_gone(lab: Lab, vmid: int) -> None:
    """No VM, no QEMU process, no disk or seed left."""
    assert vmid not in lab.fake.cluster.vms
    assert vmid not in lab.machines.machines
    assert _process_ended(lab.machines.pids[vmid])  # it did boot
    assert not lab.machines.folder(vmid).exists()


def _process_ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (QEMU daemonized: init's child)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ")[1].startswith(("Z", "X"))


async def _qemu_img_info(path: Path) -> str:
    process = await asyncio.create_subprocess_exec(
        "qemu-img", "info", "-U", str(path), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    return out.decode()
