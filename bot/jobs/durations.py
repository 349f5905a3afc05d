"""Handing backends what the job history knows about how long their steps take.

A backend that paces its waits by expected durations (Proxmox: backends/proxmox/pacing.py)
learns them from its own waits, but a fresh process (a `deploybot deploy` from the CLI,
a restarted bot) would start blind and poll fast. The store has every past step's
duration per backend, template and storage: at start each such backend gets the recent
ones. The backend decides what they mean for its waits; backends never read the store.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Mapping

from backends.abilities import LearnsDurations, StepTime
from backends.base import Backend
from store.db import Store

log = logging.getLogger(__name__)

# The steps whose duration is mostly a hypervisor wait (check_free and ssh are not).
PACED_STEPS = ("clone", "identity", "resize", "power_on", "address")
# Recent steps read per backend: enough for every template and storage in use, few
# enough that the read costs nothing at start.
RECENT = 2000


async def teach(store: Store, backends: Mapping[str, Backend]) -> None:
    """Give each backend that paces by history the recent step durations, newest first."""
    for name, backend in backends.items():
        if not isinstance(backend, LearnsDurations):
            continue
        try:
            rows = await store.jobs.step_durations(name, PACED_STEPS, RECENT)
        except sqlite3.Error:  # only an economy: never a reason not to start
            log.exception("%s: the recorded step durations could not be read", name)
            continue
        backend.remember_steps([StepTime(*row) for row in rows])
        log.debug("%s: %d recorded step durations handed to the backend", name, len(rows))
