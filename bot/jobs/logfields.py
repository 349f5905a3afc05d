"""Fields that every log line made while working on something carries: the job, its
backend, the step, the runner, the chat request. Set with `bind` where the work begins
(a contextvar, so each job's task carries its own); shown by the JSON format
(`log_format = "json"`), which a log pipeline can filter on without parsing text.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

# Never mutated: `bind` sets a new mapping, so a task's fields never leak into another's.
_FIELDS: ContextVar[dict[str, str] | None] = ContextVar("deploybot_log_fields", default=None)
_runner = ""  # one per process: set once it has registered


def bind(**fields: str) -> None:
    """Add fields for the rest of this task (and the tasks it starts)."""
    _FIELDS.set({**(_FIELDS.get() or {}), **fields})


def set_runner(runner_id: str) -> None:
    global _runner
    _runner = runner_id


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the bound fields, and the
    traceback (as text) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if _runner:
            line["runner"] = _runner
        line.update(_FIELDS.get() or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class WithoutBodies(logging.Filter):
    """Bolt names a request it did not handle, or one a middleware dropped, with the
    request's body in the warning: what people typed, user ids, trigger ids. Those go
    out; the rest of the line stays, so the event is still on record."""

    MARKERS = ("Unhandled request (", "for the request (")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for marker in self.MARKERS:
            at = message.find(marker)
            if at >= 0:
                record.msg = message[: at + len(marker)] + "body withheld)"
                record.args = None
                break
        return True
