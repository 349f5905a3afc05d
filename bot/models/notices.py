"""What a chat front end must still say about a job (the `outbox`), and the chat
commands kept until they are answered (the `inbox`): rows the core writes in the same
transaction as the change that causes them."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from bot.models import JobState, RollbackReport, utcnow


class NoticeKind(StrEnum):
    UPDATED = "updated"  # the job was created or changed state (note: why)
    STEP_STARTED = "step_started"
    STEP_FINISHED = "step_finished"
    NOTE = "note"  # waiting for a hypervisor, it is back, wreckage removed
    FINISHED = "finished"  # a final state after running (rollback: what it undid)
    # A lease's step (bot/leases/enforce.py): `step` says which (remind, expired, extended,
    # destroying), `when` the time it names (the end, or the destroy after the grace).
    LEASE = "lease"
    # A template build's (a `builds` row; bot/kinds/build/): `step` says which part
    # (BUILD_ASKED, BUILD_DECIDED, BUILD_STARTED, BUILD_NOTE, BUILD_FINISHED), `text` the
    # line of progress or the reason of a rejection.
    BUILD = "build"


BUILD_ASKED = "asked"  # recorded (queued, or awaiting approval)
BUILD_DECIDED = "decided"  # approved, rejected or expired
BUILD_STARTED = "started"
BUILD_NOTE = "note"
BUILD_FINISHED = "finished"  # published, failed or cancelled
# The last build of a migration apply asked from chat ended (store/applies.py): `text`
# is the apply's id, whose final table goes to the channel it was asked from.
MIGRATION_ENDED = "migration_ended"

# Delivered before progress when a channel is backlogged: the outcome is what people wait for.
URGENT_NOTICES = frozenset({NoticeKind.FINISHED})


class Notice(BaseModel):
    """One thing a chat front end must tell people about a job: a row of `outbox`.

    The core writes it in the same transaction as the change that causes it, so a crash
    cannot leave a change that nobody will hear of; a front end delivers it (in any
    process) and marks it delivered. It carries what the `Progress` calls carry; the job
    itself is read again at delivery, so the text shows its state then."""

    id: int | None = None
    job_id: str
    kind: NoticeKind
    at: datetime = Field(default_factory=utcnow)
    state: JobState | None = None  # the job's state then (the store fills it in)
    step: str | None = None
    duration_s: float | None = None
    ok: bool | None = None
    text: str = ""  # the note, or the step's detail
    rollback: RollbackReport | None = None
    when: datetime | None = None  # a lease notice's time, shown in the reader's zone
    # Who acted, when `text` names them ("cancelled by U123"): a chat front end shows
    # this id, and only this one, as a mention (an id typed into a reason stays text).
    by: str | None = None
    # The parts of it a front end already delivered (a thread line, a direct message...),
    # by name, kept apart from the body (column `parts_sent`) as each part gets there, so
    # a deliverer that dies in between repeats only the others. The store fills it in.
    sent: frozenset[str] = frozenset()

    @property
    def urgent(self) -> bool:
        if self.kind is NoticeKind.BUILD:
            return self.step == BUILD_FINISHED
        return self.kind in URGENT_NOTICES


class Received(BaseModel):
    """A command from chat, kept from before it is acknowledged until it has been carried
    out and answered: a row of `inbox`. Should the process that took it die in between,
    another one carries it out (its `key` is the delivery's dedupe key, so a command that
    had already made its job is answered as such, not run twice)."""

    key: str
    user: str
    channel: str
    text: str
    received_at: datetime
