"""Jobs, their events and approvals as rows. Plain functions of a `Db` (store/sql.py).

State changes are compare-and-set: an UPDATE that names the state it expects, so of two
actors racing (two approvers, a cancel and a finishing worker) exactly one wins and the
other is told so. These functions run on the store's worker thread (store/db.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import Any

from bot.models import HOLDING_STATES, TRANSITIONS, Approval, Claim, Job, JobEvent, JobState, utcnow
from bot.models.builds import BUILD_KIND
from bot.models.errors import InternalSignal, StoreError
from bot.models.ids import new_job_id
from bot.models.notices import Notice, NoticeKind
from store import outbox, quarantine, quotas
from store.deliveries import AlreadyDelivered, claim, delivered
from store.jobrows import (
    _REREADS,
    SELECT_JOBS,
    _jobs,
    _row,
    _sql_value,
    event_row,
    job_from_row,
    job_row,
    listing,
    sift_rows,
)
from store.quarantine import QUARANTINED
from store.sql import ConstraintViolation, Db, immediate
from store.tx import ts

# Rows and deliveries are in store/jobrows.py and store/deliveries.py; the names other
# modules use are imported from here too.
__all__ = [
    "SELECT_JOBS",
    "AlreadyDelivered",
    "DuplicateActive",
    "claim",
    "delivered",
    "job_from_row",
    "job_row",
    "listing",
]

# Columns a transition may set besides state and updated_at.
_JOB_FIELDS = frozenset(Job.model_fields) - {"id", "state", "request", "created_at", "updated_at"}


class DuplicateActive(StoreError):
    """Another job in flight already holds this name (on this backend) or this address."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _JobIdTaken(InternalSignal):
    """The new job's random id is a stored job's; the transaction wrote nothing."""


_ID_ATTEMPTS = 5


def insert_job(
    db: Db,
    job: Job,
    approval: Approval | None = None,
    *,
    dedupe_key: str | None = None,
    announce: bool = False,
    admit: quotas.Admit | None = None,
) -> Job:
    """Insert a new job (and its approval) and return it as stored. Its id is random:
    should it be a stored job's already, the insert is made again with a fresh id, so the
    job returned may carry another id than the one given. `announce`: chat must hear of
    it (a notice in the same transaction). `admit`: the core's quota check, run in the
    same transaction (store/quotas.admit); what it raises is raised here, and nothing
    is written. `AlreadyDelivered` when `dedupe_key` was used before, `DuplicateActive`
    when a job in flight holds the name or the address."""
    for _attempt in range(_ID_ATTEMPTS):
        try:
            _insert_job(db, job, approval, dedupe_key, announce, admit)
        except _JobIdTaken:
            job = job.model_copy(update={"id": new_job_id()})
            if approval is not None:
                approval = approval.model_copy(update={"job_id": job.id})
            continue
        return job
    raise RuntimeError(f"{_ID_ATTEMPTS} random job ids were all taken: is new_job_id broken?")


def _insert_job(
    db: Db,
    job: Job,
    approval: Approval | None,
    dedupe_key: str | None,
    announce: bool,
    admit: quotas.Admit | None,
) -> None:
    with immediate(db):
        if dedupe_key is not None:
            claim(db, dedupe_key, job.id, "request")
        if admit is not None:
            quotas.admit(db, admit)
        try:
            db.insert("jobs", [job_row(job)])
        except ConstraintViolation as exc:
            text = exc.what
            if "jobs.id" in text:
                raise _JobIdTaken from None
            if "jobs.address" in text:
                raise DuplicateActive("address") from None
            if "jobs.backend" in text or "jobs.name" in text:
                raise DuplicateActive("name") from None
            raise
        try:  # every NIC's address and fixed MAC, unique among live jobs (store/migrations.py)
            db.insert("job_addresses", address_rows(job))
        except ConstraintViolation as exc:
            if "job_addresses.mac" in exc.what:
                raise DuplicateActive("mac") from None
            if "job_addresses.ip" in exc.what:
                raise DuplicateActive("address") from None
            raise
        if approval is not None:
            db.insert("approvals", [_row(approval)])
        if announce:
            outbox.add(db, [Notice(job_id=job.id, kind=NoticeKind.UPDATED)], job.state)


