"""The simulator builds templates too (`backends.building.BuildsTemplates`), so the demo
and the core's tests run the whole build job without libguestfs or a hypervisor.

It takes no image (`image_platform = None`: the core skips the download and the
customisation), keeps the built templates beside the shipped ones, and follows the
contract's rules: pre-flight refuses what the real backends refuse (a node without avx2
for an x86-64-v3 profile, a name held by a template it did not build), a template is
created under its versioned name carrying the build's job tag, and publishing renames
the new one first, then the old one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.base import NotOurVM, PermanentError, Template, VMRef
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.simvm import Effect, FaultKind, SimVM
from backends.tags import parse_tag


@dataclass
class _Built:
    plan: BuildPlan
    name: str  # as it is called now
    placement: str
    linked: set[str] = field(default_factory=set)  # linked clones: they need it
    storage: str = "local-lvm"


def _template(plan: BuildPlan, name: str, storage: str) -> Template:
    return Template(name, plan.os_family, None, storage, 4, plan.user)


class SimBuilds:
    """Mixed into `SimBackend`: the attributes below are the simulator's."""

    image_platform: str | None = None  # the simulator needs no image
    name: str
    vms: dict[str, SimVM]
    _templates: tuple[Template, ...]
    _shipped: tuple[Template, ...]  # the templates it started with
    _owner: str
    _placements: tuple[str, ...]
    # Nodes whose CPU lacks avx2 (an x86-64-v3 template cannot run there).
    without_avx2: set[str]
    built: dict[str, _Built]

    if TYPE_CHECKING:  # provided by SimBackend

        def _answer(self) -> None: ...
        def _new_id(self) -> str: ...
        def _save(self) -> None: ...
        def _fault(self, op: str, vm_id: str = "") -> FaultKind | None: ...
        async def _run(
            self, op: str, vm_id: str, seconds: float, effect: Effect, fault: FaultKind | None
        ) -> None: ...

    def built_rows(self) -> list[dict[str, Any]]:
        """The built templates, for the state file."""
        rows = []
        for vm_id, b in self.built.items():
            plan = {**asdict(b.plan), "built_at": b.plan.built_at.isoformat()}
            rows.append(
                {"vm_id": vm_id, "plan": plan, "name": b.name, "placement": b.placement,
                 "linked": sorted(b.linked), "storage": b.storage}
            )  # fmt: skip
        return rows

    def restore_built(self, rows: list[dict[str, Any]]) -> None:
        """The built templates as the state file has them, in place of those known."""
        self.built.clear()
        for row in sorted(rows, key=lambda r: int(r["vm_id"])):
            fields = dict(row["plan"])
            fields["built_at"] = datetime.fromisoformat(fields["built_at"])
            plan = BuildPlan(**fields)
            built = _Built(plan, row["name"], row["placement"], set(row["linked"]), row["storage"])
            self.built[str(row["vm_id"])] = built
        made = (_template(b.plan, b.name, b.storage) for b in self.built.values())
        self._templates = (*self._shipped, *made)

    def note_linked(self, template: str, vm_id: str) -> None:
        """A linked clone of `template` was made: it needs the template while it lives."""
        for built in self.built.values():
            if built.name == template:
                built.linked.add(vm_id)

    def _named(self, name: str) -> list[str]:
        """What holds a name: templates (shipped or built) and VMs."""
        held = [f"template {t.name}" for t in self._templates if t.name == name]
        return held + [f"VM {v.vm_id}" for v in self.vms.values() if v.name == name]

    async def build_preflight(self, plan: BuildPlan) -> BuildTarget:
        self._answer()
        placement = plan.placement or self._placements[0]
        if placement not in self._placements:
            have = ", ".join(self._placements)
            raise PermanentError(f"{placement!r} is not a node of {self.name} (have: {have})")
        if plan.cpu == "x86-64-v3" and placement in self.without_avx2:
            raise PermanentError(
                f"node {placement} has no avx2, which {plan.profile} needs (CPU baseline "
                f"x86-64-v3: its glibc refuses to start without it); build on a node with "
                "avx2 (`--node`), or choose an x86-64-v2 profile"
            )
        if held := self._named(plan.versioned_name):
            raise PermanentError(
                f"{plan.versioned_name} is taken ({held[0]}): remove it, or build under "
                "another name (`--name`)"
            )
        current = [t for t in self._templates if t.name == plan.name]
        if current and not any(b.name == plan.name for b in self.built.values()):
            raise PermanentError(
                f"{plan.name} is a template deploybot did not build: publishing would "
                "rename it; build under another name (`--name`)"
            )
        if vms := [v for v in self.vms.values() if v.name == plan.name]:
            raise PermanentError(
                f"{plan.name} is the name of VM {vms[0].vm_id}: build under another name (`--name`)"
            )
        return BuildTarget(placement, plan.storage or "local-lvm")

    async def prepare_build(self, plan: BuildPlan, target: BuildTarget) -> VMRef:
        self._answer()
        return plan.ref(self._new_id(), target.placement)

    async def create_template(
        self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path | None
    ) -> str | None:
        self._answer()
        fault = self._fault("create_template", ref.vm_id)
        vm = SimVM(
            ref.vm_id, plan.versioned_name, plan.profile, target.placement, target.storage, 4,
            {plan.tag}, lock="create", lock_owner=self._owner,
        )  # fmt: skip
        self.vms[vm.vm_id] = vm
        self._save()

        def convert() -> None:
            # A template is not a VM any more: deploys find it among the templates.
            self.vms.pop(vm.vm_id, None)
            self.built[vm.vm_id] = _Built(
                plan, plan.versioned_name, target.placement, storage=target.storage
            )
            template = _template(plan, plan.versioned_name, target.storage)
            self._templates = (*self._templates, template)

        await self._run("create_template", vm.vm_id, 1.0, Effect(vm, self.vms, convert), fault)
        return None

    def _rename(self, old: str, new: str) -> None:
        renamed = (replace(t, name=new) if t.name == old else t for t in self._templates)
        self._templates = tuple(renamed)

    async def publish_template(self, plan: BuildPlan, ref: VMRef) -> str | None:
        self._answer()
        self._fault("publish_template", ref.vm_id)
        mine = self.built.get(ref.vm_id)
        if mine is None or mine.plan.tag != ref.tag:
            raise NotOurVM(f"template {ref.vm_id} does not carry tag {ref.tag}", vm_id=ref.vm_id)
        before = [b for k, b in self.built.items() if b.name == plan.name and k != ref.vm_id]
        if mine.name != plan.name:  # the new one first: never a moment without the name
            self._rename(mine.name, plan.name)
            mine.name = plan.name
        for old in before:
            self._rename(old.name, old.plan.versioned_name)
            old.name = old.plan.versioned_name
        self._save()  # the other processes on the state file see the new names
        return None

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        self._answer()
        return [
            TemplateVersion(
                vm_id,
                b.name,
                b.plan.name,
                b.plan.profile,
                b.plan.version,
                b.plan.built_at,
                b.plan.cpu,
                parse_tag(b.plan.tag),
                b.placement,
                tuple(sorted(v for v in b.linked if v in self.vms)),
            )
            for vm_id, b in sorted(self.built.items())
            if name is None or b.plan.name == name
        ]

    async def destroy_template(self, ref: VMRef) -> None:
        self._answer()
        vm = self.vms.get(ref.vm_id)
        if vm is not None:  # half-built: not a template yet
            if ref.tag not in vm.tags:
                raise NotOurVM(f"VM {ref.vm_id} does not carry tag {ref.tag}", vm_id=ref.vm_id)
            self.vms.pop(ref.vm_id)
        built = self.built.get(ref.vm_id)
        if built is not None:
            if built.plan.tag != ref.tag:
                why = f"template {ref.vm_id} does not carry tag {ref.tag}"
                raise NotOurVM(why, vm_id=ref.vm_id)
            del self.built[ref.vm_id]
            self._templates = tuple(t for t in self._templates if t.name != built.name)
        self._save()
