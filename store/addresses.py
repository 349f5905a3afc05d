"""Which addresses jobs hold, and which IPAM reservations are still to be released.

The unique index over the addresses of jobs in flight or succeeded (HOLDING_STATES) is
the built-in IPAM: these read it so the next free address skips what jobs hold, and
find the jobs that ended without giving their IPAM record back (a crash, an IPAM that
did not answer), which the reconciler releases (bot/addresses/allocation.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from bot.models import HOLDING_STATES, IpamState, Job, JobState, utcnow
from store.jobrows import SELECT_JOBS, _jobs
from store.sql import Db
from store.tx import ts


def held(db: Db) -> dict[str, tuple[str, str, str, bool]]:
    """address -> (job id, VM name, backend, holding) of every job that holds its
    address (`holding`), or whose rollback left its VM behind (wreckage: the VM still
    has the address, though the store's index no longer guards it)."""
    return _held(db, "", [])


def holder(db: Db, address: str) -> tuple[str, str, str, bool] | None:
    """`held` for one address, through the index on it: an admission checks one
    address, and reading every held one for each of fifty requests at once kept the
    store's thread (and the GIL) busy while the deploys waited to start."""
    return _held(db, "address = ? AND ", [address]).get(address)


def holders(db: Db, addresses: Sequence[str]) -> list[tuple[str, str, str, bool] | None]:
    """`holder` for many addresses in one statement, one answer per address, in order:
    the admissions of requests asked together, and the checks of deploys that reach
    `check_free` together, ask in the same moment (`Addresses.holder` merges them)."""
    found: dict[str, tuple[str, str, str, bool]] = {}
    unique = sorted(set(addresses))
    for at in range(0, len(unique), 500):  # within every SQLite's limit of parameters
        chunk = unique[at : at + 500]
        marks = ", ".join("?" * len(chunk))
        found.update(_held(db, f"address IN ({marks}) AND ", chunk))
    return [found.get(address) for address in addresses]


def _held(db: Db, where: str, params: list[str]) -> dict[str, tuple[str, str, str, bool]]:
    """The first NICs' addresses from `jobs`, the later NICs' from `job_addresses`."""
    marks = ", ".join(f"'{s.value}'" for s in HOLDING_STATES)
    live = f"(jobs.state IN ({marks}) OR (wreckage IS NOT NULL AND wreckage <> ''))"
    columns = f"id, name, backend, jobs.state IN ({marks}), jobs.created_at"
    later = where.replace("address", "n.ip")
    rows = db.execute(  # one statement: the reads of a moment are merged (repository.gathered)
        f"SELECT address, {columns} FROM jobs WHERE {where}{live} UNION ALL "
        f"SELECT n.ip, {columns} FROM jobs JOIN job_addresses n ON n.job_id = jobs.id "
        f"AND n.nic > 0 WHERE {later}{live} ORDER BY 5",
        [*params, *params],
    ).fetchall()
    found: dict[str, tuple[str, str, str, bool]] = {}
    for address, job_id, name, backend, holding, _at in rows:
        if not found.get(str(address), ("", "", "", False))[3]:  # a holder wins
            found[str(address)] = (str(job_id), str(name), str(backend), bool(holding))
    return found


def unreleased(db: Db) -> list[Job]:
    """Jobs that no longer hold their address but whose IPAM record is not released."""
    marks = ", ".join(f"'{s.value}'" for s in HOLDING_STATES)
    held_marks = f"'{IpamState.RESERVED.value}', '{IpamState.ACTIVE.value}'"
    sql = (
        f"{SELECT_JOBS} WHERE ipam_state IN ({held_marks}) AND state NOT IN ({marks}) "
        "ORDER BY created_at, rowid"
    )
    return _jobs(db, sql)[0]


def set_ipam_state(db: Db, job_id: str, expected: list[IpamState], new: IpamState) -> bool:
    """Compare-and-set: of two processes releasing the same record, one records it."""
    marks = ", ".join("?" for _ in expected)

    cur = db.execute(
        f"UPDATE jobs SET ipam_state = ?, updated_at = ? WHERE id = ? AND ipam_state IN ({marks})",
        [new.value, ts(utcnow()), job_id, *[s.value for s in expected]],
    )
    return bool(cur.rowcount)


def known_ids(db: Db, job_ids: list[str]) -> dict[str, JobState]:
    """The state of each of these jobs that exists."""
    if not job_ids:
        return {}
    marks = ", ".join("?" for _ in job_ids)
    rows = db.execute(f"SELECT id, state FROM jobs WHERE id IN ({marks})", job_ids).fetchall()
    return {str(i): JobState(s) for i, s in rows}
