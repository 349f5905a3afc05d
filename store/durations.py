"""How long past deploy steps took, per backend, template and storage: the job history
read back so a backend can pace its waits from the start of a process (bot/durations.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlite_utils import Database

# (step, template, storage as requested or None, duration in seconds)
StepRow = tuple[str, str, str | None, float]


def step_durations(db: Database, backend: str, steps: Sequence[str], limit: int) -> list[StepRow]:
    """The newest `limit` finished steps of jobs on `backend`, newest first. Walks the
    events backwards by id (their primary key), so it reads about `limit` rows however
    long the history is."""
    marks = ", ".join("?" for _ in steps)
    # A request that is not JSON (a row written by another tool, quarantined when a
    # listing meets it) names no template: json_extract would fail the whole query.
    rows = db.execute(
        "SELECT e.step, json_extract(j.request, '$.template'), "
        "json_extract(j.request, '$.storage'), e.duration_s "
        "FROM job_events e JOIN jobs j ON j.id = e.job_id "
        f"WHERE e.phase = 'finished' AND e.duration_s > 0 AND e.step IN ({marks}) "
        "AND j.backend = ? AND json_valid(j.request) ORDER BY e.id DESC LIMIT ?",
        [*steps, backend, limit],
    ).fetchall()
    return [
        (str(step), str(template), None if storage is None else str(storage), float(duration))
        for step, template, storage, duration in rows
        if isinstance(template, str) and isinstance(duration, (int, float))
    ]
