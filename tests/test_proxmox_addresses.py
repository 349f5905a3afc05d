"""ProxmoxBackend.addresses_in_use against the fake Proxmox API: static `ipconfigN`
addresses of every VM (stopped ones too), what running guests' agents report, a
silent agent that is no error, templates left out, what one sweep costs, how long
its answer is kept and when it is dropped, and failures that must not pass for a
shorter list. (The contract tests cover a VM built by hand and our own VM.)"""

from __future__ import annotations

import asyncio

import pytest

from backends.base import AddressUse, CloneSpec, PermanentError, Unreachable
from backends.proxmox import ProxmoxBackend
from backends.proxmox.addresses import agent_enabled, configured
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend
from tests.support.proxmox import CONFIG, backend, pve, pve_schema, pve_tls

__all__ = ["backend", "pve", "pve_schema", "pve_tls"]  # fixtures, used by name

AGENT = "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces"
LISTING = "/cluster/resources"


def hand_made(pve: FakePVE) -> None:
    """VMs built in the web UI, next to the standard cluster's running VM 100 (no
    cloud-init, no agent) and its templates."""
    cl = pve.cluster
    cl.add_vm(201, "static01", ipconfig0="ip=10.0.0.91/24,gw=10.0.0.1")  # stopped
    cl.add_vm(
        202,
        "dhcp01",
        running=True,
        ipconfig0="ip=dhcp",
        agent=True,
        agent_up=True,
        leases=("10.0.0.93/24",),
    )
    # Its agent is enabled but never answers (not installed, hung, still booting).
    cl.add_vm(203, "silent01", running=True, ipconfig0="ip=10.0.0.94/24,gw=10.0.0.1", agent=True)
    # An agent the config does not enable is not asked, whatever the guest runs.
    cl.add_vm(204, "noagent01", running=True, leases=("10.0.0.95/24",))
    cl.vms[9000].config["ipconfig0"] = "ip=10.0.0.96/24"  # a template: no VM in use


def seen(uses: list[AddressUse]) -> set[tuple[str, str, str, str]]:
    return {(str(u.address), u.vm_id, u.vm_name, u.source) for u in uses}


