"""The simulator builds templates too (`backends.building.BuildsTemplates`), so the demo
and the core's tests run the whole build job without libguestfs or a hypervisor.

It takes no image (`image_platform = None`: the core skips the download and the
customisation), keeps the built templates beside the shipped ones (in the inventory,
backends/sim/inventory.py), and follows the contract's rules: pre-flight refuses what
the real backends refuse (a node without avx2 for an x86-64-v3 profile, a name held by
a template it did not build), a template is created under its versioned name carrying
the build's job tag, and publishing renames the new one first, then the old one.
"""

from __future__ import annotations

from pathlib import Path

from backends.base import NotOurVM, PermanentError, VMRef
from backends.building import BuildPlan, BuildTarget, TemplateVersion
from backends.sim.inventory import Built, Inventory
from backends.sim.tasks import Tasks
from backends.sim.vm import Effect, SimVM
from backends.tags import parse_tag


class TemplateBuilds:
    """Template builds on the hypervisor `name` (its nodes: `placements`)."""

    def __init__(
        self, name: str, placements: tuple[str, ...], inventory: Inventory, tasks: Tasks
    ) -> None:
        self._name = name
        self._placements = placements
        self._inventory = inventory
        self._tasks = tasks
        # Nodes whose CPU lacks avx2 (an x86-64-v3 template cannot run there).
        self.without_avx2: set[str] = set()

    async def build_preflight(self, plan: BuildPlan) -> BuildTarget:
        self._tasks.answer()
        inventory = self._inventory
        placement = plan.placement or self._placements[0]
        if placement not in self._placements:
            have = ", ".join(self._placements)
            raise PermanentError(f"{placement!r} is not a node of {self._name} (have: {have})")
        if plan.cpu == "x86-64-v3" and placement in self.without_avx2:
            raise PermanentError(
                f"node {placement} has no avx2, which {plan.profile} needs (CPU baseline "
                f"x86-64-v3: its glibc refuses to start without it); build on a node with "
                "avx2 (`--node`), or choose an x86-64-v2 profile"
            )
        if held := inventory.holders(plan.versioned_name):
            raise PermanentError(
                f"{plan.versioned_name} is taken ({held[0]}): remove it, or build under "
                "another name (`--name`)"
            )
        current = inventory.template_named(plan.name)
        if current is not None and not any(b.name == plan.name for b in inventory.built.values()):
            raise PermanentError(
                f"{plan.name} is a template deploybot did not build: publishing would "
                "rename it; build under another name (`--name`)"
            )
        if vms := [v for v in inventory.vms.values() if v.name == plan.name]:
            raise PermanentError(
                f"{plan.name} is the name of VM {vms[0].vm_id}: build under another name (`--name`)"
            )
        return BuildTarget(placement, plan.storage or "local-lvm")

    async def prepare_build(self, plan: BuildPlan, target: BuildTarget) -> VMRef:
        self._tasks.answer()
        return plan.ref(self._inventory.new_id(), target.placement)

    async def create_template(
        self, plan: BuildPlan, target: BuildTarget, ref: VMRef, image: Path | None
    ) -> str | None:
        self._tasks.answer()
        inventory = self._inventory
        fault = self._tasks.fault("create_template", ref.vm_id)
        vm = SimVM(
            ref.vm_id, plan.versioned_name, plan.profile, target.placement, target.storage, 4,
            {plan.tag}, lock="create", lock_owner=inventory.owner,
        )  # fmt: skip
        inventory.vms[vm.vm_id] = vm
        inventory.save()

        def convert() -> None:
            # A template is not a VM any more: deploys find it among the templates.
            inventory.vms.pop(vm.vm_id, None)
            built = Built(plan, plan.versioned_name, target.placement, storage=target.storage)
            inventory.add_built(vm.vm_id, built)

        effect = Effect(vm, inventory.vms, convert)
        await self._tasks.run("create_template", vm.vm_id, 1.0, effect, fault)
        return None

    async def publish_template(self, plan: BuildPlan, ref: VMRef) -> str | None:
        self._tasks.answer()
        self._tasks.fault("publish_template", ref.vm_id)
        inventory = self._inventory
        mine = inventory.built.get(ref.vm_id)
        if mine is None or mine.plan.tag != ref.tag:
            raise NotOurVM(f"template {ref.vm_id} does not carry tag {ref.tag}", vm_id=ref.vm_id)
        built = inventory.built.items()
        before = [b for k, b in built if b.name == plan.name and k != ref.vm_id]
        mine.name = plan.name  # the new one first: never a moment without the name
        for old in before:
            old.name = old.plan.versioned_name
        inventory.save()  # the other processes on the state file see the new names
        return None

    async def template_versions(self, name: str | None = None) -> list[TemplateVersion]:
        self._tasks.answer()
        vms = self._inventory.vms
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
                tuple(sorted(v for v in b.linked if v in vms)),
            )
            for vm_id, b in sorted(self._inventory.built.items())
            if name is None or b.plan.name == name
        ]

    async def destroy_template(self, ref: VMRef) -> None:
        self._tasks.answer()
        inventory = self._inventory
        vm = inventory.vms.get(ref.vm_id)
        if vm is not None:  # half-built: not a template yet
            if ref.tag not in vm.tags:
                raise NotOurVM(f"VM {ref.vm_id} does not carry tag {ref.tag}", vm_id=ref.vm_id)
            inventory.vms.pop(ref.vm_id)
        built = inventory.built.get(ref.vm_id)
        if built is not None:
            if built.plan.tag != ref.tag:
                why = f"template {ref.vm_id} does not carry tag {ref.tag}"
                raise NotOurVM(why, vm_id=ref.vm_id)
            inventory.remove_built(ref.vm_id)
        inventory.save()
