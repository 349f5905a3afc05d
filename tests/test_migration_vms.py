"""The VMs' half of a migration plan (issue 30), on plain facts: each VM's category and
notes, vSphere's two provisioning flags as three states (the fourth reported as
impossible), the target format per storage type, and a NIC's portgroup through the
subnets to the target's bridge and VLAN. The vcsim inventory (tests/test_migration_plan.py)
reads the same facts from a simulator."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pyVmomi import vim

from backends.migrating import (
    Allocation,
    DiskFacts,
    NicFacts,
    Provisioning,
    Scope,
    TemplateFacts,
    VMFacts,
    provisioning,
)
from backends.vsphere import vmfacts
from bot.addresses.subnets import Subnet
from bot.images.profiles import catalogue
from bot.migration.apply import check_findings, rebuilds_of
from bot.migration.classify import Category, NoteKind
from bot.migration.plan import PlanFileError, classify, read_plan, seal_of, write_plan
from bot.migration.vms import classify_vm, network_map, proxmox_tag
from handlers.messages.migration import note_text, plan_lines, reason

NOW = datetime(2026, 12, 5, tzinfo=UTC)
SUBNETS = (
    Subnet.model_validate(
        {
            "cidr": "10.0.20.0/24",
            "gateway": "10.0.20.1",
            "segments": {"vc": {"network": "dvpg-20"}, "pve": {"bridge": "vmbr0", "vlan": 20}},
        }
    ),
    Subnet.model_validate(
        {
            "cidr": "10.0.30.0/24",
            "gateway": "10.0.30.1",
            "segments": {"vc": {"network": "dvpg-30"}, "pve": {"bridge": "vmbr1"}},
        }
    ),
    Subnet.model_validate(
        {
            "cidr": "10.0.31.0/24",
            "gateway": "10.0.31.1",
            "segments": {"vc": {"network": "dvpg-30"}, "pve": {"bridge": "vmbr2"}},
        }
    ),
    Subnet.model_validate(
        {"cidr": "10.0.40.0/24", "gateway": "10.0.40.1", "segments": {"vc": {"network": "old"}}}
    ),
)
NETWORKS = network_map(SUBNETS, "vc", "pve")


def nic(model: str = "e1000", network: str = "dvpg-20", manual: bool = False) -> NicFacts:
    return NicFacts("Network adapter 1", model, "00:50:56:aa:bb:cc", manual, network, True)


def disk(
    thin: bool | None = True, eager: bool | None = False, controller: str = "pvscsi"
) -> DiskFacts:
    return DiskFacts("Hard disk 1", controller, 20 * 1024 * 1024, "flat", thin, eager)


def vm(name: str = "web01", **changes: object) -> VMFacts:
    plain = VMFacts(
        source_id=f"uuid-{name}",
        name=name,
        guest_id="debian12_64Guest",
        folder="",
        hardware_version="vmx-19",
        snapshots=(),
        change_tracking=False,
        custom_attributes=(),
        drs_rules=(),
        cpu=Allocation(),
        memory=Allocation(),
        tools_status="guestToolsRunning",
        tools_version="12352",
        nics=(nic(),),
        disks=(disk(),),
    )
    return replace(plain, **changes)  # type: ignore[arg-type]


def kinds(facts: VMFacts, storage_type: str | None = None) -> dict[NoteKind, tuple[str, ...]]:
    finding = classify_vm(facts, NETWORKS, storage_type)
    return {n.kind: (n.value, *n.detail) for n in finding.notes}


def test_provisioning_is_three_states_and_the_fourth_combination_is_impossible() -> None:
    assert provisioning(True, False) is Provisioning.THIN
    assert provisioning(False, False) is Provisioning.THICK_LAZY
    assert provisioning(False, True) is Provisioning.THICK_EAGER
    assert provisioning(None, None) is Provisioning.THICK_LAZY  # vSphere's defaults: false
    assert provisioning(True, True) is None
    assert len(Provisioning) == 3
    finding = classify_vm(vm(disks=(disk(True, True),)), NETWORKS)
    assert finding.category is Category.BLOCKED
    (impossible,) = [n for n in finding.notes if n.kind is NoteKind.DISK_IMPOSSIBLE]
    assert "thin and eagerly scrubbed at once" in note_text(impossible)
    assert reason(finding) == "blocked: impossible disk provisioning"


def test_a_plain_vm_moves_as_is_and_still_says_what_does_not_travel() -> None:
    finding = classify_vm(vm(), NETWORKS)
    assert finding.category is Category.MOVES_AS_IS
    notes = kinds(vm())
    assert notes[NoteKind.NETWORK] == (
        "Network adapter 1",
        "dvpg-20",
        "distributed portgroup",
        "10.0.20.0/24",
        "vmbr0 VLAN 20",
    )
    assert notes[NoteKind.HARDWARE_VERSION] == ("vmx-19",)
    assert notes[NoteKind.TOOLS] == ("running", "12352")
    assert notes[NoteKind.NIC_MODEL] == ("Network adapter 1", "e1000", "e1000")
    assert notes[NoteKind.CONTROLLER] == ("Hard disk 1", "pvscsi", "scsihw=pvscsi")
    assert NoteKind.MAC_GENERATED in notes


@pytest.mark.parametrize(
    ("changes", "kind"),
    [
        ({"snapshots": ("a", "b", "c")}, NoteKind.SNAPSHOTS),
        ({"change_tracking": True}, NoteKind.CHANGE_TRACKING),
        ({"custom_attributes": (("owner", "x"),)}, NoteKind.CUSTOM_ATTRIBUTES),
        ({"tags": ("Backup/daily",)}, NoteKind.TAGS),
        ({"drs_rules": (("apart", "anti-affinity"),)}, NoteKind.DRS_RULES),
        ({"memory": Allocation(reservation=1024)}, NoteKind.ALLOCATION),
        ({"cpu": Allocation(shares="low")}, NoteKind.ALLOCATION),
        ({"cpu": Allocation(limit=2000)}, NoteKind.ALLOCATION),
        ({"nics": (nic("vmxnet3"),)}, NoteKind.NIC_MODEL_CHANGE),
        ({"nics": (nic(manual=True),)}, NoteKind.MAC_MANUAL),
        ({"disks": (disk(controller="lsilogic-sas"),)}, NoteKind.CONTROLLER_CHANGE),
    ],
)
def test_what_needs_a_decision(changes: dict[str, Any], kind: NoteKind) -> None:
    finding = classify_vm(vm(**changes), NETWORKS)
    assert finding.category is Category.NEEDS_DECISIONS
    assert finding.notes[0].kind is kind  # the heaviest first


def test_what_blocks_a_vm() -> None:
    for facts, kind in [
        (vm(source_id=""), NoteKind.UNREADABLE),
        (vm(nics=(nic(network="nowhere"),)), NoteKind.NO_SEGMENT),
        (vm(nics=(nic(network="old"),)), NoteKind.NO_SEGMENT),
        (vm(nics=(nic(network="dvpg-30"),)), NoteKind.NO_SEGMENT),
        (vm(disks=(replace(disk(None, None), backing="rdm"),)), NoteKind.DISK_RAW_DEVICE),
    ]:
        finding = classify_vm(facts, NETWORKS)
        assert finding.category is Category.BLOCKED, facts
        assert finding.notes[0].kind is kind
    # Each reason for no target network is worded with what to add.
    texts = [
        note_text(n, "vc", "pve")
        for network in ("nowhere", "old", "dvpg-30")
        for n in classify_vm(vm(nics=(nic(network=network),)), NETWORKS).notes
        if n.kind is NoteKind.NO_SEGMENT
    ]
    assert "no subnet has it as its segment on vc" in texts[0]
    assert '[subnets.segments.vc] network = "nowhere"' in texts[0]
    assert "subnet 10.0.40.0/24 has no segment on pve" in texts[1]
    assert "different segments of pve (vmbr1 / vmbr2)" in texts[2]


@pytest.mark.parametrize(
    ("storage_type", "thin", "form", "said"),
    [
        ("nfs", True, "qcow2", "stays thin"),
        ("dir", False, "qcow2", "thin there"),
        ("lvmthin", True, "raw", "stays thin"),
        ("zfspool", False, "raw", "thin there"),
        ("lvm", True, "raw", "allocated whole"),
        (None, True, "qcow2 or raw", "target format not known"),
    ],
)
def test_the_target_format_follows_the_storage(
    storage_type: str | None, thin: bool, form: str, said: str
) -> None:
    finding = classify_vm(vm(disks=(disk(thin, False),)), NETWORKS, storage_type)
    (note,) = [n for n in finding.notes if n.kind is NoteKind.DISK]
    assert note.detail[2] == form
    assert said in note_text(note)
    assert finding.category is Category.MOVES_AS_IS


def test_vms_in_the_plan_its_counts_digest_and_file(tmp_path: Path) -> None:
    vms = [vm("a"), vm("b", snapshots=("s",)), vm("c", nics=(nic(network="x"),))]
    plan = classify("vc", "pve", Scope(), [], {}, [], NOW, vms, SUBNETS, "lvmthin")
    assert plan.counts()["vm"] == {"moves-as-is": 1, "needs-decisions": 1, "blocked": 1}
    lines = plan_lines(plan, None)
    assert "VMs: 3 in scope: 1 moves as is, 1 decisions, 1 blocked." in lines
    assert "  No template in scope." in lines
    later = classify("vc", "pve", Scope(), [], {}, [], NOW, list(reversed(vms)), (), None)
    assert later.digest == plan.digest  # the order, subnets and storage are not facts
    changed = classify("vc", "pve", Scope(), [], {}, [], NOW, [vm("a", folder="x"), *vms[1:]])
    assert changed.digest != plan.digest
    # A guest that rebooted (Tools not running for a moment) leaves the plan valid.
    rebooting = [vm("a", tools_status="guestToolsNotRunning"), *vms[1:]]
    assert classify("vc", "pve", Scope(), [], {}, [], NOW, rebooting).digest == plan.digest
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    assert read_plan(path) == plan


def test_findings_edited_in_any_kind_are_refused(tmp_path: Path) -> None:
    """Every fact is classified again at apply and must have exactly one finding that
    says the same, whatever its kind; a finding without a fact is refused; only a
    template's finding rebuilds; reading refuses a kind or category that does not exist."""
    debian = TemplateFacts("vm-1", "deb", "debian10_64Guest", "Debian 12", (), (), (), "vmx-13")
    vms = [vm("a"), vm("c", nics=(nic(network="x"),))]
    plan = classify("vc", "pve", Scope(), [debian], catalogue(), [], NOW, vms, SUBNETS)
    check_findings(plan, catalogue(), SUBNETS)  # as made, it follows
    deb, a, c = plan.findings
    assert c.category is Category.BLOCKED and deb.kind == "template"
    ghost = replace(a, source_id="uuid-ghost", name="ghost")
    for findings in [
        (deb, a, replace(c, category=Category.MOVES_AS_IS)),  # a blocked VM let through
        (deb, c),  # a VM's finding left out
        (deb, a, c, c),  # one twice
        (deb, a, c, ghost),  # a finding without a fact
        (replace(deb, kind="vm", category=Category.MOVES_AS_IS, profile=None), a, c),
        (deb, replace(a, profile="ubuntu-24.04"), c),
    ]:
        with pytest.raises(PlanFileError, match="does not follow from its facts"):
            check_findings(replace(plan, findings=findings), catalogue(), SUBNETS)
    wanted = [r.profile for r in rebuilds_of(plan)]
    vm_rebuilding = replace(a, category=Category.REBUILDABLE, profile="ubuntu-24.04")
    assert [r.profile for r in rebuilds_of(replace(plan, findings=(deb, vm_rebuilding)))] == (
        wanted
    )
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    document = json.loads(path.read_text())
    for kind, category in [("disk", "rebuildable"), ("vm", "rebuildable"), ("template", "blocked")]:
        edited = json.loads(json.dumps(document))
        edited["findings"][0].update(kind=kind, category=category)
        edited["seal"] = seal_of(edited)
        path.write_text(json.dumps(edited))
        with pytest.raises(PlanFileError, match=f"damaged.*{kind!r} in category {category!r}"):
            read_plan(path)


