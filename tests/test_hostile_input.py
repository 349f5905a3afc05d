"""Hostile input: any request text, and any garbage in the jobs table.

Requests: whatever anyone types is refused with a message, or stored and read back as it
was accepted; names and logins are ASCII before anything folds their case. Stored rows:
whatever another tool writes into `jobs`, start-up, history and status answer, at worst
with a `UserError` that says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from bot.config.settings import Settings
from bot.models import HOSTNAME_RE, Job, JobState
from bot.models.errors import RequestInvalid, UsageError, UserError
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from handlers.commands import answer
from handlers.messages.core import INTERNAL_ERROR
from store.db import Store
from store.jobs import job_row
from tests.support.deployer import SIM_SCALE, make_settings

ASCII_ADVICE = "use ASCII letters a-z, digits and hyphens"
SORRY = INTERNAL_ERROR.split(".")[0]  # what an unexpected exception says
# Characters that Unicode case folding or re.IGNORECASE turn into ASCII letters.
FOLDING = [
    "İnfra",
    "\u017ferver",
    "d\u0131sk01",
    "web\u212a",
    "ǅb",
    "ﬁle",
    "\uff37\uff25\uff2201",
    "web01\u200b",
]


def args(text: str) -> DeployArgs:
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return parsed


# Requests wait for an approver, so nothing changes a job between storing and reading it.
WAITING = {"approvers": ["bob"], "always": True}


def fresh_settings(base: Path, **overrides: Any) -> Settings:
    return make_settings(Path(tempfile.mkdtemp(dir=base)), **overrides)


async def deploy_text(settings: Settings, text: str) -> Job | None:
    """Request `text` as alice on a fresh store; the job as read back, or None if refused."""
    try:
        command = parse(text)
    except UsageError:
        return None
    if not isinstance(command, DeployArgs):
        return None
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(settings, backends={"sim": sim}) as d:
        try:
            job = await d.request_deploy(command, "alice")
        except UserError:
            assert await d.history(5) == []  # nothing was recorded
            return None
        stored = (await d.status(job.id)).job
        assert stored == job
        assert await d.history(5) == [job]
        return stored


@pytest.mark.parametrize("name", ["İnfra", "\u017ferver", "d\u0131sk01", "web\u212a"])
async def test_names_that_fold_to_ascii_are_refused(tmp_path: Path, name: str) -> None:
    settings = make_settings(tmp_path, approval=WAITING)
    with pytest.raises(RequestInvalid) as caught:
        build_request(args(f"{name} 10.0.0.64"), settings, "alice")
    text = str(caught.value)
    assert "is not an ASCII character" in text and ASCII_ADVICE in text
    assert f"U+{ord(next(c for c in name if not c.isascii())):04X}" in text
    assert await deploy_text(settings, f"{name} 10.0.0.64") is None


async def test_logins_and_keywords_are_ascii_too(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, approval=WAITING)
    with pytest.raises(RequestInvalid, match="user: '\u017fam' is not a valid login name"):
        build_request(args("web01 10.0.0.64 user=\u017fam"), settings, "alice")
    with pytest.raises(RequestInvalid, match="use ASCII lower-case letters"):
        build_request(args("web01 10.0.0.64 user=ubuntu\u0131"), settings, "alice")
    # The Kelvin sign lower-cases to k: it must not make "disk" or "key" out of words.
    with pytest.raises(UsageError, match="is not an option I know"):
        parse("web01 10.0.0.64 dis\u212a=+1G")
    assert args("\u212aey").name == "\u212aey"  # a (bad) VM name, not the `key` command
    with pytest.raises(UsageError, match="is not a job id"):
        parse("status j4k7tq\u0130")
    with pytest.raises(UsageError, match="give a size with a unit"):
        parse("web01 10.0.0.64 mem=4G\u0131b")
    # Upper-case ASCII is still fine, and stored lower-case.
    job = await deploy_text(settings, "WEB01 10.0.0.64")
    assert job is not None and job.name == "web01"


_NAMES = st.sampled_from([*FOLDING, "web01", "WEB-2", "-x", "a" * 64, "db"]) | st.text(
    min_size=1, max_size=12
).filter(lambda s: s.split() == [s] and "=" not in s)
_ADDRESSES = st.sampled_from(
    ["10.0.0.64", "10.0.0.65/24", "10.0.0.0", "10.0.0.1", "\u0661\u0660.0.0.5"]
)
_OPTIONS = st.lists(
    st.sampled_from(
        [
            "user=ubuntu",
            "user=\u017fam",
            "user=Root",
            "mem=4G",
            "mem=4G\u0131b",
            "cpu=2",
            "template=debian-12",
            "template=debiän-12",
            "storage=local",
            "on=sim",
            "on=node1",
            "upgrade=yes",
            "upgrade=\u0130",
            "disk=+1G",
        ]
    ),
    max_size=3,
    unique=True,
)
_REQUESTS = st.text() | st.builds(
    lambda name, address, options: " ".join([name, address, *options]),
    _NAMES,
    _ADDRESSES,
    _OPTIONS,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_REQUESTS)
def test_any_request_is_refused_or_stored_unchanged(tmp_path: Path, text: str) -> None:
    job = asyncio.run(deploy_text(fresh_settings(tmp_path, approval=WAITING), text))
    if job is None:
        return
    typed = text.split()[0]
    assert typed.isascii() and job.name == typed.lower() == job.request.name
    assert HOSTNAME_RE.fullmatch(job.name)
    assert job.request.user.isascii()
    assert job.state is JobState.AWAITING_APPROVAL


# --- garbage in the jobs table ----------------------------------------------------

_GARBAGE_TEXT = st.text(max_size=30) | st.sampled_from(["", "null", "{}", "[]", "İnfra"])
_COLUMN_GARBAGE: dict[str, st.SearchStrategy[Any]] = {
    "id": _GARBAGE_TEXT | st.sampled_from(["jabcdef", "jİnfra01", "j" + "z" * 50]),
    "state": _GARBAGE_TEXT | st.sampled_from([s.value for s in JobState]),
    "name": _GARBAGE_TEXT | st.sampled_from(FOLDING),
    "address": _GARBAGE_TEXT,
    "request": _GARBAGE_TEXT | st.just('{"name": '),
    "created_at": _GARBAGE_TEXT | st.just("2025-02-30T00:00:00.000000Z"),
    "vm_id": _GARBAGE_TEXT,
    "wreckage": _GARBAGE_TEXT,
    "started_at": _GARBAGE_TEXT,
}


@st.composite
def damaged_rows(draw: st.DrawFn, settings: Settings) -> dict[str, Any]:
    number = draw(st.integers(min_value=10, max_value=250))
    parsed = parse(f"vm{number} 10.0.0.{number}")
    assert isinstance(parsed, DeployArgs)
    state = draw(st.sampled_from(list(JobState)))
    row = job_row(Job.for_request(build_request(parsed, settings, "alice"), state))
    damaged = draw(st.sets(st.sampled_from(sorted(_COLUMN_GARBAGE)), max_size=3))
    for column in damaged:
        row[column] = draw(_COLUMN_GARBAGE[column])
    if "request" not in damaged and draw(st.booleans()):
        # A request that is JSON, but holds a name folded by lower() (what names that were
        # not ASCII left behind), with the name column to match.
        request = json.loads(row["request"])
        request["name"] = row["name"] = draw(st.sampled_from(FOLDING)).lower()
        row["request"] = json.dumps(request)
    return row


def write_rows(settings: Settings, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Insert the rows another tool might; those the schema itself refuses are left out."""
    asyncio.run(_create_schema(settings))
    written = []
    conn = sqlite3.connect(settings.database, isolation_level=None)
    try:
        for row in rows:
            columns = ", ".join(row)
            marks = ", ".join("?" for _ in row)
            with contextlib.suppress(sqlite3.IntegrityError):
                conn.execute(f"INSERT INTO jobs ({columns}) VALUES ({marks})", list(row.values()))
                written.append(row)
    finally:
        conn.close()
    return written