def address_rows(job: Job) -> list[dict[str, object]]:
    """The job's rows of `job_addresses`: one per NIC, the first NIC's first."""
    request = job.request
    macs = (request.mac, *(nic.mac for nic in request.nics))
    ips = (job.address, *(str(nic.address.ip) for nic in request.nics))
    return [
        {"job_id": job.id, "nic": n, "ip": ip, "mac": mac, "state": job.state.value}
        for n, (ip, mac) in enumerate(zip(ips, macs, strict=True))
    ]


def holder(
    db: Db,
    *,
    backend: str,
    name: str,
    address: str,
    more: Sequence[str] = (),
    macs: Sequence[str] = (),
) -> Job | None:
    """The job that holds this name on this backend, or this address, or one of `more`
    addresses or of `macs` on any of its NICs (see HOLDING_STATES). A holder whose row
    does not validate is quarantined, which frees what it held."""
    marks = ", ".join(f"'{s.value}'" for s in HOLDING_STATES)
    ips = [address, *more]
    ip_marks, mac_marks = ", ".join("?" * len(ips)), ", ".join("?" * len(macs)) or "NULL"
    sql = (
        f"{SELECT_JOBS} WHERE state IN ({marks}) "
        "AND ((backend = ? AND name = ?) OR address = ? OR id IN (SELECT job_id FROM "
        f"job_addresses WHERE state IN ({marks}) AND (ip IN ({ip_marks}) OR mac IN "
        f"({mac_marks})))) LIMIT 1"
    )
    for _round in range(_REREADS):
        found, bad = _jobs(db, sql, [backend, name, address, *ips, *macs])
        if found or not bad:
            return found[0] if found else None
    return None


def get_job(db: Db, job_id: str) -> Job | None:
    """None when there is no such job, or it is quarantined (store.quarantine.find says
    why): a quarantined job is never run, recovered or decided on."""
    found, _bad = _jobs(db, f"{SELECT_JOBS} WHERE id = ? AND state <> ?", [job_id, QUARANTINED])
    return found[0] if found else None


def match_ids(db: Db, prefix: str, limit: int = 10) -> list[tuple[str, str, str]]:
    """(id, name, state) of up to `limit` jobs whose id starts with `prefix`, in id order:
    an exact match comes first. A range on the primary key, so it uses its index."""
    if not prefix or not prefix.isascii():
        return []  # job ids are ASCII; this also keeps chr() below in range
    upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    rows = db.query(
        "SELECT id, name, state FROM jobs WHERE id >= ? AND id < ? ORDER BY id LIMIT ?",
        [prefix, upper, limit],
    )
    return [(str(r["id"]), str(r["name"]), str(r["state"])) for r in rows]


def kind_of(db: Db, ref: str) -> str | None:
    """The kind of the job or template build `ref` names: its whole id, or a prefix of
    ids that are all of one kind; None when it names none (or jobs of several kinds).
    Jobs keep their kind in a column; a build's is its table's. Ranges on both primary
    keys, so it uses their indexes; nothing is read from the id itself."""
    if not ref or not ref.isascii():
        return None
    upper = ref[:-1] + chr(ord(ref[-1]) + 1)
    rows = db.query(
        "SELECT kind, id FROM jobs WHERE id = :ref UNION ALL "
        f"SELECT '{BUILD_KIND}', id FROM builds WHERE id = :ref",
        {"ref": ref},
    )
    if not rows:
        rows = db.query(
            "SELECT kind, id FROM jobs WHERE id >= :ref AND id < :upper UNION ALL "
            f"SELECT '{BUILD_KIND}', id FROM builds WHERE id >= :ref AND id < :upper",
            {"ref": ref, "upper": upper},
        )
    kinds = {str(row["kind"]) for row in rows}
    return kinds.pop() if len(kinds) == 1 else None