def test_a_disk_whose_backing_says_no_provisioning_is_not_called_thick() -> None:
    """Sparse and SEsparse backings (and some snapshot deltas) carry neither flag: the
    root of the parent chain is read; when no backing says, the note says so."""
    sparse = replace(disk(None, None), backing="SeSparseBackingInfo")
    (note,) = [
        n for n in classify_vm(vm(disks=(sparse,)), NETWORKS).notes if n.kind is NoteKind.DISK
    ]
    text = note_text(note)
    assert "provisioning not said (backing SeSparseBackingInfo)" in text, text
    assert "thick" not in text
    flat: Any = vim.vm.device.VirtualDisk.FlatVer2BackingInfo
    delta = flat(parent=flat(parent=flat(thinProvisioned=True)))  # a snapshot's delta
    assert vmfacts._flags(delta) == (True, None)
    sparse_chain: Any = vim.vm.device.VirtualDisk.SeSparseBackingInfo
    assert vmfacts._flags(sparse_chain(parent=sparse_chain())) == (None, None)


# pve-common's pve-tag format, as tests/support/fakepve checks it against the schema.
PVE_TAG = re.compile(r"[a-z0-9_][a-z0-9_\-+.]*", re.I)


@pytest.mark.parametrize(
    ("tag", "proxmox"),
    [
        ("Backup/daily", "Backup.daily"),
        ("Owner/Team DB", "Owner.Team-DB"),
        ("Env/prod (EU)", "Env.prod-EU-"),
        ("-/x", "_-.x"),
        ("Sécurité/niveau 2", "S-curit-.niveau-2"),
        ("a/b/c", "a.b-c"),
    ],
)
def test_a_vsphere_tag_says_the_proxmox_tag_it_could_become(tag: str, proxmox: str) -> None:
    assert proxmox_tag(tag) == proxmox
    assert PVE_TAG.fullmatch(proxmox_tag(tag))


