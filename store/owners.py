"""Who runs which job: runners, their heartbeats, and their claims on jobs.

Every process that runs jobs is a *runner* with a row here. A job is run by the runner
that claimed it: `owner` and `lease_until` (the claim's end: the column keeps its old
name) on the job, written by one compare-and-set (an UPDATE that names what it
expects), so of two processes claiming the same job exactly one gets it. The owner
renews its claims while it lives; another process may take a job over only once its
claim has lapsed. (A VM's *lease*, how long it may live, is another thing: leases.py.)
Times are given by the caller (the bot's injected clock), as fixed-width UTC text, so
text order is time order.

These functions run on the store's worker thread (store/db.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from bot.models import Job, JobState
from bot.models.builds import BUILD_KIND
from store.jobs import SELECT_JOBS, listing
from store.sql import Db, immediate
from store.tx import ts

# States in which a job has an owner: reserved by it (queued) or being worked on (a
# deploy, its rollback, or a destroy: bot/kinds/deploy/destroy.py).
_OWNED = ("queued", "running", "rolling_back", "destroying")
_OWNED_SQL = "('queued', 'running', 'rolling_back', 'destroying')"
_BUILDS_OWNED_SQL = "('queued', 'running', 'rolling_back')"
# A claim that is NULL, or before now, has lapsed; so has one of a dead runner.
_LAPSED = "(lease_until IS NULL OR lease_until < :now)"
RUNNERS_KEPT_DAYS = 7


@dataclass(frozen=True)
class RunnerRow:
    id: str
    kind: str  # serve | shell | deploy ...: shown to operators, never decides anything
    host: str  # hostname, boot and pid namespace: where `pid` means this process
    pid: int
    proc_start: str  # the process's start time there: a reused pid is another process
    started_at: datetime
    claims_until: datetime  # column runners.lease_until: its claims' renewal


@dataclass(frozen=True)
class Owned:
    """A job this runner holds, as a renewal found it."""

    job_id: str
    state: JobState
    cancel_requested: str | None
    local: bool = True  # run by a task in this process (renew's `local`)
    epoch: int = 0  # its claim epoch (jobs; a build's is always 0): still this claim?
    kind: str = "deploy"  # its kind (bot/kinds/): a job's column, or its table's


def installation_id(db: Db) -> str:
    rows = list(db.query("SELECT value FROM meta WHERE key = 'installation_id'"))
    return str(rows[0]["value"])


def register(db: Db, runner: RunnerRow) -> None:
    row = {
        "id": runner.id,
        "kind": runner.kind,
        "host": runner.host,
        "pid": runner.pid,
        "proc_start": runner.proc_start,
        "started_at": ts(runner.started_at),
        "heartbeat_at": ts(runner.started_at),
        "lease_until": ts(runner.claims_until),
    }
    # Every CLI run is a runner: forget those long gone, or the table only grows.
    forgotten = ts(runner.started_at - timedelta(days=RUNNERS_KEPT_DAYS))
    with immediate(db):
        db.execute("DELETE FROM runners WHERE lease_until < ?", [forgotten])
        db.insert("runners", [row])


def _ids(prefix: str, ids: Collection[str], params: dict[str, Any]) -> str:
    """Placeholders for `ids` (added to `params`): "(:p0, :p1 ...)", or "(NULL)" for
    none, which matches nothing on either database."""
    marks = []
    for i, value in enumerate(sorted(ids)):
        params[f"{prefix}{i}"] = value
        marks.append(f":{prefix}{i}")
    return f"({', '.join(marks) or 'NULL'})"


def renew_claims(
    db: Db,
    runner_id: str,
    now: datetime,
    until: datetime,
    local: Collection[str] = (),
    pending: Collection[str] = (),
) -> list[Owned]:
    """Extend this runner's claim and its claims on the jobs and builds it runs now;
    everything it holds, each marked whether it runs here.

    `local` names the jobs and builds with a live task in this process (a template
    build's smoke deploy, run inside the build's task, counts as local with it);
    `pending` those the caller is still deciding about (held, no task seen yet): their
    claims are renewed too, but they are not marked local. Any other job or build this
    runner holds keeps its claim as it is and comes back marked not local, for the
    caller to finish or `hand_back`. One transaction, a fixed number of statements
    whatever the number of jobs: renewal must stay cheap with hundreds in flight. A job
    missing from the answer is no longer ours (cancelled while queued, or taken over
    after our claim lapsed).
    """
    params: dict[str, Any] = {"me": runner_id, "now": ts(now), "until": ts(until)}
    here = _ids("l", local, params)
    kept = _ids("p", set(pending) - set(local), params)
    smoke = (
        f"SELECT smoke_job FROM builds WHERE owner = :me AND smoke_job IS NOT NULL AND id IN {here}"
    )
    runs_here = f"(id IN {here} OR id IN ({smoke}))"
    with immediate(db):
        db.execute(
            "UPDATE runners SET heartbeat_at = :now, lease_until = :until WHERE id = :me",
            params,
        )
        db.execute(
            f"UPDATE jobs SET lease_until = :until WHERE owner = :me AND state IN {_OWNED_SQL} "
            f"AND ({runs_here} OR id IN {kept})",
            params,
        )
        # Template builds this runner runs (store/builds.py).
        db.execute(
            "UPDATE builds SET lease_until = :until WHERE owner = :me "
            f"AND state IN {_BUILDS_OWNED_SQL} AND (id IN {here} OR id IN {kept})",
            params,
        )
        # Commands this runner took from chat and is still carrying out (store/inbox.py).
        db.execute("UPDATE inbox SET until = :until WHERE holder = :me AND done_at IS NULL", params)
        rows = db.execute(
            f"SELECT id, state, cancel_requested, CASE WHEN {runs_here} THEN 1 ELSE 0 END, "
            f"claim_epoch, kind FROM jobs WHERE owner = :me AND state IN {_OWNED_SQL}",
            params,
        ).fetchall()
        # Builds held here (their states are spelled as jobs'): a cancel asked elsewhere.
        rows += db.execute(
            "SELECT id, state, cancel_requested, "
            f"CASE WHEN id IN {here} THEN 1 ELSE 0 END, 0, '{BUILD_KIND}' FROM builds "
            f"WHERE owner = :me AND state IN {_BUILDS_OWNED_SQL}",
            params,
        ).fetchall()
    return [
        Owned(row[0], JobState(row[1]), row[2], bool(row[3]), int(row[4]), str(row[5]))
        for row in rows
    ]


def claim_of(db: Db, job_id: str) -> tuple[str | None, int] | None:
    """The job's owner and claim epoch, as a step's fence asks them (bot/ownership/claims.py
    `hold`): two columns of one row, not the whole job; None when there is no such job
    (or it is quarantined: never run)."""
    (claim,) = claims_of(db, [job_id])
    return claim


def claims_of(db: Db, job_ids: Sequence[str]) -> list[tuple[str | None, int] | None]:
    """`claim_of` for many jobs in one statement, one answer per id, in order: the fences
    of the deploys that begin a step together ask in the same moment (`Runners.claim_of`
    merges them)."""
    found: dict[str, tuple[str | None, int]] = {}
    unique = sorted(set(job_ids))
    for at in range(0, len(unique), 500):  # within every SQLite's limit of parameters
        params: dict[str, Any] = {}
        which = _ids("j", unique[at : at + 500], params)
        rows = db.query(
            f"SELECT id, owner, claim_epoch FROM jobs WHERE id IN {which} "
            "AND state <> 'quarantined'",
            params,
        )
        for row in rows:
            found[str(row["id"])] = (row["owner"], int(row["claim_epoch"]))
    return [found.get(job_id) for job_id in job_ids]


def hand_back(db: Db, runner_id: str, ids: Collection[str]) -> int:
    """Give up jobs and builds this runner holds but no longer runs (their task ended
    without a final state): their claims end now, so a runner (this one too) takes
    them over and recovers them at its next look, as it would a dead runner's; queued
    ones go back to anyone. Returns how many were handed back."""
    params: dict[str, Any] = {"me": runner_id}
    which = _ids("h", ids, params)
    with immediate(db):
        handed = db.execute(
            "UPDATE jobs SET lease_until = NULL, "
            "owner = CASE WHEN state = 'queued' THEN NULL ELSE owner END "
            f"WHERE owner = :me AND state IN {_OWNED_SQL} AND id IN {which}",
            params,
        ).rowcount
        handed += db.execute(
            "UPDATE builds SET lease_until = NULL, "
            "owner = CASE WHEN state = 'queued' THEN NULL ELSE owner END "
            f"WHERE owner = :me AND state IN {_BUILDS_OWNED_SQL} AND id IN {which}",
            params,
        ).rowcount
    return int(handed)


def claim(
    db: Db,
    job_id: str,
    runner_id: str,
    now: datetime,
    until: datetime,
    states: Collection[JobState] = (JobState.QUEUED,),
) -> int | None:
    """Make this runner the job's owner if it is in `states` and nobody else holds it
    (no owner, or a lapsed claim); the claim's epoch (one more than the last claim's),
    or None when it was not claimed. One statement: two claimers, one winner."""
    wanted = tuple(s.value for s in states)
    marks = ", ".join(f":s{i}" for i in range(len(wanted)))
    params: dict[str, Any] = {"id": job_id, "me": runner_id, "now": ts(now), "until": ts(until)}
    params.update({f"s{i}": s for i, s in enumerate(wanted)})
    with immediate(db):
        rows = db.query(
            "UPDATE jobs SET owner = :me, lease_until = :until, claim_epoch = claim_epoch + 1 "
            f"WHERE id = :id AND state IN ({marks}) "
            f"AND (owner IS NULL OR owner = :me OR {_LAPSED}) RETURNING claim_epoch",
            params,
        )
    return int(rows[0]["claim_epoch"]) if rows else None


def claim_queued(
    db: Db, runner_id: str, now: datetime, until: datetime, limit: int
) -> list[tuple[str, str]]:
    """Claim up to `limit` queued jobs that nobody holds, oldest first, in one statement;
    (id, backend) of those now this runner's. On PostgreSQL, rows that another replica
    is claiming at this moment are skipped rather than waited for (FOR UPDATE SKIP
    LOCKED): replicas looking together take different jobs. SQLite has one writer at a
    time, so there nothing is ever being claimed by another at the same moment."""
    skip = " FOR UPDATE SKIP LOCKED" if db.dialect == "postgres" else ""
    params = {"me": runner_id, "now": ts(now), "until": ts(until), "limit": limit}
    with immediate(db):
        rows = db.query(
            "UPDATE jobs SET owner = :me, lease_until = :until, claim_epoch = claim_epoch + 1 "
            "WHERE id IN (SELECT id FROM jobs WHERE state = 'queued' "
            f"AND (owner IS NULL OR {_LAPSED}) ORDER BY created_at, rowid LIMIT :limit{skip}) "
            "RETURNING id, backend, created_at, rowid",
            params,
        )
        rows.sort(key=lambda row: (row["created_at"], row["rowid"]))
        claimed = [(str(row["id"]), str(row["backend"])) for row in rows]
        # Template builds approved (or handed back) with nobody holding them: a runner
        # that approved one and died before running it, say (store/builds.py).
        if len(claimed) < limit:
            builds = db.query(
                "UPDATE builds SET owner = :me, lease_until = :until WHERE id IN ("
                f"SELECT id FROM builds WHERE state = 'queued' AND (owner IS NULL OR {_LAPSED}) "
                f"ORDER BY created_at, id LIMIT :limit{skip}) "
                "RETURNING id, backend, created_at",
                {**params, "limit": limit - len(claimed)},
            )
            builds.sort(key=lambda row: (row["created_at"], row["id"]))
            claimed += [(str(row["id"]), str(row["backend"])) for row in builds]
    return claimed


def abandoned(db: Db, now: datetime) -> list[Job]:
    """Jobs being worked on whose owner's claim has lapsed (the owner died or hangs)."""
    return listing(
        db,
        f"{SELECT_JOBS} WHERE state IN ('running', 'rolling_back', 'destroying') AND {_LAPSED} "
        "ORDER BY created_at, rowid",
        {"now": ts(now)},
    )