def transition(
    db: Db,
    /,
    job_id: str,
    expected: Collection[JobState],
    new: JobState,
    *,
    held_by: Claim | None = None,
    notices: Sequence[Notice] = (),
    events: Sequence[JobEvent] = (),
    **fields: Any,
) -> bool:
    """Move a job from one of `expected` to `new`; False when it was not in those states
    (or, with `held_by`, when that claim no longer holds it: a runner whose claim lapsed
    and whose job was taken over must not write over the new owner's work). The
    `notices` (what chat must be told of it) and `events` (its history) are kept only if
    the move happened, in its transaction: all land, or none."""
    return move(
        db, job_id, expected, new, held_by=held_by, notices=notices, events=events, **fields
    )[0]


def move(
    db: Db,
    /,
    job_id: str,
    expected: Collection[JobState],
    new: JobState,
    *,
    held_by: Claim | None = None,
    notices: Sequence[Notice] = (),
    events: Sequence[JobEvent] = (),
    **fields: Any,
) -> tuple[bool, Job | None]:
    """`transition` that also answers with the job as it now is, from the same statement
    (RETURNING), so the pipeline need not read it back: (moved, job). The job is None
    when it did not move, or when its row no longer validates (then it is set aside)."""
    sql, params = _move_sql(job_id, tuple(expected), new, held_by, fields)
    with immediate(db):
        rows = db.query(sql + " RETURNING *", params)
        if rows:
            outbox.add(db, notices, new)
            db.insert("job_events", [event_row(event) for event in events])
    if not rows:
        return False, None
    try:
        return True, job_from_row(rows[0])
    except ValueError:  # damaged: read it the careful way, which sets it aside
        return True, get_job(db, job_id)


def _move_sql(
    job_id: str,
    expected: tuple[JobState, ...],
    new: JobState,
    held_by: Claim | None,
    fields: dict[str, Any],
) -> tuple[str, dict[str, Any]]:
    for state in expected:
        if new not in TRANSITIONS.get(state, frozenset()):
            raise ValueError(f"{state.value} -> {new.value} is not a job transition")
    unknown = set(fields) - _JOB_FIELDS
    if unknown:
        raise ValueError(f"not job columns: {sorted(unknown)}")
    values = {k: _sql_value(v) for k, v in fields.items()}
    sets = "".join(f", {column} = :{column}" for column in values)
    marks = ", ".join(f":s{i}" for i in range(len(expected)))
    params = {**values, "new": new.value, "now": ts(utcnow()), "id": job_id}
    params.update({f"s{i}": state.value for i, state in enumerate(expected)})
    sets += _new_claim(fields)
    sql = (
        f"UPDATE jobs SET state = :new, updated_at = :now{sets} "
        f"WHERE id = :id AND state IN ({marks}){_fence(held_by, params)}"
    )
    return sql, params


def _fence(held_by: Claim | None, params: dict[str, Any]) -> str:
    """The condition that makes a write land only under `held_by`'s claim (the fencing
    token: the owner, and its claim epoch when known)."""
    if held_by is None:
        return ""
    params["held_by"] = held_by.runner
    if held_by.epoch is None:
        return " AND owner = :held_by"
    params["held_epoch"] = held_by.epoch
    return " AND owner = :held_by AND claim_epoch = :held_epoch"


def _new_claim(fields: dict[str, Any]) -> str:
    """A write that sets the owner is a new claim: its epoch goes up by one."""
    return ", claim_epoch = claim_epoch + 1" if "owner" in fields else ""


