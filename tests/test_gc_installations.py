"""Two installations (two databases) on one Proxmox cluster: gc removes only its own.

Staging next to production, or a restored copy of a database: each tags its VMs with
its own installation id, so neither takes the other's VMs for orphans. The hypervisor
is the fake Proxmox API (the VMs carry their job mark in the description, as a clone
does before its identity and tags are set).
"""

from __future__ import annotations

from pathlib import Path

from backends.base import CloneSpec, VMRef
from backends.proxmox import ProxmoxBackend
from bot.config.sections import Timeouts
from bot.operations import gc
from store.db import Store
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import make_backend

pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls
FAST = Timeouts(retry_initial_s=0.01, retry_max_s=0.05)


async def orphan(backend: ProxmoxBackend, store: Store, job: str, name: str) -> VMRef:
    """A VM tagged for a job this installation's database does not know."""
    spec = CloneSpec(job, name, "ubuntu-24.04", installation=store.installation_id)
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    return ref


async def test_each_installation_removes_only_its_own_orphans(tmp_path: Path, pve: FakePVE) -> None:
    backend = make_backend(pve)
    prod, staging = await Store.open(tmp_path / "prod.db"), await Store.open(tmp_path / "st.db")
    try:
        assert prod.installation_id != staging.installation_id
        ours = await orphan(backend, prod, "jprodghost1", "prod-ghost")
        theirs = await orphan(backend, staging, "jstagghost1", "staging-ghost")
        backends = {"pve": backend}
        dry = await gc.dry_run(prod, backends, ["pve"])
        assert {(f.vm.vm_id, f.category) for f in dry.findings} == {
            (ours.vm_id, "unknown_job"),
            (theirs.vm_id, "other_installation"),
        }
        applied = await gc.apply(prod, backends, ["pve"], FAST, window_s=600)
        assert [f.vm.vm_id for f in applied.removed] == [ours.vm_id]
        assert await backend.find_vm(ours) is None
        assert await backend.find_vm(theirs) is not None  # never touched
        # And the other way round: staging removes its own, and only that.
        await gc.dry_run(staging, backends, ["pve"])
        applied = await gc.apply(staging, backends, ["pve"], FAST, window_s=600)
        assert [f.vm.vm_id for f in applied.removed] == [theirs.vm_id]
        destroys = [r for r in pve.sent("DELETE", "/nodes/{node}/qemu/{vmid}")]
        assert len(destroys) == 2
    finally:
        await prod.close()
        await staging.close()
        await backend.close()