def registered(db: Db, runner_ids: Collection[str]) -> set[str]:
    """Which of these runners have a row that does not say they stopped: those that may
    be alive (a runner with no row, or one that stopped or was declared dead, is not)."""
    params: dict[str, Any] = {}
    which = _ids("r", runner_ids, params)
    rows = db.execute(
        f"SELECT id FROM runners WHERE stopped_at IS NULL AND id IN {which}", params
    ).fetchall()
    return {str(row[0]) for row in rows}


def release(db: Db, runner_id: str, now: datetime) -> int:
    """A runner leaving in good order: its queued jobs go back to anyone; its own row
    says it stopped. Returns how many queued jobs were handed back."""
    params = {"me": runner_id, "now": ts(now)}
    with immediate(db):
        handed = db.execute(
            "UPDATE jobs SET owner = NULL, lease_until = NULL "
            "WHERE owner = :me AND state = 'queued'",
            params,
        ).rowcount
        handed += db.execute(
            "UPDATE builds SET owner = NULL, lease_until = NULL "
            "WHERE owner = :me AND state = 'queued'",
            params,
        ).rowcount
        db.execute(
            "UPDATE runners SET stopped_at = :now, lease_until = :now WHERE id = :me", params
        )
        db.execute("DELETE FROM outbox_claims WHERE holder = :me", params)
        db.execute("UPDATE inbox SET until = '' WHERE holder = :me AND done_at IS NULL", params)
    return int(handed)