def test_tags_are_facts_a_note_the_digest_and_the_plan_file_keep(tmp_path: Path) -> None:
    """Tags read are facts (an added one changes the digest); tags not read (None) are
    left out of the JSON, so such a plan digests as one made before tags were read;
    the reason they were not read is said and kept in the plan file."""
    tagged = vm("a", tags=("Backup/daily", "Owner/Team DB"))
    note = next(n for n in classify_vm(tagged, NETWORKS).notes if n.kind is NoteKind.TAGS)
    assert (note.value, note.detail) == ("2", ("Backup/daily", "Owner/Team DB"))
    text = note_text(note)
    assert "2 vSphere tag(s) (Backup/daily, Owner/Team DB)" in text
    assert "could be set as Backup.daily, Owner.Team-DB" in text
    assert "tags" not in vm("a").as_json() and vm("a", tags=()).as_json()["tags"] == []
    template = TemplateFacts("vm-1", "deb", "debian10_64Guest", "Debian 12", (), (), (), "")
    labelled = replace(template, tags=("Golden/approved",))
    digests = {
        classify("vc", "pve", Scope(), [t], {}, [], NOW, [v]).digest
        for t, v in [
            (template, vm("a")),
            (template, vm("a", tags=())),
            (template, tagged),
            (labelled, vm("a")),
        ]
    }
    assert len(digests) == 4
    unread = classify("vc", "pve", Scope(), [template], {}, [], NOW, [vm("a")])
    before_tags = json.loads(json.dumps([vm("a").as_json()]))
    assert "tags" not in before_tags[0] and "tags" not in unread.document()["facts"][0]
    plan = classify(
        "vc", "pve", Scope(), [labelled], catalogue(), [], NOW, [tagged], SUBNETS,
        tags_unreadable=None,
    )  # fmt: skip
    (finding,) = [f for f in plan.findings if f.kind == "template"]
    assert [n.detail for n in finding.notes if n.kind is NoteKind.TAGS] == [("Golden/approved",)]
    assert not any("Tags not readable" in line for line in plan_lines(plan, None))
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    assert read_plan(path) == plan
    why = "vc.example:443 refuses the vAPI login to ops (403)"
    blind = classify("vc", "pve", Scope(), [template], {}, [], NOW, [vm("a")], tags_unreadable=why)
    assert f"  Tags not readable: {why}. The plan lists no vSphere tag" in "\n".join(
        plan_lines(blind, None)
    )
    write_plan(blind, path)
    assert read_plan(path).tags_unreadable == why and read_plan(path) == blind
