"""A subnet's segment on Proxmox (issue 29), against the fake API, which checks every
request against the real schema (`net[n]` property strings included) and answers
`GET /nodes/{node}/network` with `bridge_vlan_aware` as PVE does (vmbr0 VLAN-aware,
vmbr1 not): `net0` is written exactly, a tag on a bridge that cannot carry it is refused
before anything is cloned, `SDN.Use` is asked where PVE checks it, and a whole deploy
lands its NIC on the subnet's segment."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from backends.base import CloneSpec, PermanentError, Segment
from bot.app.runtime import running_deployer
from bot.models import Job, JobState
from bot.models.errors import RequestInvalid
from bot.operations.check import CheckResult, check_backend
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder
from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import make_backend, pve_settings, start_fake
from tests.support.proxmox import IDENTITY, free_port

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

CLONE = "/nodes/{node}/qemu/{vmid}/clone"
CONFIG = "/nodes/{node}/qemu/{vmid}/config"
VLAN20 = Segment("vmbr0", 20)


async def placed(fake: FakePVE, segment: Segment, **backend: Any) -> str:
    """Clone and give identity with the NIC on `segment`; the VM's net0 afterwards."""
    proxmox = make_backend(fake, **backend)
    try:
        spec = CloneSpec("jseg001", "web01", "ubuntu-24.04", segment=segment)
        ref = await proxmox.prepare_clone(spec)
        await proxmox.clone(spec, ref)
        await proxmox.apply_identity(ref, dataclasses.replace(IDENTITY, segment=segment))
    finally:
        await proxmox.close()
    return fake.cluster.vms[int(ref.vm_id)].config["net0"]


def mac_of(line: str) -> str:
    return line.split(",")[0].split("=")[1]


async def test_net0_is_written_exactly_with_the_templates_model_and_the_clones_mac(
    pve: FakePVE,
) -> None:
    pve.cluster.vms[9000].config["net0"] = "virtio=BC:24:11:00:00:AA,bridge=vmbr1,firewall=1"
    line = await placed(pve, VLAN20)
    mac = mac_of(line)
    assert mac != "BC:24:11:00:00:AA"  # the clone's own MAC, kept
    assert line == f"virtio={mac},bridge=vmbr0,tag=20,firewall=0"
    sent = [r.params.get("net0") for r in pve.sent("POST", CONFIG)]
    assert sent == [line]  # in the identity step's one config change, schema-checked


async def test_a_segment_without_a_vlan_removes_the_templates_tag_and_keeps_other_options(
    pve: FakePVE,
) -> None:
    """The template's tag would put the NIC on another VLAN than the subnet's."""
    pve.cluster.vms[9000].config["net0"] = "e1000=BC:24:11:00:00:AB,bridge=vmbr0,tag=30,rate=50"
    line = await placed(pve, Segment("vmbr1", None, firewall=True))
    assert line == f"e1000={mac_of(line)},bridge=vmbr1,firewall=1,rate=50"


async def test_a_tag_on_a_bridge_that_is_not_vlan_aware_is_refused_before_cloning(
    pve: FakePVE,
) -> None:
    before = set(pve.cluster.vms)
    with pytest.raises(PermanentError) as refused:
        await placed(pve, Segment("vmbr1", 20))
    message = refused.value.message
    assert "bridge vmbr1 on node pve1 of pve is not VLAN-aware" in message
    assert "VLAN 20" in message and "VLAN aware" in message  # what to do
    assert pve.sent("POST", CLONE) == [] and set(pve.cluster.vms) == before


@pytest.mark.parametrize(
    ("segment", "vids", "said"),
    [
        (Segment("vmbr9"), None, "bridge vmbr9 does not exist on node pve1 of pve (bridges "
         "there: vmbr0, vmbr1)"),
        (Segment("vmbr0", 20), "100-200", "bridge vmbr0 on node pve1 of pve carries VLANs "
         "100-200, not 20"),
    ],
)  # fmt: skip
async def test_a_missing_bridge_or_a_vlan_the_bridge_does_not_carry_is_refused(
    pve: FakePVE, segment: Segment, vids: str | None, said: str
) -> None:
    if vids is not None:
        pve.cluster.nodes["pve1"].vlan_aware["vmbr0"] = vids
    with pytest.raises(PermanentError, match=re.escape(said)):
        await placed(pve, segment)
    assert pve.sent("POST", CLONE) == []


async def test_a_bridge_made_vlan_aware_since_the_last_read_is_taken(pve: FakePVE) -> None:
    """The bridges are kept for `discovery_cache_s`; a refusal reads them afresh first."""
    proxmox = make_backend(pve, discovery_cache_s=600)
    try:
        with pytest.raises(PermanentError, match="not VLAN-aware"):
            await proxmox.bridges.check(Segment("vmbr1", 20), "pve1", "pve")
        pve.cluster.nodes["pve1"].vlan_aware["vmbr1"] = "2-4094"
        await proxmox.bridges.check(Segment("vmbr1", 20), "pve1", "pve")
        reads = len(pve.sent("GET", "/nodes/{node}/network"))
        await proxmox.bridges.check(Segment("vmbr1", 20), "pve1", "pve")  # kept
        assert len(pve.sent("GET", "/nodes/{node}/network")) == reads == 3
    finally:
        await proxmox.close()