async def test_static_addresses_agent_addresses_and_a_silent_agent(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    hand_made(pve)
    uses = await backend.addresses_in_use()
    assert seen(uses) == {
        ("10.0.0.91", "201", "static01", "ipconfig0"),
        ("10.0.0.93", "202", "dhcp01", "guest agent"),  # docker0 and loopback left out
        ("10.0.0.94", "203", "silent01", "ipconfig0"),
    }
    # The cost: one listing, a config per VM (templates: none), an agent question per
    # running VM whose config enables it.
    assert len(pve.sent("GET", LISTING)) == 1
    assert sorted(r.path_params["vmid"] for r in pve.sent("GET", CONFIG)) == [
        "100",
        "201",
        "202",
        "203",
        "204",
    ]
    assert sorted(r.path_params["vmid"] for r in pve.sent("GET", AGENT)) == ["202", "203"]
    silent = [r.status for r in pve.sent("GET", AGENT) if r.path_params["vmid"] == "203"]
    assert silent == [500]  # "QEMU guest agent is not running": no error for us


async def test_an_agent_that_fails_otherwise_is_no_error(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    hand_made(pve)
    timeout = "VM 202 qmp command 'guest-network-get-interfaces' failed - got timeout"
    pve.inject("agent", "error", times=2, message=timeout)
    uses = await backend.addresses_in_use()
    assert ("10.0.0.91", "201", "static01", "ipconfig0") in seen(uses)
    assert "202" not in {u.vm_id for u in uses}


async def test_an_address_both_configured_and_reported_is_listed_once(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    pve.cluster.add_vm(
        205,
        "both01",
        running=True,
        ipconfig0="ip=10.0.0.97/24,gw=10.0.0.1",
        agent=True,
        agent_up=True,
        leases=("10.0.0.98/24",),  # a second address, set inside the guest
    )
    uses = [u for u in await backend.addresses_in_use() if u.vm_id == "205"]
    assert seen(uses) == {
        ("10.0.0.97", "205", "both01", "ipconfig0"),
        ("10.0.0.98", "205", "both01", "guest agent"),
    }


@pytest.mark.parametrize(
    ("endpoint", "status", "error"),
    [
        ("config_get", 503, Unreachable),  # one VM's config unreadable: no short list
        ("resources", 503, Unreachable),
        ("agent", 403, PermanentError),  # no right to ask agents: every guest unseen
    ],
)
async def test_a_failed_read_fails_the_sweep(
    pve: FakePVE,
    backend: ProxmoxBackend,
    endpoint: str,
    status: int,
    error: type[Exception],
) -> None:
    hand_made(pve)
    pve.inject(endpoint, "error", status=status, message="refused for the test")
    with pytest.raises(error):
        await backend.addresses_in_use()
    # Nothing wrong was kept: the next call sweeps again and answers.
    assert len(await backend.addresses_in_use()) == 3


async def test_one_sweep_serves_callers_for_addresses_cache_s(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    hand_made(pve)
    now = [100.0]
    backend.address_sweep.clock = lambda: now[0]
    together = await asyncio.gather(*(backend.addresses_in_use() for _ in range(5)))
    assert all(seen(u) == seen(together[0]) for u in together)
    now[0] += 29.9
    await backend.addresses_in_use()
    assert backend.address_sweep.sweeps == 1
    assert len(pve.sent("GET", LISTING)) == 1
    now[0] += 0.1  # addresses_cache_s (30 s) after the sweep began
    await backend.addresses_in_use()
    assert backend.address_sweep.sweeps == 2


async def test_our_clones_keep_the_answer_and_a_destroy_takes_its_vm_out(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    """50 deploys at once must not sweep the cluster 50 times: our own VMs' addresses
    are held by their jobs (the caller asks the store first). A VM we destroy is taken
    out of the kept answer at once, without a sweep."""
    hand_made(pve)
    backend.address_sweep.clock = lambda: 0.0  # the kept answer never expires by age
    await backend.addresses_in_use()
    spec = CloneSpec("jaddr02", "cloned01", "ubuntu-24.04")
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    pve.cluster.vms[int(ref.vm_id)].config["ipconfig0"] = "ip=10.0.0.99/24,gw=10.0.0.1"
    assert ref.vm_id not in {u.vm_id for u in await backend.addresses_in_use()}
    assert backend.address_sweep.sweeps == 1
    backend.address_sweep.clock = lambda: 100.0  # expired: the next call sweeps
    uses = await backend.addresses_in_use()
    assert ("10.0.0.99", ref.vm_id, "cloned01", "ipconfig0") in seen(uses)
    await backend.destroy(ref)
    assert ref.vm_id not in {u.vm_id for u in await backend.addresses_in_use()}
    assert backend.address_sweep.sweeps == 2
    assert len(await backend.addresses_in_use()) == len(uses) - 1


async def test_the_sweep_asks_at_most_addresses_parallel_at_once(pve: FakePVE) -> None:
    for vmid in range(300, 312):
        pve.cluster.add_vm(vmid, f"many{vmid}", ipconfig0=f"ip=10.0.1.{vmid - 290}/24")
    # Slow config reads (the fake waits, not the test), so that the reads overlap.
    pve.inject("config_get", "delay", times=100, delay_s=0.02)
    backend = make_backend(pve, addresses_parallel=3)
    try:
        await backend.inventory.vms()  # (the token needs no login: only sweep requests)
        pve.peak_in_flight = 0
        uses = await backend.addresses_in_use()
    finally:
        await backend.close()
    assert len(uses) == 12
    assert pve.peak_in_flight == 3


def test_ipconfig_and_agent_settings_as_proxmox_writes_them() -> None:
    config = {
        "ipconfig0": "ip=10.0.0.5/24,gw=10.0.0.1,ip6=auto",
        "ipconfig1": "ip6=dhcp,ip=dhcp",
        "ipconfig2": "gw=192.168.5.1,ip=192.168.5.7/24",
        "ipconfig3": "ip=169.254.0.2/16",  # link-local: nobody else's
        "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0",
    }
    found = [(str(ip), key) for ip, key in configured(config)]
    assert found == [("10.0.0.5", "ipconfig0"), ("192.168.5.7", "ipconfig2")]
    for enabled in ("1", "enabled=1", "1,fstrim_cloned_disks=1", "type=virtio,enabled=1"):
        assert agent_enabled({"agent": enabled}), enabled
    for disabled in ("0", "enabled=0", "0,type=isa"):
        assert not agent_enabled({"agent": disabled}), disabled
    assert not agent_enabled({})


async def test_our_own_installations_vms_cost_no_request(
    pve: FakePVE, backend: ProxmoxBackend
) -> None:
    """Their jobs hold their addresses in the store: only VMs built by hand, or by
    another installation, are read."""
    hand_made(pve)
    ours, theirs = "aaaaaaaaaa", "bbbbbbbbbb"
    pve.cluster.add_vm(301, "ours01", ipconfig0="ip=10.0.0.51/24")
    pve.cluster.add_vm(302, "theirs01", ipconfig0="ip=10.0.0.52/24")
    pve.cluster.vms[301].config["tags"] = f"deploybot-{ours}-jaaaaaaa1"
    pve.cluster.vms[302].config["tags"] = f"deploybot-{theirs}-jbbbbbbb1"
    uses = await backend.addresses_in_use(ours)
    addresses = {str(u.address) for u in uses}
    assert "10.0.0.52" in addresses and "10.0.0.51" not in addresses
    read = {r.path_params["vmid"] for r in pve.sent("GET", CONFIG)}
    assert "301" not in read and "302" in read


async def test_a_node_that_is_down_leaves_its_vms_out_not_the_sweep(
    pve: FakePVE, backend: ProxmoxBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """pveproxy answers 595 for a node it cannot reach and lists its VMs as unknown:
    one node down must not fail every deploy's conflict check."""
    hand_made(pve)
    pve.cluster.add_vm(401, "onpve2", node="pve2", ipconfig0="ip=10.0.0.71/24")
    pve.cluster.offline.add("pve2")
    uses = await backend.addresses_in_use()
    assert ("10.0.0.91", "201", "static01", "ipconfig0") in seen(uses)
    assert "401" not in {u.vm_id for u in uses}
    assert "VM(s) on node(s) pve2 not read: the node is offline" in caplog.text
    assert not [r for r in pve.sent("GET", CONFIG) if r.path_params["node"] == "pve2"]
