"""Fast settings on real SQLite files, a Progress that records what it is told, and
one deploy run to its end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bot.app.service import Deployer
from bot.config.settings import BUNDLED_CONFIG, Settings, load_settings
from bot.models import Job, JobState, RollbackReport
from bot.requests.grammar import parse

FAST_TIMEOUTS = {
    "check_free_s": 0.5,
    "clone_s": 0.5,
    "identity_s": 0.5,
    "resize_s": 0.5,
    "power_on_s": 0.5,
    "address_s": 0.5,
    "ssh_s": 0.5,
    "power_off_s": 0.5,
    "destroy_s": 0.5,
    "retry_initial_s": 0.001,
    "retry_max_s": 0.01,
}


SIM_SCALE = 0.001

TEST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHb2vLw3m3tqB7m4m1Lr2x9n0l3r3x8uGk2ycJ0b1Fq8 test"


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    tmp_path.mkdir(parents=True, exist_ok=True)  # the log's folder must exist
    data: dict[str, Any] = {
        "database": str(tmp_path / "jobs.db"),
        "log_file": str(tmp_path / "bot.log"),
        "backends": [{"kind": "sim", "name": "sim", "time_scale": SIM_SCALE}],
        "timeouts": FAST_TIMEOUTS,
        "approval": {"approvers": ["bob", "carol"]},
    }
    data.update(overrides)
    # A deploy needs a way to log in (bot.requests.admission.check_login): tests have a key.
    data["defaults"] = {"ssh_keys": [TEST_KEY], **data.get("defaults", {})}
    return load_settings(BUNDLED_CONFIG, **data)


@dataclass
class Recorder:
    """A Progress that keeps what it is told, and can act when a step starts."""

    updates: list[tuple[str, JobState, str]] = field(default_factory=list)
    steps: list[tuple[str, str, str]] = field(default_factory=list)
    finished: dict[str, tuple[Job, RollbackReport | None]] = field(default_factory=dict)
    notes: list[tuple[str, str]] = field(default_factory=list)
    on_step: Callable[[Job, str], Any] | None = None
    step_seen: dict[str, asyncio.Event] = field(default_factory=dict)

    def seen(self, step: str) -> asyncio.Event:
        return self.step_seen.setdefault(step, asyncio.Event())

    async def job_updated(self, job: Job, note: str = "") -> None:
        self.updates.append((job.id, job.state, note))

    async def step_started(self, job: Job, step: str, detail: str) -> None:
        self.steps.append((job.id, step, "started"))
        self.seen(step).set()
        if self.on_step is not None:
            result = self.on_step(job, step)
            if asyncio.iscoroutine(result):
                await result

    async def step_finished(
        self, job: Job, step: str, duration_s: float, ok: bool, detail: str
    ) -> None:
        self.steps.append((job.id, step, "ok" if ok else "failed"))

    async def job_finished(self, job: Job, rollback: RollbackReport | None) -> None:
        self.finished[job.id] = (job, rollback)

    async def job_note(self, job: Job, text: str) -> None:
        self.notes.append((job.id, text))


REQUEST = "web01 10.0.0.50 disk=+10G"


async def deploy(deployer: Deployer, text: str = REQUEST) -> Job:
    job = await deployer.request_deploy(parse(text), "alice")  # type: ignore[arg-type]
    await deployer.drain()
    final = (await deployer.status(job.id)).job
    assert final.state.final
    return final