def update_job(
    db: Db,
    /,
    job_id: str,
    *,
    held_by: Claim | None = None,
    notices: Sequence[Notice] = (),
    events: Sequence[JobEvent] = (),
    **fields: Any,
) -> bool:
    """Set columns without a state change (the VM's durable id, the wreckage list);
    with `held_by`, only while that claim holds the job. False when nothing changed.
    `notices` and `events` are kept in its transaction, only if the row changed."""
    unknown = set(fields) - _JOB_FIELDS
    if unknown:
        raise ValueError(f"not job columns: {sorted(unknown)}")
    values = {k: _sql_value(v) for k, v in fields.items()}
    values["updated_at"] = ts(utcnow())
    sets = ", ".join(f"{column} = :{column}" for column in values) + _new_claim(fields)
    params = {**values, "id": job_id}
    fence = _fence(held_by, params)
    with immediate(db):
        cursor = db.execute(f"UPDATE jobs SET {sets} WHERE id = :id{fence}", params)
        if cursor.rowcount == 1:
            outbox.add(db, notices)
            db.insert("job_events", [event_row(event) for event in events])
    return cursor.rowcount == 1


# An event to record, the notice chat must be told of it, and the claim it is written
# under (None: unfenced).
EventWrite = tuple[JobEvent, Notice | None, Claim | None]


def add_event(
    db: Db, event: JobEvent, notice: Notice | None = None, held_by: Claim | None = None
) -> bool:
    """Record a step event (and what chat must be told of it); with `held_by`, only
    while that claim holds the job (False, and nothing written, once it does not)."""
    (added,) = add_events(db, [(event, notice, held_by)])
    return added


def add_events(db: Db, writes: Sequence[EventWrite]) -> list[bool]:
    """`add_event` for many at once (the step ends of the deploys finishing together:
    the engines merge them, store/engine.py): one read of the claims, one insert of the
    events, whatever their number; each written only while its claim holds, in the
    same transaction as the read."""
    with immediate(db):
        claims = _claims(db, {event.job_id for event, _notice, held in writes if held})
        held = [h is None or _holds(claims.get(e.job_id), h) for e, _n, h in writes]
        kept = [write for write, ok in zip(writes, held, strict=True) if ok]
        db.insert("job_events", [event_row(event) for event, _notice, _held in kept])
        outbox.add(db, [notice for _event, notice, _held in kept if notice])
    return held


def _claims(db: Db, job_ids: Iterable[str]) -> dict[str, tuple[str | None, int]]:
    """Each job's owner and claim epoch, as they are now."""
    found: dict[str, tuple[str | None, int]] = {}
    ids = sorted(job_ids)
    for at in range(0, len(ids), 500):  # within every SQLite's limit of parameters
        chunk = ids[at : at + 500]
        marks = ", ".join("?" * len(chunk))
        sql = f"SELECT id, owner, claim_epoch FROM jobs WHERE id IN ({marks})"
        for row in db.query(sql, chunk):
            found[str(row["id"])] = (row["owner"], int(row["claim_epoch"]))
    return found


def _holds(current: tuple[str | None, int] | None, claim: Claim) -> bool:
    """Whether `claim` holds a job whose owner and epoch are `current` (`_fence`)."""
    if current is None or current[0] != claim.runner:
        return False
    return claim.epoch is None or current[1] == claim.epoch


def events(db: Db, job_id: str) -> list[JobEvent]:
    """The job's step events; one that does not validate is quarantined and left out
    (the job itself stays: its own row is intact)."""
    rows = list(
        db.query(
            "SELECT id, job_id, at, step, phase, duration_s, detail FROM job_events "
            "WHERE job_id = ? ORDER BY id",
            [job_id],
        )
    )

    def set_aside(row: dict[str, Any], reason: str) -> None:
        key = quarantine.row_key(str(row["id"]), None)
        quarantine.record(db, "job_events", key, job_id, reason, row)

    found, _bad = quarantine.sift(rows, JobEvent.model_validate, set_aside)
    return found