async def test_sdn_use_is_asked_on_the_bridge_and_on_its_tag(pve: FakePVE) -> None:
    pve.acl.grant("/sdn/zones/localnetwork/vmbr0", set())  # no SDN.Use there, nor below
    proxmox = make_backend(pve)
    try:
        lacking = await proxmox.missing_privileges("ubuntu-24.04", [VLAN20, Segment("vmbr1")])
        assert [(m.privilege, m.where) for m in lacking] == [
            ("SDN.Use", "/sdn/zones/localnetwork/vmbr0/20")
        ]
        assert "vmbr0 VLAN 20" in lacking[0].step
        pve.acl.grant("/sdn/zones/localnetwork/vmbr0", {"SDN.Use"})  # propagates to tags
        assert await proxmox.missing_privileges("ubuntu-24.04", [VLAN20]) == []
    finally:
        await proxmox.close()


async def test_check_reports_each_subnets_segment(pve: FakePVE) -> None:
    proxmox = make_backend(pve)
    try:
        results = await check_backend(
            "pve",
            proxmox,
            "ubuntu-24.04",
            [
                ("10.0.20.0/24", VLAN20),
                ("10.0.30.0/24", Segment("vmbr1", 30)),
                ("10.0.40.0/24", None),
            ],
        )
    finally:
        await proxmox.close()
    found: dict[str, list[CheckResult]] = {}
    for result in results:
        found.setdefault(result.name, []).append(result)
    (ok,) = found["pve: subnet 10.0.20.0/24 on vmbr0 VLAN 20"]
    assert ok.ok and ok.detail == "exists, VLAN-aware"
    bad = found["pve: subnet 10.0.30.0/24 on vmbr1 VLAN 30"]  # one line per node
    assert [r.detail.split(" of pve")[0] for r in bad if not r.ok] == [
        "bridge vmbr1 on node pve1",
        "bridge vmbr1 on node pve2",
    ]
    (none,) = found["pve: subnet 10.0.40.0/24"]
    assert not none.ok and none.fix == "add [subnets.segments.pve] to the subnet 10.0.40.0/24"


SUBNETS = [
    {
        "cidr": "127.0.10.0/24",
        "gateway": "127.0.10.1",
        "dns": ["127.0.10.2"],
        "segments": {"pve": {"bridge": "vmbr0", "vlan": 20}},
    },
    {"cidr": "127.0.11.0/24", "gateway": "127.0.11.1"},  # no segment on pve
]


async def deploy(fake: FakePVE, tmp_path: Path, *texts: str) -> list[Job | RequestInvalid]:
    settings = pve_settings(tmp_path, fake, subnets=SUBNETS)
    backend = make_backend(fake)
    answers: list[Job | RequestInvalid] = []
    async with running_deployer(settings, Recorder(), backends={"pve": backend}) as deployer:
        for text in texts:
            args = parse(text)
            assert isinstance(args, DeployArgs)
            try:
                job = await deployer.request_deploy(args, "alice")
            except RequestInvalid as exc:
                answers.append(exc)
                continue
            await deployer.drain()
            answers.append((await deployer.status(job.id)).job)
    return answers


async def test_a_deploy_lands_on_its_subnets_segment_and_one_without_is_refused(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        done, refused = await deploy(fake, tmp_path, "web01 127.0.10.50", "web02 127.0.11.50")
        assert isinstance(done, Job) and done.state is JobState.SUCCEEDED, done
        line = fake.cluster.vms[int(str(done.vm_id))].config["net0"]
        assert line == f"virtio={mac_of(line)},bridge=vmbr0,tag=20,firewall=0"
        assert isinstance(refused, RequestInvalid)
        assert refused.message.startswith(
            "127.0.11.0/24 has no segment on pve: ask an operator to add "
            "[subnets.segments.pve] to the subnet 127.0.11.0/24"
        )
        assert len(fake.sent("POST", CLONE)) == 1  # the refused one built nothing


async def test_a_tag_the_node_cannot_carry_fails_the_clone_step_with_nothing_built(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    async with start_fake(pve_schema, pve_tls, ssh_port=free_port()) as fake:
        fake.cluster.nodes["pve1"].vlan_aware.clear()
        before = set(fake.cluster.vms)
        (failed,) = await deploy(fake, tmp_path, "web01 127.0.10.50")
        assert isinstance(failed, Job) and failed.state is JobState.FAILED
        assert failed.failed_step == "clone" and failed.vm_id is None
        assert "bridge vmbr0 on node pve1 of pve is not VLAN-aware" in str(failed.error)
        assert fake.sent("POST", CLONE) == [] and set(fake.cluster.vms) == before
