"""Simulator semantics that the contract does not cover: locks, faults, guest agent."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path
from typing import Any

import pytest

from backends.base import CloneSpec, PermanentError, RetryableError, Unreachable, VMRef
from backends.guestaddr import pick_address
from backends.sim import SimBackend
from backends.sim.vm import SimTiming, SimulatedCrash
from tests.support.contract import IDENTITY


async def cloned(sim: SimBackend, job: str = "jsim001") -> VMRef:
    spec = CloneSpec(job, "vm1", "ubuntu-24.04")
    ref = await sim.prepare_clone(spec)
    await sim.clone(spec, ref)
    return ref


async def test_a_clone_is_locked_until_it_finishes() -> None:
    sim = SimBackend(time_scale=0.001, timing=SimTiming(clone_linked_s=50))
    spec = CloneSpec("jsim001", "vm1", "ubuntu-24.04")
    ref = await sim.prepare_clone(spec)
    task = asyncio.create_task(sim.clone(spec, ref))
    await asyncio.wait({task}, timeout=0)  # one loop turn: the clone's first step makes the VM
    assert sim.vms[ref.vm_id].lock == "clone"
    with pytest.raises(RetryableError, match=r"locked \(clone\)"):
        await sim.apply_identity(ref, IDENTITY)
    await task
    await sim.apply_identity(ref, IDENTITY)


async def test_a_failed_clone_leaves_no_vm() -> None:
    sim = SimBackend(time_scale=0.001)
    sim.inject("clone", "error")
    spec = CloneSpec("jsim001", "vm1", "ubuntu-24.04")
    ref = await sim.prepare_clone(spec)
    with pytest.raises(PermanentError, match="clone failed"):
        await sim.clone(spec, ref)
    assert sim.vms == {}


async def test_a_crash_acts_then_raises_an_unmapped_error() -> None:
    sim = SimBackend(time_scale=0.001)
    ref = await cloned(sim)
    sim.inject("power_on", "crash")
    with pytest.raises(SimulatedCrash):
        await sim.power_on(ref)
    assert sim.vms[ref.vm_id].running


async def test_the_address_appears_only_after_boot() -> None:
    sim = SimBackend(time_scale=0.001)
    ref = await cloned(sim)
    await sim.apply_identity(ref, IDENTITY)
    with pytest.raises(PermanentError, match="not running"):
        await sim.wait_for_address(ref, None)
    await sim.power_on(ref)
    assert not sim.vms[ref.vm_id].booted.is_set()
    assert await sim.wait_for_address(ref, None) == IDENTITY.address.ip


async def test_waiting_for_the_address_keeps_its_waits_from_poll_to_poll() -> None:
    """The wait polls (an outage is noticed) but does not make a pair of tasks at every
    poll: at 200 deploys those were most of what the waits cost the event loop."""
    sim = SimBackend(time_scale=0.001, timing=SimTiming(boot_s=40, poll_s=0.5))
    ref = await cloned(sim)
    await sim.apply_identity(ref, IDENTITY)
    await sim.power_on(ref)
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        assert await sim.wait_for_address(ref, None) == IDENTITY.address.ip
    finally:
        loop.set_task_factory(None)
    assert len(made) <= 4, made  # the boot took ~80 polls; each made two tasks before


async def test_inject_rejects_unknown_operations() -> None:
    with pytest.raises(ValueError, match="unknown operation"):
        SimBackend().inject("reboot", "error")


async def test_unknown_template_and_node_are_permanent_errors() -> None:
    sim = SimBackend()
    with pytest.raises(PermanentError, match="template 'nope' does not exist"):
        await sim.prepare_clone(CloneSpec("jsim001", "vm1", "nope"))
    with pytest.raises(PermanentError, match="not a node"):
        await sim.prepare_clone(CloneSpec("jsim001", "vm1", "ubuntu-24.04", placement="node7"))


@pytest.mark.parametrize(
    ("interfaces", "expected", "chosen"),
    [
        (
            [
                ("lo", "127.0.0.1"),
                ("ens18", "fe80::1"),
                ("docker0", "172.17.0.1"),
                ("ens18", "10.0.0.5"),
            ],
            None,
            "10.0.0.5",
        ),
        ([("ens18", "169.254.3.3"), ("ens18", "10.0.0.5/24")], None, "10.0.0.5"),
        ([("ens18", "10.0.0.9"), ("ens19", "10.0.0.5")], "10.0.0.5", "10.0.0.5"),
        # Not the expected address: the guest did not take its configuration (cloud-init
        # fell back to DHCP, as a real guest with an unparsable seed does); keep waiting.
        ([("ens18", "10.0.0.15")], "10.0.0.60", None),
        ([("cni0", "10.88.0.1"), ("veth1", "10.88.0.2")], None, None),
        ([("lo", "127.0.0.1")], None, None),
        ([("ens18", "not-an-ip")], None, None),
    ],
)
def test_pick_address_skips_what_does_not_reach_the_guest(
    interfaces: list[tuple[str, str]], expected: str | None, chosen: str | None
) -> None:
    want = ipaddress.IPv4Address(expected) if expected else None
    got = pick_address(interfaces, want)
    assert (str(got) if got else None) == chosen


async def test_the_inventory_outlives_the_bot_with_a_state_file(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    first = SimBackend(time_scale=0.001, state_file=state)
    ref = await cloned(first)
    await first.apply_identity(ref, IDENTITY)
    await first.power_on(ref)
    reserved = await first.prepare_clone(CloneSpec("jsim002", "vm2", "ubuntu-24.04"))
    # A clone that is still running when the bot dies...
    slow = SimBackend(time_scale=1.0, state_file=state)
    spec = CloneSpec("jsim003", "vm3", "ubuntu-24.04")
    slow_ref = await slow.prepare_clone(spec)
    task = asyncio.create_task(slow.clone(spec, slow_ref))
    await asyncio.wait({task}, timeout=0)
    task.cancel()
    await slow.close()
    # ...has finished on the hypervisor when the bot comes back.
    again = SimBackend(time_scale=0.001, state_file=state)
    vm = again.vms[ref.vm_id]
    assert vm.running and vm.booted.is_set() and vm.identity == IDENTITY
    assert again.vms[slow_ref.vm_id].lock is None
    fresh = await again.prepare_clone(CloneSpec("jsim004", "vm4", "ubuntu-24.04"))
    assert int(fresh.vm_id) > max(int(reserved.vm_id), int(slow_ref.vm_id))
    assert await again.wait_for_address(ref, None) == IDENTITY.address.ip


async def test_a_growth_under_way_at_a_kill_is_done_once(tmp_path: Path) -> None:
    """The growth finishes on the hypervisor while the bot is dead; the next life asks
    again (it cannot know) and the disk has grown once."""
    state = tmp_path / "sim.json"
    first = SimBackend(time_scale=1.0, state_file=state)
    ref = await cloned(first)  # ubuntu-24.04: a 4 GiB disk
    task = asyncio.create_task(first.grow_disk(ref, 3))
    await asyncio.wait({task}, timeout=0)
    assert first.vms[ref.vm_id].lock == "grow_disk"
    at_kill = tmp_path / "at-kill.json"  # the state file as the kill left it
    at_kill.write_bytes(state.read_bytes())
    task.cancel()
    await first.close()
    again = SimBackend(time_scale=0.001, state_file=at_kill)
    assert again.vms[ref.vm_id].disk_gib == 7
    await again.grow_disk(ref, 3)
    assert again.vms[ref.vm_id].disk_gib == 7
    assert ("grow_disk", ref.vm_id) not in again.task_log


async def test_an_outage_fault_takes_the_hypervisor_down_until_it_is_brought_back(
    tmp_path: Path,
) -> None:
    state = tmp_path / "sim.json"
    sim = SimBackend(time_scale=0.001, state_file=state)
    ref = await cloned(sim)
    sim.inject("power_on", "outage")
    with pytest.raises(Unreachable, match="simulated outage"):
        await sim.power_on(ref)
    assert not sim.vms[ref.vm_id].running  # refused before anything happened
    with pytest.raises(Unreachable):  # every call, not only the one that met it
        await sim.templates()
    state.with_suffix(".down").unlink()  # what a crash test does to bring it back
    await sim.power_on(ref)
    memory = SimBackend(time_scale=0.001)  # no state file: the flag goes down instead
    memory.inject("templates", "outage")
    with pytest.raises(Unreachable):
        await memory.templates()
    assert memory.down


async def test_addresses_in_use_and_a_hand_built_vm_outlive_the_bot(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    first = SimBackend(time_scale=0.001, state_file=state)
    ref = await cloned(first)
    await first.apply_identity(ref, IDENTITY)
    by_hand = first.add_vm("printer01", address=ipaddress.IPv4Address("10.0.0.92"), running=False)
    first.add_vm("nameless01")  # no address: nothing to list
    await first.close()
    again = SimBackend(time_scale=0.001, state_file=state)
    uses = {(str(u.address), u.vm_id, u.source) for u in await again.addresses_in_use()}
    assert uses == {
        (str(IDENTITY.address.ip), ref.vm_id, "identity"),
        ("10.0.0.92", by_hand, "configured"),
    }
    again.inject("addresses_in_use", "error")
    with pytest.raises(PermanentError):
        await again.addresses_in_use()
    again.down = True
    with pytest.raises(Unreachable):
        await again.addresses_in_use()
