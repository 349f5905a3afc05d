"""Finding a job from what a person typed: its whole id, or a prefix of it.

Ids are 21 characters (`bot.models.new_job_id`), more than anyone types; headlines and
tables show the first 8. Any prefix of at least `MIN_JOB_REF` characters names the one
job whose id starts with it; an exact id always wins, so the 7-character ids of earlier
versions keep working even when a longer id starts with one of them. Every front end's
lookup (status, cancel, approve, reject) goes through `resolve`.
"""

from __future__ import annotations

import itertools

from bot.models import Job
from bot.models.errors import AmbiguousJob, JobNotFound, JobUnreadable
from bot.models.ids import JOB_REF_RE, MIN_JOB_REF, SHORT_ID_LENGTH
from store.db import Store

LISTED = 5  # matches named in the "which one?" answer


async def resolve(store: Store, text: str) -> str:
    """The id of the one job `text` names; `JobNotFound` or `AmbiguousJob` otherwise."""
    ref = text.strip().lower() if text.isascii() else text
    ref = ref.removeprefix("#")
    if not JOB_REF_RE.fullmatch(ref):
        raise JobNotFound(
            f"`{text[:40]}` is not a job id: give the id (like j4k7tqa2) or its first "
            f"{MIN_JOB_REF} or more characters; `/deploy history` lists recent ones."
        )
    matches = await store.jobs.match_ids(ref, limit=LISTED + 1)
    if not matches:
        raise JobNotFound(f"There is no job {ref}; `/deploy history` lists recent ones.")
    if matches[0][0] == ref or len(matches) == 1:
        return matches[0][0]
    raise AmbiguousJob(_which_one(ref, matches), [job_id for job_id, _, _ in matches])


def _which_one(ref: str, matches: list[tuple[str, str, str]]) -> str:
    shown = matches[:LISTED]
    width = _distinct_width([job_id for job_id, _, _ in shown])
    listed = ", ".join(
        f"{job_id[:width]} ({name[:30]}, {state[:20]})" for job_id, name, state in shown
    )
    more = " and more" if len(matches) > LISTED else ""
    return (
        f"{ref} matches several jobs: {listed}{more}. Type more characters of the id to pick one."
    )


def _distinct_width(ids: list[str]) -> int:
    """How many leading characters tell these ids (in sorted order) apart, and at least
    as many as a short id has."""
    shared = [_shared_prefix(left, right) for left, right in itertools.pairwise(ids)]
    return max([SHORT_ID_LENGTH, *(n + 1 for n in shared)])


def _shared_prefix(left: str, right: str) -> int:
    count = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        count += 1
    return count


async def load(store: Store, job_id: str) -> Job:
    """The job with this exact id; a clear refusal when it is unknown or quarantined."""
    job = await store.jobs.get(job_id)
    if job is not None:
        return job
    record = await store.jobs.quarantined(job_id)
    if record is None:
        raise JobNotFound(f"There is no job {job_id}; `/deploy history` lists recent ones.")
    raise JobUnreadable(
        f"Job {job_id} cannot be shown: its stored record is damaged ({record.table}: "
        f"{record.reason}). It was set aside at {record.at:%Y-%m-%d %H:%M} UTC: it will not "
        "run, and its name and address are free. Ask an operator to look at it (the "
        "database's quarantine table keeps the row as it was)."
    )
