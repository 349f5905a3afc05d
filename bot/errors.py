"""Request and job errors: the refusals the core raises to its front ends.

Each is a `UserError` (bot/models/errors.py, the root of the one exception tree): a
problem a person can fix, whose message says what was wrong and how to do it right;
front ends show it as it is. Anything else that escapes the core is a bug: front ends
log it and show a short apology instead of a traceback. Hypervisor failures are
`BackendError`s and never cross into front ends raw: the pipeline turns them into a
failed job with a reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bot.models.errors import UserError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


class UsageError(UserError):
    """The command text does not follow the grammar; `usage` shows the right form."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(f"{message}\nUsage: {usage}")
        self.problem = message
        self.usage = usage


class RequestInvalid(UserError):
    """The request parses but breaks a rule (name, address, sizes); lists every problem."""

    def __init__(self, problems: list[str], fields: dict[str, str] | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        # The request field each problem is about (a form puts it next to that field).
        self.fields = fields or {}


class ConfigError(UserError):
    """The configuration file is missing, unreadable or breaks a rule: file, key, reason."""


class JobNotFound(UserError):
    pass


class AmbiguousJob(UserError):
    """A typed prefix of a job id matches several jobs; `matches` are their ids."""

    def __init__(self, message: str, matches: list[str]) -> None:
        super().__init__(message)
        self.matches = matches


class JobUnreadable(UserError):
    """The job's stored record is damaged: it was set aside (quarantined) and never runs."""


class NotAllowed(UserError):
    """The person may not do this (deploy, approve their own request, cancel others' jobs)."""


class TransitionRefused(UserError):
    """The job is no longer in a state that allows this (already approved, finished...)."""


class Conflict(UserError):
    """The name or address is already taken by a VM or by a job in flight."""


class Duplicate(UserError):
    """This exact request (same dedupe key) was already handled; nothing was done again."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class StoreUnavailable(UserError):
    """The database cannot be reached or refuses the connection (permanent until fixed)."""

    def __init__(self, detail: str, password_env: str) -> None:
        # `detail`: the URL without its password, then libpq's whole reason.
        end = "" if detail.endswith((".", "?", "!")) else "."
        super().__init__(
            f"Cannot open the database {detail}{end} {_store_fix(detail, password_env)}"
        )


_URL_FORM = "postgresql://USER@HOST:PORT/DBNAME"


def _store_fix(detail: str, password_env: str) -> str:
    """What to check for libpq's reason, naming the setting that holds it. libpq's
    texts are English unless its messages are translated; the last answer covers any."""
    reason = detail.lower()
    if "password" in reason:
        return (
            f"The password is read from the environment variable {password_env} (the "
            "setting `database_password_env` names it): set it to this user's password, "
            "and check the user in the setting `database`."
        )
    if 'role "' in reason and "does not exist" in reason:
        return (
            f"Check the user in the setting `database` ({_URL_FORM}), or create that "
            "role in PostgreSQL."
        )
    if 'database "' in reason and "does not exist" in reason:
        return (
            f"Check the database name in the setting `database` ({_URL_FORM}), or "
            "create that database (createdb)."
        )
    if "pg_hba.conf" in reason:
        return (
            "PostgreSQL does not admit this host, user or database: add a line for them "
            "to its pg_hba.conf, or check the setting `database`."
        )
    if "ssl" in reason or "certificate" in reason:
        return (
            "Check the TLS options in the setting `database` (sslmode, sslrootcert) and "
            "the server's certificate."
        )
    return (
        f"Check the host and port in the setting `database` ({_URL_FORM}) and that "
        "PostgreSQL runs there and listens on that address for this host; the password "
        f"is read from the environment variable {password_env} (setting "
        "`database_password_env`)."
    )


def format_errors(
    source: Path,
    errors: list[ErrorDetails],
    from_env: Callable[[tuple[str | int, ...]], str | None] = lambda _loc: None,
) -> str:
    """A ConfigError's text: the file, then one line per problem with its key, and, for
    a value the environment set (`from_env` names its variable), that variable."""
    # A container whose items failed also reports itself as empty; the items say it better.
    locs = [tuple(e["loc"]) for e in errors]
    errors = [
        e for e in errors if not any(o != e["loc"] and o[: len(e["loc"])] == e["loc"] for o in locs)
    ]
    errors = [
        e
        for e in errors
        if not (e["loc"][:1] == ("backends",) and len(e["loc"]) > 2 and e["type"] == "model_type")
    ]
    variables = [from_env(tuple(e["loc"])) for e in errors]
    where = f"{source} and the environment" if any(variables) else f"{source}"
    lines = [f"{where}: the configuration has {len(errors)} problem(s):"]
    for error, variable in zip(errors, variables, strict=True):
        key = ".".join(str(part) for part in error["loc"])
        if variable:  # the environment wins over the file: the file is not at fault
            key = f"{key}, set by the environment variable {variable}"
        message = error["msg"].removeprefix("Value error, ")
        # A check across sections names its keys itself.
        lines.append(f"  {key}: {message}" if key else f"  {message}")
    return "\n".join(lines)