def history(
    db: Db,
    *,
    requester: str | None = None,
    state: JobState | None = None,
    name: str | None = None,
    address: str | None = None,
    since: datetime | None = None,
    limit: int = 10,
) -> list[Job]:
    """Newest first. Each filter is served by an index on (column, created_at)."""
    sql, params = _history_query(requester, state, name, address, since, None, limit)
    return listing(db, sql, params)


# A position in the history, newest first: the last row read (created_at, rowid).
HistoryCursor = tuple[str, int]


def history_page(
    db: Db,
    *,
    requester: str | None = None,
    state: JobState | None = None,
    name: str | None = None,
    after: HistoryCursor | None = None,
    limit: int = 500,
) -> tuple[list[Job], HistoryCursor | None]:
    """One page of `history`, read on from `after` (keyset: the page costs the same
    however deep it is); the cursor of the next page, or None after the last one."""
    sql, params = _history_query(requester, state, name, None, None, after, limit)
    rows = list(db.query(sql, params))
    found, _bad = sift_rows(db, rows)
    if len(rows) < limit:
        return found, None
    return found, (str(rows[-1]["created_at"]), int(rows[-1]["rowid_"]))


def _history_query(
    requester: str | None,
    state: JobState | None,
    name: str | None,
    address: str | None,
    since: datetime | None,
    after: HistoryCursor | None,
    limit: int,
) -> tuple[str, dict[str, Any]]:
    where: list[str] = []
    params: dict[str, Any] = {"limit": limit}
    for column, value in (("requester", requester), ("name", name), ("address", address)):
        if value is not None:
            where.append(f"{column} = :{column}")
            params[column] = value
    if state is not None:
        where.append("state = :state")
        params["state"] = state.value
    if since is not None:
        where.append("created_at >= :since")
        params["since"] = ts(since)
    if after is not None:
        where.append("(created_at < :after_at OR (created_at = :after_at AND rowid < :after_row))")
        params.update(after_at=after[0], after_row=after[1])
    where.append(f"state <> '{QUARANTINED}'")
    sql = (
        f"{SELECT_JOBS} WHERE {' AND '.join(where)} "
        "ORDER BY created_at DESC, rowid DESC LIMIT :limit"
    )
    return sql, params


def jobs_with_wreckage(db: Db) -> list[Job]:
    """Finished jobs whose rollback left a VM behind (oldest first)."""
    sql = (
        f"{SELECT_JOBS} WHERE wreckage IS NOT NULL AND state <> '{QUARANTINED}' "
        "ORDER BY created_at, rowid"
    )
    return listing(db, sql)


def jobs_in(db: Db, states: Collection[JobState]) -> list[Job]:
    """Oldest first, so a restart re-queues in the order people asked. Jobs whose rows
    do not validate are quarantined and left out: they are never run or recovered."""
    values = [s.value for s in states]
    marks = ", ".join("?" for _ in values)
    sql = f"{SELECT_JOBS} WHERE state IN ({marks}) ORDER BY created_at, rowid"
    return _jobs(db, sql, values)[0]


def host_keys(db: Db, states: Collection[JobState]) -> list[tuple[str, str | None, str | None]]:
    """(name, host key, host certificate) of the jobs in `states` that recorded either:
    what `deploybot ssh-ca` needs to name the keys of VMs that are gone (bot/sshca/)."""
    values = [s.value for s in states]
    marks = ", ".join("?" for _ in values)
    rows = db.execute(
        f"SELECT name, host_key, host_certificate FROM jobs WHERE state IN ({marks}) "
        "AND (host_key IS NOT NULL OR host_certificate IS NOT NULL) ORDER BY created_at",
        values,
    ).fetchall()
    return [(str(name), key, certificate) for name, key, certificate in rows]


def count_by_state(db: Db) -> dict[str, int]:
    """How many jobs are in each state (for metrics)."""
    rows = db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
    return {str(state): int(count) for state, count in rows}
