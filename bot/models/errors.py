"""The one exception tree: its root and its top branches.

Every exception deploybot defines derives from `DeployBotError`, through one branch
that says who may catch it. This module imports nothing from the project, so every
layer (core, store, backends, front ends) may import it. Each branch's own exceptions
live where they are raised: backends/base.py and the backends' own modules (a
hypervisor's failures, its vendor errors mapped there), store/*.py (the store's
answers); the core's refusals to front ends are at the end of this module.

    DeployBotError          the root; nothing catches it whole
    +-- UserError           a person can fix it; front ends show its message as it is
    +-- JobError            a job's (or build's) run stops; the core ends it and says why
    +-- BackendError        a hypervisor or IPAM operation failed (retryable or not)
    +-- StoreError          the store refused a write or could not do it
    +-- InternalSignal      leaves a nested call early; caught within its own package

Anything that escapes a front end and is not a `UserError` is a bug: it is logged, and
the person is shown a short apology instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


class DeployBotError(Exception):
    """The root of every exception deploybot defines. Catch a branch, never the root:
    the branches mean different things to their callers."""


class UserError(DeployBotError):
    """A problem a person can fix; `str(err)` is the whole message, saying what was wrong
    and how to do it right. `people`: the user ids the message names from the bot's
    records (requester, approvers), each before anything typed; a chat front end may
    show these as mentions, and no other id in it."""

    def __init__(self, message: str, *, people: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.people = tuple(people)


class JobError(DeployBotError):
    """A job's or a build's run stops here (a step failed, the job was taken over): the
    core ends or leaves the job and records why; never shown raw to a person."""


class BackendError(DeployBotError):
    """A hypervisor operation failed. `retryable` says whether trying again may help.
    The backends' own kinds (backends/base.py: RetryableError, PermanentError and below)
    and each vendor's errors are mapped to these at the backend's boundary."""

    retryable: bool = False

    def __init__(self, message: str, *, vm_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.vm_id = vm_id


class StoreError(DeployBotError):
    """The store's answer to a write it refused (a constraint, a dedupe key already
    handled, a quota) or could not do (the database does not answer)."""


class InternalSignal(DeployBotError):
    """Raised to leave a nested call early (a compare-and-set that found another state,
    a watched object that moved, a transport's refusal before it is mapped); caught in
    the package that raises it, never by another layer."""


# --- the core's refusals to front ends: each a UserError ------------------------


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