def live_on_host(db: Db, host: str) -> list[tuple[str, int, str]]:
    """(id, pid, proc_start) of runners on this host not known to have stopped, whatever
    their claim: one whose claim lapsed may still be alive (paused by an outage), and
    one that is gone must be declared so (else its jobs wait out a claim for a taker
    that has watched the database for one: bot/ownership/claims.py)."""
    rows = db.execute(
        "SELECT id, pid, proc_start FROM runners WHERE host = :host AND stopped_at IS NULL",
        {"host": host},
    ).fetchall()
    return [(str(r[0]), int(r[1]), str(r[2] or "")) for r in rows]


def declare_dead(db: Db, runner_id: str, now: datetime) -> None:
    """A runner seen to be dead (its process is gone): end its claims now rather than
    let its jobs wait for them to lapse."""
    params = {"id": runner_id, "now": ts(now)}
    with immediate(db):
        db.execute(
            "UPDATE runners SET stopped_at = :now, lease_until = :now WHERE id = :id", params
        )
        db.execute(
            f"UPDATE jobs SET lease_until = NULL WHERE owner = :id AND state IN {_OWNED_SQL}",
            params,
        )
        db.execute(
            "UPDATE builds SET lease_until = NULL WHERE owner = :id "
            "AND state IN ('queued', 'running', 'rolling_back')",
            params,
        )
        # Its chat deliveries too (store/outbox.py): another process tells what it could not.
        db.execute("UPDATE outbox_claims SET until = '' WHERE holder = :id", params)
        db.execute("UPDATE inbox SET until = '' WHERE holder = :id AND done_at IS NULL", params)


def request_cancel(db: Db, job_id: str, by: str) -> bool:
    """Ask the owner of a job being worked on to cancel it (it sees this at its next
    renewal). False when the job is not running or rolling back."""
    with immediate(db):
        cursor = db.execute(
            "UPDATE jobs SET cancel_requested = :by "
            "WHERE id = :id AND state IN ('running', 'rolling_back')",
            {"id": job_id, "by": by},
        )
    return cursor.rowcount == 1
