"""The simulator's networks (issue 29): bridges (VLAN-aware or not), standard and
distributed portgroups and uplinks per placement. A NIC it cannot plug in is refused
before anything exists, and a deploy into a second subnet lands on that subnet's
segment, as the demo shows."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

from backends.base import CloneSpec, PermanentError, Segment
from backends.sim import SimBackend
from backends.sim.vm import SimNetwork
from bot.app.runtime import running_deployer
from bot.models import JobState
from bot.models.errors import RequestInvalid
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from handlers.demo import run_demo
from tests.support.contract import IDENTITY
from tests.support.deployer import Recorder, make_settings
from tests.support.slack.bot import block, open_form, slack_bot

NETWORKS = (
    SimNetwork(name="vmbr0"),
    SimNetwork(name="vmbr1", vlan_aware=True, placements=("node1",)),
    SimNetwork(name="VM Network", kind="portgroup"),
    SimNetwork(name="dvpg-20", kind="distributed"),
    SimNetwork(name="DVS-uplinks", kind="uplink"),
)


@pytest.mark.parametrize(
    ("segment", "placement", "said"),
    [
        (Segment("vmbr0", 20), "node1", "bridge vmbr0 on node1 of sim is not VLAN-aware"),
        (Segment("vmbr1", 20), "node2", "network vmbr1 does not exist on node2 of sim (there: "
         "vmbr0, VM Network, dvpg-20)"),
        (Segment("vmbr9"), "node1", "network vmbr9 does not exist on node1"),
        (Segment("DVS-uplinks"), "node1", "DVS-uplinks on sim is an uplink portgroup"),
        (Segment("dvpg-20", 20), "node1", "portgroup dvpg-20 on node1 of sim is not VLAN-aware"),
    ],
)  # fmt: skip
async def test_a_nic_the_placement_cannot_take_is_refused_before_anything_exists(
    segment: Segment, placement: str, said: str
) -> None:
    sim = SimBackend("sim", time_scale=0.001, networks=NETWORKS)
    with pytest.raises(PermanentError) as refused:
        await sim.prepare_clone(
            CloneSpec("jsim01", "web01", "ubuntu-24.04", placement, segment=segment)
        )
    assert said in refused.value.message
    assert sim.vms == {}
    assert said in " ".join(await sim.segment_problems(segment))


async def test_what_it_can_take_is_offered_and_taken() -> None:
    sim = SimBackend("sim", time_scale=0.001, networks=NETWORKS)
    offered = {n.name: n.distributed for n in await sim.networks("node2")}
    assert offered == {"vmbr0": False, "VM Network": False, "dvpg-20": True}
    for segment in (Segment("vmbr1", 20), Segment("dvpg-20"), Segment("vmbr0")):
        spec = CloneSpec("jsim02", "web02", "ubuntu-24.04", "node1", segment=segment)
        await sim.prepare_clone(spec)
    assert await sim.segment_problems(Segment("vmbr0")) == []


async def test_a_deploy_lands_on_its_subnets_segment(tmp_path: Path) -> None:
    subnets = [
        {"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "segments": {"sim": {"bridge": "vmbr0"}}},
        {
            "name": "lab20",
            "cidr": "10.0.20.0/24",
            "gateway": "10.0.20.1",
            "segments": {"sim": {"bridge": "vmbr1", "vlan": 20}},
        },
    ]
    settings = make_settings(tmp_path, subnets=subnets)
    sim = SimBackend("sim", time_scale=0.001)
    recorder = Recorder()
    async with running_deployer(settings, recorder, backends={"sim": sim}) as deployer:
        for text in ("web01 10.0.0.50", "web02 subnet=lab20"):
            args = parse(text)
            assert isinstance(args, DeployArgs)
            await deployer.request_deploy(args, "alice")
        await deployer.drain()
        jobs = {j.name: j for j in await deployer.history()}
    assert {j.state for j in jobs.values()} == {JobState.SUCCEEDED}
    placed = {vm.name: vm.identity.segment for vm in sim.vms.values() if vm.identity}
    assert placed == {"web01": Segment("vmbr0"), "web02": Segment("vmbr1", 20)}
    assert str(jobs["web02"].final_address).startswith("10.0.20.")


async def test_the_demo_shows_a_second_subnet_on_another_segment() -> None:
    out = io.StringIO()
    assert await run_demo(time_scale=0.001, out=out) == 0
    text = out.getvalue()
    assert "NIC on vmbr0" in text and "NIC on vmbr1 VLAN 20" in text


TWO_SEGMENTS = [
    {"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "segments": {"sim": {"bridge": "vmbr0"}}},
    {
        "cidr": "10.0.20.0/24",
        "gateway": "10.0.20.1",
        "segments": {"sim": {"bridge": "vmbr1", "vlan": 20}},
    },
]


async def test_the_form_lists_each_subnet_with_its_segment_and_offers_no_network(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path, subnets=TWO_SEGMENTS) as h:
        view = h.fake.views[await open_form(h)]
        hint = block(view, "address")["hint"]["text"]
        assert hint.startswith("Inside 10.0.0.0/24, vmbr0; 10.0.20.0/24, vmbr1 VLAN 20, e.g.")
        assert not [b for b in view["blocks"] if b.get("block_id", "").startswith("network")]


async def test_a_segment_on_a_network_the_backend_lacks_is_refused_at_request_time(
    tmp_path: Path,
) -> None:
    subnets = [{**TWO_SEGMENTS[0], "segments": {"sim": {"bridge": "vmbr7"}}}]
    settings = make_settings(tmp_path, subnets=subnets)
    sim = SimBackend("sim", time_scale=0.001)
    async with running_deployer(settings, Recorder(), backends={"sim": sim}) as deployer:
        args = parse("web01 10.0.0.50")
        assert isinstance(args, DeployArgs)
        with pytest.raises(RequestInvalid) as refused:
            await deployer.request_deploy(args, "alice")
        assert await deployer.history() == []
    assert refused.value.message == (
        "10.0.0.0/24 is on vmbr7 on sim, but vmbr7 is not a network there: ask an operator "
        "to correct [subnets.segments.sim] (networks there: vmbr0, vmbr1)."
    )


async def test_the_segment_a_vm_was_given_outlives_the_process(tmp_path: Path) -> None:
    """With a state file, what the hypervisor keeps of the identity keeps its segment."""
    state = tmp_path / "sim.json"
    first = SimBackend("sim", time_scale=0.001, state_file=state)
    identity = dataclasses.replace(IDENTITY, segment=Segment("vmbr1", 20))
    spec = CloneSpec("jsim03", "web03", "ubuntu-24.04", "node1", segment=identity.segment)
    ref = await first.prepare_clone(spec)
    await first.clone(spec, ref)
    await first.apply_identity(ref, identity)
    await first.close()
    again = SimBackend("sim", time_scale=0.001, state_file=state)
    try:
        kept = again.vms[ref.vm_id].identity
        assert kept is not None and kept.segment == Segment("vmbr1", 20)
    finally:
        await again.close()
