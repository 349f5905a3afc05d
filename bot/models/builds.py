"""Template builds as data (issue 17): a row of the `builds` table per build.

A build is a job of its own kind: it has a requester, an owner with a claim, a state
machine and an undo stack like a deploy, but no address and no chat-visible VM of its
own, so it lives in its own table, and its kind is the table's (bot/kinds/build/kind.py).
Its id starts with `b` (a deploy's with `j`) only to tell them apart when read; no code
decides anything by it: the store looks the id up (store/jobs.kind_of).
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field, field_validator

from bot.models import utcnow
from bot.models.ids import JOB_ID_LENGTH, SHORT_ID_LENGTH, random_letters

# The kind of every build (bot/kinds/build/kind.py): the store answers it for a `builds` row.
BUILD_KIND = "build"
BUILD_ID_RE = re.compile(r"b[a-z0-9]{6,40}")
# A template's name: a VM name on every hypervisor (Proxmox wants a DNS name), with room
# for the `-vN` of its versions.
TEMPLATE_NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,48}[a-z0-9])?")


def template_name_problem(name: str) -> str | None:
    """Why `name` cannot be a template's name; None when it can."""
    if TEMPLATE_NAME_RE.fullmatch(name):
        return None
    return (
        f"{name[:60]!r} cannot be a template name: use 1-50 lower-case letters, digits, "
        "dots or hyphens, starting and ending with a letter or digit (e.g. debian-12)"
    )


def new_build_id() -> str:
    return "b" + random_letters(JOB_ID_LENGTH)


class BuildState(StrEnum):
    AWAITING_APPROVAL = "awaiting_approval"
    QUEUED = "queued"
    RUNNING = "running"
    ROLLING_BACK = "rolling_back"
    PUBLISHED = "published"  # the template is the current one of its name (or was)
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    EXPIRED = "expired"
    RETIRED = "retired"  # an older version, removed by `template gc --apply`

    @property
    def final(self) -> bool:
        return self not in ACTIVE_BUILD_STATES and self is not BuildState.PUBLISHED


# Builds in flight: the store lets one of a name per backend be so at a time, which is
# also what keeps two builds from taking the same version number.
ACTIVE_BUILD_STATES = frozenset(
    {
        BuildState.AWAITING_APPROVAL,
        BuildState.QUEUED,
        BuildState.RUNNING,
        BuildState.ROLLING_BACK,
    }
)
BUILD_TRANSITIONS: dict[BuildState, frozenset[BuildState]] = {
    BuildState.AWAITING_APPROVAL: frozenset(
        {BuildState.QUEUED, BuildState.REJECTED, BuildState.EXPIRED, BuildState.CANCELLED}
    ),
    BuildState.QUEUED: frozenset({BuildState.RUNNING, BuildState.CANCELLED}),
    BuildState.RUNNING: frozenset({BuildState.PUBLISHED, BuildState.ROLLING_BACK}),
    BuildState.ROLLING_BACK: frozenset({BuildState.FAILED, BuildState.CANCELLED}),
    BuildState.PUBLISHED: frozenset({BuildState.RETIRED}),
}


class Build(BaseModel):
    """One template build's life, as stored: a row of the `builds` table."""

    id: str = Field(default_factory=new_build_id)
    state: BuildState
    requester: str
    profile: str
    backend: str
    name: str  # the published name (the profile's unless --name)
    version: int = Field(ge=1)
    placement: str | None = None  # as asked (None: the backend's choice)
    storage: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    vm_id: str | None = None  # the template's durable id, known before it is created
    vm_placement: str | None = None
    cpu: str | None = None
    source_digest: str | None = None
    smoke_job: str | None = None  # the deploy that proved the template
    step: str | None = None  # the step under way
    failed_step: str | None = None
    error: str | None = None
    wreckage: str | None = None
    notes: tuple[str, ...] = ()  # what was found and done, for the person
    owner: str | None = None
    lease_until: datetime | None = None
    installation: str | None = None
    origin: str | None = None
    thread_ref: str | None = None
    cancel_requested: str | None = None
    # The approval (bot/kinds/build/service.py): why it waits, who decided and when, and where
    # a chat front end shows the card (schema v12).
    approval_reason: str | None = None
    decided_by: str | None = None
    decided_at: datetime | None = None
    approval_ref: str | None = None

    @field_validator("id")
    @classmethod
    def _build_id(cls, value: str) -> str:
        if not BUILD_ID_RE.fullmatch(value):
            raise ValueError(f"{value[:50]!r} is not a build id (b and 6-40 letters or digits)")
        return value

    @field_validator("name")
    @classmethod
    def _template_name(cls, value: str) -> str:
        problem = template_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def versioned_name(self) -> str:
        return f"{self.name}-v{self.version}"

    @property
    def short_id(self) -> str:
        return self.id[:SHORT_ID_LENGTH]