async def _create_schema(settings: Settings) -> None:
    await (await Store.open(settings.database)).close()


async def start_and_read(settings: Settings, rows: list[dict[str, Any]]) -> None:
    sim = SimBackend("sim", time_scale=SIM_SCALE)
    async with running_deployer(settings, backends={"sim": sim}, grace_s=5) as d:
        listed = await d.history(100)
        for row in rows:
            ref = row["id"] if isinstance(row["id"], str) else ""
            with contextlib.suppress(UserError):
                info = await d.status(ref)
                assert info.job in listed or info.job.state is not JobState.SUCCEEDED
            said = await answer(d, "alice", f"status {ref}")
            assert not any(SORRY in line for line in said)
        await d.drain()
        records = await d.store.jobs.quarantine_records()
        # Every row reads as a job, or was quarantined once, with its reason.
        for row in rows:
            ref = row["id"]
            if not isinstance(ref, str) or not ref or row["state"] == "quarantined":
                continue  # named by rowid in the quarantine / a state it was given by hand
            if await d.store.jobs.get(ref) is not None:
                continue
            found = [r for r in records if r.table == "jobs" and r.key == ref]
            assert len(found) == 1 and found[0].reason and found[0].job_id == ref


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_garbage_rows_never_stop_start_history_or_status(
    tmp_path: Path, data: st.DataObject
) -> None:
    settings = fresh_settings(tmp_path)
    rows = data.draw(st.lists(damaged_rows(settings), min_size=1, max_size=4))
    written = write_rows(settings, rows)
    asyncio.run(start_and_read(settings, written))
