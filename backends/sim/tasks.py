"""How the simulated hypervisor answers a call: whether it is up at all, the fault
planned for the call (`SimBackend.inject`), and the hypervisor-side task a change runs.

A task takes scaled time and holds the VM's lock until it ends, even when nobody waits
for it any more; a planned fault makes one call fail, hang or crash the way the real
systems do (see backends/sim/__init__.py's docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from backends.base import PermanentError, RetryableError, Unreachable, VMNotFound
from backends.sim.inventory import Inventory
from backends.sim.vm import OPERATIONS, Effect, Fault, FaultKind, SimulatedCrash


class Tasks:
    """The simulator's calls and tasks, on the VMs of `inventory`."""

    def __init__(self, name: str, inventory: Inventory, time_scale: float) -> None:
        self.name = name
        self.inventory = inventory
        self.time_scale = time_scale
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str]] = []  # (operation, VM id) of each call that acted
        self.down = False
        self._running: set[asyncio.Task[None]] = set()

    def inject(self, op: str, kind: FaultKind, times: int = 1) -> None:
        if op not in OPERATIONS:
            raise ValueError(f"unknown operation {op!r}; one of {', '.join(OPERATIONS)}")
        self.faults.append(Fault(op, kind, times))

    def answer(self) -> None:
        """Every API call starts here: a simulator that is down refuses the connection.

        Tests set `down`; a process outside (the crash tests) creates the file
        `<state_file>.down`; an `outage` fault does one or the other.
        """
        down_file = self._down_file()
        if self.down or (down_file is not None and down_file.exists()):
            raise Unreachable(f"{self.name}: connection refused (simulated outage)")
        self.inventory.pull()  # what other processes on the state file did

    def _down_file(self) -> Path | None:
        state_file = self.inventory.state_file
        return state_file.with_suffix(".down") if state_file else None

    def fault(self, op: str, vm_id: str = "") -> FaultKind | None:
        """Take the fault planned for this call; a flaky one fails it right here."""
        kind: FaultKind | None = None
        for fault in self.faults:
            if fault.op == op and fault.times > 0:
                fault.times -= 1
                kind = fault.kind
                break
        if kind == "flaky":
            raise RetryableError(
                f"{self.name} did not answer {op} (simulated)", vm_id=vm_id or None
            )
        if kind == "outage":  # down from here on, for every call
            down_file = self._down_file()
            if down_file is not None:
                down_file.touch()
            else:
                self.down = True
            self.answer()
        return kind

    async def query_fault(self, op: str, vm_id: str = "") -> FaultKind | None:
        """A query has no work to do: its planned fault acts at once (the kinds that
        change its answer, such as ``impostor``, are returned for the query to act on)."""
        fault = self.fault(op, vm_id)
        self.log.append((op, vm_id))
        if fault == "hang":
            await asyncio.Event().wait()  # the answer never comes; the caller's timeout ends this
        if fault == "error":
            raise PermanentError(
                f"{op} failed: simulated error on {self.name}", vm_id=vm_id or None
            )
        if fault == "crash":
            raise SimulatedCrash(f"simulated crash in {op}")
        return fault

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.time_scale)

    @contextlib.contextmanager
    def watching(self, *events: asyncio.Event) -> Iterator[Watch]:
        """A `Watch` of `events` (scaled as this simulator's time), stopped on leaving."""
        watch = Watch(events, self.time_scale)
        try:
            yield watch
        finally:
            watch.close()

    async def run(
        self, op: str, vm_id: str, seconds: float, effect: Effect, fault: FaultKind | None
    ) -> None:
        """Run one hypervisor-side task and wait for it the way a real client would.

        The task holds the VM's lock until it ends, even when nobody waits for it any
        more: a caller that gave up must not act on the VM until the task is over.
        """
        self.log.append((op, vm_id))
        inventory = self.inventory
        with inventory.transaction():  # the lock taken on the VM as the file has it now
            vm = inventory.vms.get(vm_id)
            if vm is None:
                raise VMNotFound(f"VM {vm_id} does not exist", vm_id=vm_id)
            if vm.lock and vm.lock_owner != inventory.owner:  # another process's task
                raise RetryableError(f"VM {vm_id} is locked ({vm.lock})", vm_id=vm_id)
            if not vm.lock:
                vm.lock, vm.lock_owner = op, inventory.owner

        async def task() -> None:
            try:
                await self.sleep(seconds)
                if fault == "error":
                    effect.fail()
                    raise PermanentError(f"{op} failed: simulated error on VM {vm_id}", vm_id=vm_id)
                effect.apply()
            finally:
                vm.lock = vm.lock_owner = None
                inventory.save()

        hv_task = asyncio.create_task(task())
        self._running.add(hv_task)
        hv_task.add_done_callback(self._running.discard)
        if fault == "hang":
            await asyncio.Event().wait()
        await asyncio.shield(hv_task)
        if fault == "crash":
            raise SimulatedCrash(f"simulated crash after {op} on VM {vm_id}")

    def cancel(self) -> None:
        """Stop the tasks still running (the simulator is closed)."""
        for task in list(self._running):
            task.cancel()


class Watch:
    """Waits, again and again, until one of its events is set or a time passes. The
    guest agent's answer changes only when the guest boots or stops, so the simulator
    waits for that rather than waking every poll; the timeout still notices an outage.
    (Polling alone cost the event loop more than the bot at 200 deploys:
    bench_pipeline.) Each event's wait is kept from one poll to the next, made again
    only once it has ended: a new pair of tasks at every poll, each cancelled after it,
    was most of what a deploy's wait for its address cost the event loop."""

    def __init__(self, events: Sequence[asyncio.Event], time_scale: float) -> None:
        self._events = tuple(events)
        self._time_scale = time_scale
        self._waits: list[asyncio.Future[Literal[True]] | None] = [None] * len(self._events)

    async def until(self, seconds: float) -> None:
        """Until one of the events is set, or `seconds` (scaled) pass."""
        for i, event in enumerate(self._events):
            wait = self._waits[i]
            if wait is None or wait.done():
                self._waits[i] = asyncio.ensure_future(event.wait())
        waits = [wait for wait in self._waits if wait is not None]
        await asyncio.wait(
            waits, timeout=seconds * self._time_scale, return_when=asyncio.FIRST_COMPLETED
        )

    def close(self) -> None:
        for wait in self._waits:
            if wait is not None:
                wait.cancel()
