"""Real guests that go wrong: `deploybot deploy` must say where and why, and roll back.

Two guests boot at once on the fake Proxmox with real guests (`tests/support/fakepve/realvm.py`,
its `faults` knob), each broken in one way a real template or seed can be:

* broken01: its cloud-init seed does not parse (a tab in the YAML of user-data and
  network-config, as a hand-written cicustom snippet might have). cloud-init ignores
  both, so the user, the key and the static address never arrive;
* noagent01: qemu-guest-agent is masked in the guest (`systemd.mask=` on its kernel
  command line), as on a template without the agent: nobody ever answers the agent
  channel, so deploybot cannot learn the guest's address.

Each deploy must fail with a message naming the step and the reason, and its rollback
must leave no VM, QEMU process or disk. The deploys' waits are shorter for these cases
(TIMEOUTS below) than the defaults.

Found on a real boot (broken01): cloud-init falls back to DHCP and the agent reports
that lease. deploybot used to accept it ("guest reports ..., not the requested ...")
and go on to the SSH check, which on a LAN where the lease is reachable passes (sshd
answers): "ready" on a guest without the user or key. `pick_address` now takes only
the expected address when there is one, so the deploy fails at "wait for address".

Skips, saying why, without QEMU or the image (a failure under
DEPLOYBOT_REQUIRE_REALGUEST=1). Nothing leaves loopback.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest
import pytest_asyncio
import yaml

from tests.support.fakepve import testing
from tests.support.fakepve.realvm import GuestFault, RealMachines
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import start_fake
from tests.support.realguest.lane import Deploy, assert_gone, deploy
from tests.support.realguest.support import require_image

pytestmark = [pytest.mark.realguest, pytest.mark.asyncio(loop_scope="module")]

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

BROKEN = ("broken01", "10.0.0.60")
NOAGENT = ("noagent01", "10.0.0.61")
# Long enough for a healthy guest's agent and sshd under TCG on 2 busy cores (the agent
# answers at ~25-60 s), short against the defaults (address 300 s, SSH 180 s). Under
# them the module takes ~3.5 min: the agentless guest waits the whole address window.
TIMEOUTS = {"address_s": 180.0, "ssh_s": 60.0}  # neither guest gets to the SSH check
DHCP_LEASE = "10.0.0.15"  # QEMU's first DHCP lease in the guest's network (x.x.x.15)


@dataclass
class Lab:
    fake: FakePVE
    machines: RealMachines
    deploys: dict[str, Deploy]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Lab]:
    disk = require_image()
    root = tmp_path_factory.mktemp("pvfault")
    workdir = Path(tempfile.mkdtemp(prefix="pvf-"))  # short: QEMU's unix sockets
    machines = RealMachines(disk, workdir)
    machines.faults[BROKEN[0]] = GuestFault(broken_cloud_init=True)
    machines.faults[NOAGENT[0]] = GuestFault(no_agent=True)
    public = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    try:
        fake_lab = start_fake(
            pve_schema, pve_tls, jump_dir=root / "jump", machines=lambda _cluster: machines
        )
        async with fake_lab as fake:
            done = await asyncio.gather(
                *(deploy(fake, root, public, *w, timeouts=TIMEOUTS) for w in (BROKEN, NOAGENT))
            )
            yield Lab(fake, machines, {d.name: d for d in done})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def test_broken_cloud_init_fails_the_deploy_and_rolls_back(lab: Lab) -> None:
    """What really happens: cloud-init warns "Failed loading yaml blob", ignores both
    files and falls back to DHCP on the first NIC (the hostname stays `debian`, no
    user, no key; sshd still starts with fresh host keys). The agent reports QEMU's
    DHCP lease, not the requested address: deploybot waits for that address and then
    fails at "wait for address" saying what the agent reports instead."""
    result = lab.deploys[BROKEN[0]]
    out = result.output
    assert result.returncode == 1, out
    seed = lab.machines.seeds[result.vmid]  # the guest really got an unparsable seed
    for text in (seed.user_data, seed.network_config):
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(text)
    failed = re.escape(
        f"failed at wait for address: timed out after {TIMEOUTS['address_s']:.0f} s "
        f"(last: VM {result.vmid}: the guest agent answers but reports no usable address "
        f"(expected {BROKEN[1]}) after "
    )
    assert re.search(rf"{failed}\d+ s; it reports [^)]*\b{re.escape(DHCP_LEASE)}\b", out), out
    assert "(is cloud-init applying ipconfig0?)" in out, out
    assert "check SSH" not in out, out  # never handed over at another address
    assert f"Rolled back: stop VM {result.vmid}; destroy VM {result.vmid}." in out, out
    assert_gone(lab.fake, lab.machines, result.vmid)


async def test_template_without_guest_agent_says_so_and_rolls_back(lab: Lab) -> None:
    """The guest boots (QEMU runs, its agent channel is there) but nothing in it answers
    the channel: every agent/ping is "QEMU guest agent is not running", and after the
    address window deploybot names the likely cause."""
    result = lab.deploys[NOAGENT[0]]
    out = result.output
    assert result.returncode == 1, out
    failed = re.escape(
        f"failed at wait for address: timed out after {TIMEOUTS['address_s']:.0f} s "
        f"(last: VM {result.vmid}: the guest agent has not answered in "
    )
    hint = re.escape("(does the template have qemu-guest-agent installed and enabled?)")
    assert re.search(rf"{failed}\d+ s {hint}", out), out
    assert "check SSH" not in out, out  # it never got that far
    assert f"Rolled back: stop VM {result.vmid}; destroy VM {result.vmid}." in out, out
    assert_gone(lab.fake, lab.machines, result.vmid)
