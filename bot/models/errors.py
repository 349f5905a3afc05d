"""The one exception tree: its root and its top branches.

Every exception deploybot defines derives from `DeployBotError`, through one branch
that says who may catch it. This module imports nothing from the project, so every
layer (core, store, backends, front ends) may import it. Each branch's own exceptions
live where they are raised: bot/errors.py (the core's refusals), backends/base.py and
the backends' own modules (a hypervisor's failures, its vendor errors mapped there),
store/*.py (the store's answers).

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

from collections.abc import Sequence


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
