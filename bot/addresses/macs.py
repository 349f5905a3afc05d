"""Fixed MAC addresses (`mac=`, `macN=`): whether another VM on the backend has one.

Our own jobs' fixed MACs are unique in the store (`job_addresses`, checked by the job's
insert); a VM built by hand is found only by asking the backend, through its ability to
list every VM's MACs (`KnowsMacs`). A backend without it is not asked: the hypervisor
itself is left to refuse a duplicate where it does (vSphere's manual MAC).
"""

from __future__ import annotations

from backends.abilities import KnowsMacs
from backends.base import Backend
from bot.models import DeployRequest


async def mac_conflict(backend: Backend, request: DeployRequest) -> str | None:
    """Which fixed MAC of the request a VM on its backend has, and which VM (None:
    none, or nothing fixed, or a backend that cannot say)."""
    if not request.macs or not isinstance(backend, KnowsMacs):
        return None
    used = await backend.macs_in_use()
    for mac in request.macs:
        if mac in used:
            return f"the MAC {mac} is used by VM {used[mac]} on {request.backend}"
    return None
