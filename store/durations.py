"""How long past deploy steps took, per backend, template and storage: the job history
read back so a backend can pace its waits from the start of a process (bot/jobs/durations.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from store.sql import Db

# (step, template, storage as requested or None, duration in seconds)
StepRow = tuple[str, str, str | None, float]


def step_durations(db: Db, backend: str, steps: Sequence[str], limit: int) -> list[StepRow]:
    """The newest `limit` finished steps of jobs on `backend`, newest first. Walks the
    events backwards by id (their primary key), so it reads about `limit` rows however
    long the history is. The request's template and storage are read here rather than
    with SQL's JSON functions, which SQLite and PostgreSQL spell differently; a request
    that is not JSON (a row written by another tool) names nothing and is left out."""
    marks = ", ".join("?" for _ in steps)
    rows = db.execute(
        "SELECT e.step, j.request, e.duration_s "
        "FROM job_events e JOIN jobs j ON j.id = e.job_id "
        f"WHERE e.phase = 'finished' AND e.duration_s > 0 AND e.step IN ({marks}) "
        "AND j.backend = ? ORDER BY e.id DESC LIMIT ?",
        [*steps, backend, limit],
    ).fetchall()
    found: list[StepRow] = []
    for step, request, duration in rows:
        try:
            asked = json.loads(request)
        except (TypeError, ValueError):
            continue
        template = asked.get("template") if isinstance(asked, dict) else None
        storage = asked.get("storage") if isinstance(asked, dict) else None
        if isinstance(template, str) and isinstance(duration, (int, float)):
            found.append(
                (str(step), template, None if storage is None else str(storage), float(duration))
            )
    return found
