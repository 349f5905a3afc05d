"""The simulator's state file, shared by every process on this host that names it.

Several processes use one Proxmox; so several processes (`deploybot serve`, `shell`, a
one-shot `deploy`) may use one simulator state file. Each keeps the VMs in memory and
the file is the hypervisor's truth:

* every change is a read-modify-write under an advisory lock (`fcntl.flock` on
  `<state_file>.lock` beside it): read the file, merge, change, write. So ids never
  collide and nobody's change is lost; the kernel releases the lock of a process that
  dies, so a SIGKILL blocks nobody;
* every call reads the file first (without the lock: the file is replaced whole), so a
  process sees the VMs the others made, changed or removed;
* the merge is three-way, field by field: what this process changed since it last saw
  the file is kept, everything else is taken from the file;
* a VM's task lock records its owner (pid and a token of this simulator); a lock whose
  owner is gone is a task that finished meanwhile, as it would on a real hypervisor.

The lock is held only to read, merge and write a small JSON file, synchronously on the
event loop (a simulator can afford that); the writes go to a uniquely named temporary
file that replaces the state file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def new_owner() -> str:
    """This simulator's name on the locks it takes: its pid and a token, since a
    restarted bot (in a container, always pid 1) may have its predecessor's pid."""
    return f"{os.getpid()}:{secrets.token_hex(6)}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child nobody has reaped yet is dead too
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def owner_alive(owner: str | None, me: str) -> bool:
    """Whether the task holding a lock still runs: ours, or another live process's.
    Another simulator in this process (a restart in a test) or our pid's predecessor
    is gone."""
    if owner is None:
        return False
    if owner == me:
        return True
    pid = owner.split(":", 1)[0]
    return pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid))


def settle(row: Row) -> Row | None:
    """A VM whose task's owner is gone: the task finished meanwhile (a destroy removed
    it; a power change took effect; a growth reached its target)."""
    lock = row["lock"]
    row = {**row, "lock": None, "lock_owner": None}
    if lock == "destroy":
        return None
    if lock in ("power_on", "power_off"):
        row["running"] = lock == "power_on"
    if lock == "grow_disk" and row.get("grow_target_gib") is not None:
        row["disk_gib"] = max(row["disk_gib"], row["grow_target_gib"])
    return row


@dataclass
class Snapshot:
    """The state as a file holds it: VMs and built templates by id."""

    next_id: int = 0
    vms: dict[str, Row] = field(default_factory=dict)
    built: dict[str, Row] = field(default_factory=dict)

    def to_json(self) -> str:
        data = {"next_id": self.next_id, "vms": list(self.vms.values())}
        return json.dumps({**data, "built": list(self.built.values())}, indent=1)


def merge(base: dict[str, Row], ours: dict[str, Row], theirs: dict[str, Row]) -> dict[str, Row]:
    """Three-way, by id and then by field: ours where it differs from `base` (what we
    last saw in the file), theirs elsewhere; a row added or removed on one side only
    is added or removed."""
    merged: dict[str, Row] = {}
    for key in sorted(base.keys() | ours.keys() | theirs.keys(), key=lambda k: (len(k), k)):
        b, o, t = base.get(key), ours.get(key), theirs.get(key)
        if o is not None and b is None:
            merged[key] = o  # we made it
        elif o is None and b is not None:
            continue  # we removed it
        elif o is None:
            if t is not None:
                merged[key] = t  # another process made it
        elif t is None:
            continue  # another process removed it
        else:
            assert b is not None
            merged[key] = {k: o[k] if o.get(k) != b.get(k) else t.get(k) for k in o}
    return merged


class SharedState:
    """The state file and its lock."""

    def __init__(self, path: Path, owner: str) -> None:
        self.path = path
        self.lock_path = path.with_suffix(".lock")
        self.owner = owner
        self.base = Snapshot()  # the file as this process last read or wrote it
        self._raw: bytes | None = None
        self._foreign_locks = False

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for one read-merge-write
            yield
        finally:
            os.close(fd)  # releases the lock (and the kernel does, for a dead process)

    def _read(self, *, unless_unchanged: bool = False) -> Snapshot | None:
        """The file with its finished tasks settled; None when there is no file, or
        (`unless_unchanged`) when it is as last seen and no other process held a lock."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        if unless_unchanged and raw == self._raw and not self._foreign_locks:
            return None
        self._raw = raw
        data = json.loads(raw)
        vms: dict[str, Row] = {}
        self._foreign_locks = False
        for row in data["vms"]:
            row.setdefault("lock_owner", None)
            if row["lock"] is not None and not owner_alive(row["lock_owner"], self.owner):
                settled = settle(row)
                if settled is None:
                    continue
                row = settled
            elif row["lock"] is not None and row["lock_owner"] != self.owner:
                self._foreign_locks = True
            vms[str(row["vm_id"])] = row
        built = {str(b["vm_id"]): b for b in data.get("built", [])}
        return Snapshot(int(data["next_id"]), vms, built)

    def sync(
        self, ours: Callable[[], Snapshot], *, unless_unchanged: bool = False
    ) -> tuple[Snapshot, Snapshot] | None:
        """Ours (as it was) and ours merged with the file (see `merge`), or None when
        there is nothing to merge (see `_read`). Under `locked()` for a change; without,
        to look."""
        disk = self._read(unless_unchanged=unless_unchanged)
        if disk is None:
            return None
        mine = ours()
        merged = Snapshot(
            max(mine.next_id, disk.next_id),
            merge(self.base.vms, mine.vms, disk.vms),
            merge(self.base.built, mine.built, disk.built),
        )
        self.base = disk
        return mine, merged

    def write(self, state: Snapshot) -> None:
        """Replace the file whole, under `locked()`: a reader never sees half of it, and
        each writer's temporary file is its own."""
        text = state.to_json()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._raw = text.encode()
        self.base = state
