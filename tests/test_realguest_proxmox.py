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
instance-id, the printed host key its own), and are distinct instances; the third is
refused by the jump host after its guest booted, and its rollback must leave no VM,
QEMU process or disk behind.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncssh
import pytest
import pytest_asyncio

from tests.support.fakepve import testing
from tests.support.fakepve.realvm import RealMachines
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import run_deploybot, start_fake
from tests.support.realguest.guestchecks import Seen, check_guest
from tests.support.realguest.lane import DEADLINE_S, Deploy, assert_gone, deploy, process_ended
from tests.support.realguest.support import require_image

pytestmark = [pytest.mark.realguest, pytest.mark.asyncio(loop_scope="module")]

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

GOOD = {"web01": "10.0.0.50", "web02": "10.0.0.51"}
DOOMED = ("web03", "10.0.0.52")  # the jump host will not forward to it: SSH check fails
# web01 asks for no upgrade in so many words; web02 gets the default (no upgrade either).
OPTIONS = {"web01": ("upgrade=no",)}


@dataclass
class Lab:
    fake: FakePVE
    machines: RealMachines
    key: asyncssh.SSHKey
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
            done = await asyncio.gather(
                *(deploy(fake, root, public, n, a, *OPTIONS.get(n, ())) for n, a in wanted)
            )
            yield Lab(fake, machines, key, {d.name: d for d in done})
    finally:
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


async def test_failure_after_the_boot_rolls_the_guest_back(lab: Lab) -> None:
    deploy = lab.deploys[DOOMED[0]]
    assert deploy.returncode == 1, deploy.output
    assert "will not connect" in deploy.output, deploy.output
    # The real agent reported the address before the SSH check failed.
    assert re.search(rf"✓ wait for address .*{re.escape(DOOMED[1])}", deploy.output), deploy.output
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
