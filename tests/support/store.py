"""Stores for the store's contract on both engines (SQLite, PostgreSQL), a job to put in
them, a SQL trace, a running job to finish, and a second process holding SQLite's lock."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bot.config.settings import Settings
from bot.jobs import progress as tell
from bot.models import Job, JobEvent, JobState
from bot.requests.grammar import parse
from bot.requests.validation import build_request
from store.db import Store
from store.sql import Db, SqliteDb
from tests.support.postgres import PASSWORD_ENV


def trace(db: Db, callback: Callable[[str], object] | None) -> None:
    assert isinstance(db, SqliteDb)
    db.conn.set_trace_callback(callback)


def make_job(
    settings: Settings,
    name: str = "web01",
    address: str = "10.0.0.50",
    requester: str = "alice",
    state: JobState = JobState.QUEUED,
) -> Job:
    args = parse(f"{name} {address}")
    request = build_request(args, settings, requester)  # type: ignore[arg-type]
    return Job.for_request(request, state)


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The contract runs on both stores: a SQLite file, and a PostgreSQL database."""
    if request.param == "postgres":
        url = request.getfixturevalue("pg_url")
        s = await Store.open(url, password=os.environ[PASSWORD_ENV])
    else:
        s = await Store.open(tmp_path / "jobs.db")
    yield s
    await s.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path):  # type: ignore[no-untyped-def]
    """For what only SQLite does (one writer thread batching the writes of a moment)."""
    s = await Store.open(tmp_path / "jobs.db")
    yield s
    await s.close()


async def running_job(store: Store, settings: Settings) -> Job:
    job = make_job(settings, state=JobState.RUNNING).model_copy(update={"origin": "C0123"})
    return await store.jobs.insert(job)


async def finish(store: Store, job: Job) -> bool:
    """The write under test: a state change with its event and its notice."""
    event = JobEvent(job_id=job.id, step="ssh", phase="finished", duration_s=1.0)
    return await store.jobs.transition(
        job.id,
        [JobState.RUNNING],
        JobState.SUCCEEDED,
        notices=[tell.finished(job.id, None)],
        events=[event],
    )


@contextmanager
def held(path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds `path`'s write lock inside the block."""
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.support.workers.sqlite_holder", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "holding\n"
        yield holder
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "released\n"
    finally:
        holder.kill()
        holder.wait()
