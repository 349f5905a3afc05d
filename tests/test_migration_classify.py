"""The migration plan's classification and digest, on facts alone (no hypervisor): how a
profile is found (build mark, else guest OS), what is missing when none fits, what is
already on the target, the notes, and a digest that covers the facts and nothing else."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from backends.building import TemplateVersion
from backends.migrating import Scope, TemplateFacts, extra_facts
from bot.images.profiles import catalogue
from bot.migration.classify import Category, MatchedBy, Missing, NoteKind, classify_template
from bot.migration.plan import PlanFileError, classify, read_plan, source_digest, write_plan
from handlers.messages.migration import plan_json, plan_lines, reason

PROFILES = catalogue()
NOW = datetime(2026, 12, 5, tzinfo=UTC)


def facts(
    name: str, guest_id: str = "otherGuest", annotation: str = "", **more: object
) -> TemplateFacts:
    base = TemplateFacts(f"uuid-{name}", name, guest_id, annotation, (), (), (), "vmx-13")
    return replace(base, **more)  # type: ignore[arg-type]


def version(profile: str, number: int, name: str) -> TemplateVersion:
    return TemplateVersion("9100", name, profile, profile, number, None, None, None, "pve1")


def test_the_build_mark_names_the_profile_whatever_the_guest_id() -> None:
    mark = "deploybot-jabc123\ndeploybot-build name=x profile=debian-13 version=2\nBuilt."
    found = classify_template(facts("x", "windows9Server64Guest", mark), PROFILES, [])
    assert (found.category, found.profile, found.matched_by) == (
        Category.REBUILDABLE,
        "debian-13",
        MatchedBy.BUILD_MARK,
    )
    unknown = classify_template(
        facts("y", annotation=mark.replace("debian-13", "sles-15")), PROFILES, []
    )
    assert unknown.missing is Missing.UNKNOWN_PROFILE and unknown.detail[0] == "sles-15"
    assert "add [images.profiles.sles-15]" in reason(unknown)


def test_the_guest_os_needs_one_profile_to_fit() -> None:
    both = classify_template(facts("golden", "rhel9_64Guest"), PROFILES, [])
    assert both.missing is Missing.AMBIGUOUS and both.detail == ("alma-9", "rocky-9")
    alma = classify_template(facts("golden", "rhel9_64Guest", "AlmaLinux 9.4 base"), PROFILES, [])
    assert (alma.profile, alma.evidence) == (
        "alma-9",
        "guest id 'rhel9_64Guest', annotation 'AlmaLinux 9'",
    )
    # A point release is its major one; another release is not.
    assert (
        classify_template(facts("d", "debian10_64Guest", "Debian 12.5"), PROFILES, []).profile
        == "debian-12"
    )
    old = classify_template(facts("d", "debian10_64Guest", "Debian 11.2"), PROFILES, [])
    assert old.missing is Missing.NO_VERSION and "write the release" in reason(old)
    # "12" in a date or an interface name is no release.
    dated = classify_template(
        facts("d", "debian10_64Guest", "built 2024-12-01, ens192"), PROFILES, []
    )
    assert dated.missing is Missing.NO_VERSION
    unsaid = classify_template(facts("golden", "otherGuest", "Rocky Linux 10"), PROFILES, [])
    assert unsaid.profile == "rocky-10"
    nothing = classify_template(facts("golden", "other3xLinux64Guest", "our base"), PROFILES, [])
    assert nothing.missing is Missing.UNKNOWN_OS
    windows = classify_template(
        facts("w", "windows9Server64Guest", "debian-12 tools"), PROFILES, []
    )
    assert windows.missing is Missing.UNKNOWN_OS
    assert reason(windows).startswith(
        "no build profile is for its guest OS (guest id windows9Server64Guest)"
    )


def test_on_target_names_the_current_template_of_the_profile() -> None:
    target = [
        version("ubuntu-24.04", 2, "ubuntu-24.04-v2"),
        version("ubuntu-24.04", 3, "ubuntu-24.04"),
        version("debian-12", 1, "debian-12"),
    ]
    found = classify_template(facts("u", "ubuntu64Guest", "Ubuntu 24.04"), PROFILES, target)
    assert (found.category, found.target_name, found.target_version) == (
        Category.ON_TARGET,
        "ubuntu-24.04",
        3,
    )
    other = classify_template(facts("u", "ubuntu64Guest", "Ubuntu 22.04"), PROFILES, target)
    assert other.category is Category.REBUILDABLE


def test_extra_config_keeps_the_pin_and_only_digests_of_guestinfo() -> None:
    kept = extra_facts(
        [
            ("guestinfo.userdata", "I2Nsb3VkLWNvbmZpZwpwYXNzd29yZDogc2VjcmV0"),
            ("guestinfo.cloudinit.datasource_list", "[VMware]"),
            ("nvram", "x.nvram"),
            ("guestinfo.cloudinit.datasource_list", "[VMware, None]"),  # the last wins
        ]
    )
    assert dict(kept)["guestinfo.cloudinit.datasource_list"] == "[VMware, None]"
    assert dict(kept)["guestinfo.userdata"].startswith("sha256:")
    assert "nvram" not in dict(kept)
    found = classify_template(
        facts("t", "ubuntu64Guest", "Ubuntu 24.04, ens160", extra=kept, nics=("e1000", "vmxnet3")),
        PROFILES,
        [],
    )
    notes = {(n.kind, n.value) for n in found.notes}
    assert (
        NoteKind.DATASOURCE_PINNED,
        "guestinfo.cloudinit.datasource_list=[VMware, None]",
    ) in notes
    assert (NoteKind.GUESTINFO, "guestinfo.userdata") in notes
    assert (NoteKind.VMWARE_NIC, "vmxnet3") in notes and (NoteKind.VMWARE_NIC, "e1000") not in notes
    assert (NoteKind.VMWARE_INTERFACE, "ens160") in notes


def test_the_digest_covers_the_facts_in_any_order_and_nothing_else() -> None:
    a, b = facts("a", "ubuntu64Guest", "Ubuntu 24.04"), facts("b", "otherGuest")
    digest = source_digest("vc", Scope(), [a, b])
    assert digest == source_digest("vc", Scope(), [b, a])
    assert digest != source_digest("vc", Scope(name="a*"), [a, b])
    assert digest != source_digest("vc", Scope(), [replace(a, guest_id="ubuntu32Guest"), b])
    first = classify("vc", "pve", Scope(), [a, b], PROFILES, [], NOW)
    later = classify("vc", "pve", Scope(), [b, a], PROFILES, [version("x", 1, "x")], NOW)
    assert first.digest == later.digest == digest  # the target and the time are not facts


def test_the_plan_file_and_the_table(tmp_path: Path) -> None:
    plan = classify(
        "vc",
        "pve",
        Scope(folder="golden"),
        [facts("a", "ubuntu64Guest", "Ubuntu 24.04"), facts("w", "windows9Server64Guest")],
        PROFILES,
        [],
        NOW,
    )
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    document = json.loads(path.read_text())
    assert document["format"] == "deploybot-migration-plan/1"
    assert document["source_digest"] == plan.digest
    assert document["counts"] == {
        "template": {"rebuildable": 1, "on-target": 0, "not-mappable": 1},
        "vm": {"moves-as-is": 0, "needs-decisions": 0, "blocked": 0},
    }
    assert [f["category"] for f in document["findings"]] == ["rebuildable", "not-mappable"]
    assert plan_json(plan)["findings"][0]["reason"].startswith("rebuild from profile ubuntu-24.04")
    lines = plan_lines(plan, None)
    assert lines[0] == "Migration plan (dry run, nothing changed): vc -> pve (folder golden)"
    assert "Templates: 2 in scope: 1 rebuild, 0 on target, 1 not mappable." in lines
    assert "VMs: 0 in scope: 0 moves as is, 0 decisions, 0 blocked." in lines
    assert lines[-1].startswith("Not written: add --out FILE")
    assert "Target pve: no template deploybot built." in lines
    empty = classify("vc", "pve", Scope(), [], PROFILES, [], NOW)
    assert empty.counts()["template"] == {"rebuildable": 0, "on-target": 0, "not-mappable": 0}
    assert "  No template in scope." in plan_lines(empty, None)


def test_a_plan_file_reads_back_and_refuses_an_edit(tmp_path: Path) -> None:
    mark = "deploybot-build name=r profile=rocky-9 version=2"
    plan = classify(
        "vc",
        "pve",
        Scope(name="*"),
        [
            facts("r", "rhel7_64Guest", mark, extra=(("guestinfo.a.datasource", "[VMware]"),)),
            facts("u", "ubuntu64Guest", "Ubuntu 24.04, ens192", nics=("vmxnet3",)),
            facts("w", "windows9Server64Guest"),
        ],
        PROFILES,
        [version("ubuntu-24.04", 1, "ubuntu-24.04")],
        NOW,
    )
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    assert read_plan(path) == plan
    data = json.loads(path.read_text())
    data["facts"][0]["annotation"] = "deploybot-build name=r profile=alma-9 version=2"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"do not match its digest.*make a new plan"):
        read_plan(path)
    path.write_text(json.dumps({**data, "format": "other/1"}))
    with pytest.raises(PlanFileError, match="not a deploybot migration plan"):
        read_plan(path)
    path.write_text("{")
    with pytest.raises(PlanFileError, match="cannot read it"):
        read_plan(path)
    del data["facts"][0]["nics"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="damaged"):
        read_plan(path)


def test_the_plan_file_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """Its temporary file is new (O_EXCL) and of a name nobody could guess: a link left
    where a fixed temporary name would be is neither followed nor replaced."""
    plan = classify("vc", "pve", Scope(), [facts("a", "ubuntu64Guest")], PROFILES, [], NOW)
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    path = tmp_path / "plan.json"
    planted = tmp_path / ".plan.json.tmp"
    planted.symlink_to(victim)
    write_plan(plan, path)
    assert victim.read_text() == "untouched\n"
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_plan(path) == plan
    assert sorted(p.name for p in tmp_path.iterdir()) == [".plan.json.tmp", "plan.json", "victim"]
