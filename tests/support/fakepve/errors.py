"""The two ways the fake answers a failure: an HTTP error, or a task that ends badly."""

from __future__ import annotations


class ApiError(Exception):
    """An HTTP error answer: status, reason phrase and, for 400, the `errors` map."""

    def __init__(self, status: int, reason: str, errors: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.errors = errors


class TaskError(Exception):
    """Ends a task with this text as its exit status."""
