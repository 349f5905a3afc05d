"""The Backend contract (backends/base.py) as tests that every backend must pass.

Not collected by itself: each backend has a `tests/test_<kind>_contract.py` that
defines a `backend` fixture (a fresh backend with at least one template) and a
`hand_built` fixture (`HandBuilt`: make a VM the way someone else would, not through
deploybot and without a job tag, whose guest uses a given address), an `untag` fixture
(`Untag`: remove a VM's job tag the way a person would, on the hypervisor), and does
`from tests.support.contract import *`, so the same tests run against it unchanged.
Every backend also builds templates (`backends.building.BuildsTemplates`); those given
an image get an empty qcow2 from qemu-img.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from backends.base import AddressUse, Backend, CloneSpec, Identity, NotOurVM, PermanentError, VMRef
from backends.building import BuildPlan, BuildsTemplates
from backends.tags import job_tag
from bot.config.sections import Timeouts
from bot.jobs.waiting import remove_vm

IDENTITY = Identity(
    hostname="contract01",
    user="ubuntu",
    ssh_keys=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test",
    ),
    address=ipaddress.IPv4Interface("10.0.0.77/24"),
    gateway=ipaddress.IPv4Address("10.0.0.1"),
    dns=(ipaddress.IPv4Address("10.0.0.2"),),
    search_domain="lab.example",
    upgrade=False,
    cores=2,
    memory_mib=2048,
)


# (name, address) -> the VM's id as the backend names VMs (VMInfo.vm_id).
HandBuilt = Callable[[str, ipaddress.IPv4Address], Awaitable[str]]
# Remove the job tag from a VM by hand (the web UI, govc): deploybot must then refuse it.
Untag = Callable[[VMRef], Awaitable[None]]
TIMEOUTS = Timeouts(power_off_s=60, destroy_s=60, retry_initial_s=0.05, retry_max_s=0.5)


async def first_template(backend: Backend) -> str:
    templates = await backend.templates()
    assert templates, "a backend under test must offer at least one template"
    return templates[0].name


async def test_is_a_backend(backend: Backend) -> None:
    assert isinstance(backend, Backend)


async def test_discovery(backend: Backend) -> None:
    assert await backend.templates()
    storages = await backend.storages()
    assert all(s.total_bytes >= s.free_bytes >= 0 for s in storages)
    assert await backend.placements()
    assert isinstance(await backend.networks(), list)


async def test_full_life_cycle(backend: Backend) -> None:
    """Clone, identity, grow, start, address, stop, destroy; and a second rollback is fine."""
    spec = CloneSpec("jcontra", "contract01", await first_template(backend))
    ref = await backend.prepare_clone(spec)
    assert await backend.find_vm(ref) is None, "prepare_clone must not create anything"
    await backend.clone(spec, ref)
    info = await backend.find_vm(ref)
    assert info is not None and info.name == "contract01" and not info.running
    assert job_tag("jcontra") in info.tags
    assert [v.vm_id for v in await backend.find_by_name("contract01")] == [ref.vm_id]
    assert ref.vm_id in {v.vm_id for v in await backend.find_tagged()}
    await backend.apply_identity(ref, IDENTITY)
    await backend.grow_disk(ref, 1)
    await backend.power_on(ref)
    assert (await backend.find_vm(ref)).running  # type: ignore[union-attr]
    assert await backend.wait_for_address(ref, IDENTITY.address.ip) == IDENTITY.address.ip
    try:  # running: refused, or (Proxmox) stopped first, the stop waited for
        await backend.destroy(ref)
    except PermanentError:
        still = await backend.find_vm(ref)
        assert still is not None and still.running, "a refused destroy must change nothing"
    else:
        assert await backend.find_vm(ref) is None
    await backend.power_off(ref)
    await backend.destroy(ref)
    assert await backend.find_vm(ref) is None
    # Gone is gone: a second rollback succeeds quietly.
    await backend.power_off(ref)
    await backend.destroy(ref)


async def test_refuses_to_touch_a_vm_without_the_job_tag(backend: Backend) -> None:
    spec = CloneSpec("jowner1", "owned01", await first_template(backend))
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    intruder = VMRef(ref.vm_id, "jother1", ref.placement)
    with pytest.raises(NotOurVM):
        await backend.destroy(intruder)
    with pytest.raises(NotOurVM):
        await backend.power_off(intruder)
    assert await backend.find_vm(ref) is not None
    await backend.destroy(ref)


async def test_clone_mode_says_linked_or_full(backend: Backend) -> None:
    template = (await backend.templates())[0]
    mode = await backend.clone_mode(CloneSpec("jmode12", "m", template.name))
    assert mode.reason
    others = [s for s in await backend.storages() if s.name != template.storage]
    if others:
        full = await backend.clone_mode(
            CloneSpec("jmode12", "m", template.name, storage=others[0].name)
        )
        assert not full.linked and "full" in full.reason


def listed(uses: list[AddressUse], address: ipaddress.IPv4Address) -> list[tuple[str, str]]:
    return [(u.vm_id, u.vm_name) for u in uses if u.address == address]


async def test_addresses_in_use_lists_a_vm_built_by_hand(
    backend: Backend, hand_built: HandBuilt
) -> None:
    address = ipaddress.IPv4Address("10.0.0.91")
    vm_id = await hand_built("handmade01", address)
    uses = await backend.addresses_in_use()
    assert listed(uses, address) == [(vm_id, "handmade01")]
    assert all(u.source for u in uses if u.address == address)
    # What a guest has for itself alone (its `lo`, link-local) is nobody's conflict.
    host = ipaddress.IPv4Address("127.0.0.1")
    assert not [u for u in uses if u.address == host or u.address.is_link_local]
    assert ipaddress.IPv4Address("172.17.0.1") not in {u.address for u in uses}  # docker0


async def test_addresses_in_use_lists_our_own_vm_and_forgets_it_when_gone(
    backend: Backend,
) -> None:
    address = IDENTITY.address.ip
    # Not asked before the clone: an answer kept from then may hide our new VM (its job
    # holds the address in the store); a destroy of ours must show at once.
    spec = CloneSpec("jaddr01", IDENTITY.hostname, await first_template(backend))
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    assert await backend.wait_for_address(ref, address) == address
    assert listed(await backend.addresses_in_use(), address) == [(ref.vm_id, IDENTITY.hostname)]
    await backend.power_off(ref)
    await backend.destroy(ref)
    assert ref.vm_id not in {u.vm_id for u in await backend.addresses_in_use()}


async def running_vm(backend: Backend, job_id: str) -> VMRef:
    """A deployed VM as a destroy finds it (named IDENTITY.hostname, running)."""
    spec = CloneSpec(job_id, IDENTITY.hostname, await first_template(backend))
    ref = await backend.prepare_clone(spec)
    await backend.clone(spec, ref)
    await backend.apply_identity(ref, IDENTITY)
    await backend.power_on(ref)
    assert (await backend.find_vm(ref)).running  # type: ignore[union-attr]
    return ref


async def test_destroy_stops_and_removes_a_running_vm(backend: Backend) -> None:
    """`/deploy destroy` takes the rollback's path (bot/jobs/waiting.remove_vm): stop and
    wait, then destroy and wait; done twice (a destroy taken over) it removes once."""
    ref = await running_vm(backend, "jdestry")
    moves: list[tuple[str, bool]] = []

    async def on_move(step: str, took_s: float | None) -> None:
        moves.append((step, took_s is not None))

    await remove_vm(backend, ref, TIMEOUTS, on_move)
    assert moves == [("stop", False), ("stop", True), ("destroy", False), ("destroy", True)]
    assert await backend.find_vm(ref) is None
    assert not await backend.find_by_name(IDENTITY.hostname)
    await remove_vm(backend, ref, TIMEOUTS)  # gone is gone


async def test_destroy_refuses_a_vm_whose_tag_was_removed_by_hand(
    backend: Backend, untag: Untag
) -> None:
    ref = await running_vm(backend, "jkeepme")
    await untag(ref)
    with pytest.raises(NotOurVM):
        await remove_vm(backend, ref, TIMEOUTS)
    (left,) = await backend.find_by_name(IDENTITY.hostname)
    assert left.vm_id == ref.vm_id and left.running, "nothing may be touched"


# --- template builds (backends/building.py) --------------------------------------------


def build_image(backend: BuildsTemplates, where: Path) -> Path | None:
    """What `create_template` imports: nothing for a backend that takes no image, else
    a small empty qcow2 (the backend copies it, never boots it)."""
    if backend.image_platform is None:
        return None
    if shutil.which("qemu-img") is None:
        pytest.skip("qemu-img is not installed (apt-get install qemu-utils)")
    image = where / "contract.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"], check=True)
    return image


def build_plan(version: int) -> BuildPlan:
    return BuildPlan(
        job_id=f"jbuild{version:02d}", profile="debian-12", os_family="debian",
        version=version, name="contract-golden", cpu="x86-64-v2-AES", ostype="l26",
        nic="e1000", disk_bus="scsi", user="debian", built_at=datetime(2026, 12, 1, tzinfo=UTC),
        source_digest="sha256:" + "ab" * 32, cores=1, memory_mib=1024, installation="contrinst1",
    )  # fmt: skip


async def test_a_second_publish_takes_the_name_and_versions_the_first(
    backend: Backend, tmp_path: Path
) -> None:
    """v2 is published under the plain name, v1 renamed to its versioned name; deploys
    (`templates()`) and `template_versions()` say the same."""
    assert isinstance(backend, BuildsTemplates)
    image = build_image(backend, tmp_path)
    refs = []
    for version in (1, 2):
        plan = build_plan(version)
        target = await backend.build_preflight(plan)
        ref = await backend.prepare_build(plan, target)
        await backend.create_template(plan, target, ref, image)
        await backend.publish_template(plan, ref)
        refs.append(ref.vm_id)
    versions = await backend.template_versions("contract-golden")
    assert [(v.vm_id, v.name, v.current) for v in versions] == [
        (refs[0], "contract-golden-v1", False),
        (refs[1], "contract-golden", True),
    ]
    offered = sorted(t.name for t in await backend.templates() if t.name.startswith("contract-"))
    assert offered == ["contract-golden", "contract-golden-v1"]
