"""Job kinds as data: what the engine needs to run each kind of job, looked up by name.

A job's kind is stored with it (`jobs.kind`; every row of `builds` is of the build
kind), never read from its id. The queue, ownership (take-over and hand-back), the
approval buttons, the outbox's Slack threads and gc look the kind up in a `Kinds`
registry and call it; nothing else branches on what kind a job is.

The kinds: `deploy` (bot/kinds/deploy/kind.py: the pipeline; a destroy is a phase of a
deploy's row, DESTROY_REQUESTED -> DESTROYING -> DESTROYED, not a kind of its own,
since it acts on the deploy's VM under the deploy's id) and `build` (bot/kinds/build/kind.py:
a template build, bot/kinds/build/). A kind is added with `Kinds.register`.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Literal, Protocol

from bot.models import Job
from bot.models.builds import Build
from bot.models.errors import UserError

if TYPE_CHECKING:
    from bot.ownership.claims import Ended


DEPLOY = "deploy"
# Where a kind keeps its rows: `jobs` (bot.models.Job) or `builds` (bot.models.builds.Build).
Rows = Literal["jobs", "builds"]
Record = Job | Build


class Kind(Protocol):
    """One kind of job. The contract:

    * `name` is what `jobs.kind` holds (a kind whose rows are `builds` rows: what the
      store answers for them); unique in a registry. `noun` is what people call one
      ("job", "build"), for the words front ends build around an id.
    * `rows` says which table and model hold its jobs. A `jobs` kind gets the common
      machinery on its rows: the queue claims them, ownership takes over those whose
      runner died and calls `recover`, approvals, expiry and the outbox's thread work
      on `Job`s. A `builds` kind keeps its own rows and recovers them in `sweep`.
    * `run(job_id)`: run a job of this kind that this runner has claimed (the queue
      calls it). It writes the job's final state itself; if it raises, ownership hands
      the job back and it is recovered like a dead runner's.
    * `recover(job, ended)`: a `jobs` row of this kind this runner just took over
      (`ended`: this runner handed it back, and the exception its task ended on); True
      puts it back in the queue, where `run` resumes it. Never raises for a job it can
      settle; must be safe to run again after a crash of its own.
    * `sweep()`: the work that recovers this kind's rows kept outside `jobs` whose
      runner died or handed them back; None when it keeps none.
    * `decide` / `may_decide`: its approval hook: approve or reject what `ref` (an id
      or a prefix) names, or refuse now what that decision would refuse.
      `dedupe_key` makes a redelivered click raise `Duplicate`.
    * `cancel(ref, user)`: cancel it (a running one rolls back).

    Refusals are `UserError`s whose message says what to do.
    """

    name: str
    noun: str
    rows: Rows

    async def run(self, job_id: str) -> object: ...

    async def recover(self, job: Job, ended: Ended | None) -> bool: ...

    def sweep(self) -> Coroutine[Any, Any, object] | None: ...

    async def decide(
        self,
        ref: str,
        approver: str,
        approved: bool,
        reason: str | None = None,
        dedupe_key: str | None = None,
    ) -> Record: ...

    async def may_decide(self, ref: str, approver: str) -> Record: ...

    async def cancel(self, ref: str, user: str) -> Record: ...


class UnknownKind(UserError):
    """A job row names a kind this deploybot does not have (written by a newer one)."""


class Kinds:
    """The registry: kind name -> `Kind`. One per process (the Deployer's)."""

    def __init__(self) -> None:
        self._kinds: dict[str, Kind] = {}

    def register(self, kind: Kind) -> None:
        if kind.name in self._kinds:
            raise ValueError(f"job kind {kind.name!r} is registered already")
        self._kinds[kind.name] = kind

    def __getitem__(self, name: str) -> Kind:
        found = self._kinds.get(name)
        if found is None:
            raise UnknownKind(
                f"This deploybot has no job kind {name[:40]!r} (a newer version wrote "
                "the job?): run the version that made it, or upgrade this one."
            )
        return found

    def __iter__(self) -> Iterator[Kind]:
        return iter(list(self._kinds.values()))

    def named(self, name: str | None) -> Kind:
        """The kind `name`, or the deploy kind when the store found none (no such job:
        the deploy's lookup then says so in its own words)."""
        return self[name or DEPLOY]

    def sweep(self, name: str) -> Coroutine[Any, Any, object] | None:
        """The recovery work of kind `name` for rows it keeps outside `jobs` (see
        `Kind.sweep`); None when it has none or the kind is unknown here."""
        kind = self._kinds.get(name)
        return kind.sweep() if kind is not None else None
