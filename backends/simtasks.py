"""The simulator's hypervisor-side tasks and planned faults (split from backends/sim.py).

A task takes scaled time and holds the VM's lock until it ends, even when nobody waits
for it any more; a planned fault (`SimBackend.inject`) makes one call fail, hang or
crash the way the real systems do (see backends/sim.py's docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

from backends.base import PermanentError, RetryableError, Unreachable, VMNotFound
from backends.simvm import Effect, Fault, FaultKind, SimulatedCrash, SimVM


class SimTasks:
    """Mixed into `SimBackend`: the attributes below are the simulator's."""

    name: str
    vms: dict[str, SimVM]
    down: bool
    state_file: Path | None
    faults: list[Fault]
    task_log: list[tuple[str, str]]
    time_scale: float
    _tasks: set[asyncio.Task[None]]
    _owner: str

    def _save(self) -> None:
        raise NotImplementedError  # SimBackend writes its state file

    def _pull(self) -> None:
        raise NotImplementedError  # SimBackend reads its state file

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        raise NotImplementedError  # SimBackend changes its state file
        yield

    def _answer(self) -> None:
        """Every API call starts here: a simulator that is down refuses the connection.

        Tests set `down`; a process outside (the crash tests) creates the file
        `<state_file>.down`; an `outage` fault does one or the other.
        """
        down_file = self._down_file()
        if self.down or (down_file is not None and down_file.exists()):
            raise Unreachable(f"{self.name}: connection refused (simulated outage)")
        self._pull()  # what other processes on the state file did

    def _down_file(self) -> Path | None:
        return self.state_file.with_suffix(".down") if self.state_file else None

    def _fault(self, op: str, vm_id: str = "") -> FaultKind | None:
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
            self._answer()
        return kind

    async def _query_fault(self, op: str, vm_id: str = "") -> None:
        fault = self._fault(op, vm_id)
        self.task_log.append((op, vm_id))
        if fault == "hang":
            await asyncio.Event().wait()  # the answer never comes; the caller's timeout ends this
        if fault == "error":
            raise PermanentError(
                f"{op} failed: simulated error on {self.name}", vm_id=vm_id or None
            )
        if fault == "crash":
            raise SimulatedCrash(f"simulated crash in {op}")

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.time_scale)

    async def _either(self, first: asyncio.Event, second: asyncio.Event, seconds: float) -> None:
        """Until either event is set, or `seconds` (scaled) pass. The guest agent's
        answer changes only when the guest boots or stops, so the simulator waits for
        that rather than waking every poll; the timeout still notices an outage. (Polling
        alone cost the event loop more than the bot at 200 deploys: bench_pipeline.)"""
        waits = [asyncio.ensure_future(first.wait()), asyncio.ensure_future(second.wait())]
        try:
            await asyncio.wait(
                waits, timeout=seconds * self.time_scale, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for wait in waits:
                wait.cancel()

    async def _run(
        self, op: str, vm_id: str, seconds: float, effect: Effect, fault: FaultKind | None
    ) -> None:
        """Run one hypervisor-side task and wait for it the way a real client would.

        The task holds the VM's lock until it ends, even when nobody waits for it any
        more: a caller that gave up must not act on the VM until the task is over.
        """
        self.task_log.append((op, vm_id))
        with self._transaction():  # the lock taken on the VM as the file has it now
            vm = self.vms.get(vm_id)
            if vm is None:
                raise VMNotFound(f"VM {vm_id} does not exist", vm_id=vm_id)
            if vm.lock and vm.lock_owner != self._owner:  # another process's task
                raise RetryableError(f"VM {vm_id} is locked ({vm.lock})", vm_id=vm_id)
            if not vm.lock:
                vm.lock, vm.lock_owner = op, self._owner

        async def task() -> None:
            try:
                await self._sleep(seconds)
                if fault == "error":
                    effect.fail()
                    raise PermanentError(f"{op} failed: simulated error on VM {vm_id}", vm_id=vm_id)
                effect.apply()
            finally:
                vm.lock = vm.lock_owner = None
                self._save()

        hv_task = asyncio.create_task(task())
        self._tasks.add(hv_task)
        hv_task.add_done_callback(self._tasks.discard)
        if fault == "hang":
            await asyncio.Event().wait()
        await asyncio.shield(hv_task)
        if fault == "crash":
            raise SimulatedCrash(f"simulated crash after {op} on VM {vm_id}")
