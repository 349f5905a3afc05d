"""Migration plans kept in the store (issue 30): a plan made from chat has no file, so
it is kept as a row of `migration_plans` and applied by its id. The document is the
plan file's JSON (bot/migration/plan.py), kept as text; its digest has a column of its
own so that a row whose document no longer hashes to it is noticed."""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from bot.models import utcnow
from bot.models.ids import random_letters

# "m" and 9 letters of the id alphabet: short enough to type, about 2**44 of them.
PLAN_ID_RE = re.compile(r"m[a-z0-9]{9}")


def new_plan_id() -> str:
    return "m" + random_letters(9)


class KeptPlan(BaseModel):
    """One row of `migration_plans`."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=new_plan_id, pattern=PLAN_ID_RE.pattern)
    digest: str  # the plan's source digest, sha256:<hex>
    document: str  # the plan as JSON (what a plan file holds)
    created_at: datetime = Field(default_factory=utcnow)
    created_by: str


# "a" and 9 letters: an apply asked from chat, whose end is told where it was asked.
APPLY_ID_RE = re.compile(r"a[a-z0-9]{9}")


def new_apply_id() -> str:
    return "a" + random_letters(9)


def apply_id_of(key: str) -> str:
    """The apply id of a chat command's inbox key: the same command, redelivered or
    run again after its process died, records the same apply (store/applies.py)."""
    return "a" + hashlib.sha256(key.encode()).hexdigest()[:9]


class MigrationApply(BaseModel):
    """One row of `migration_applies` (schema v20): an apply asked from chat whose builds
    were still in flight when it answered. The store ends it, and keeps the notice that
    tells its final table in `origin`, in the transaction that ends the last of
    `build_ids` (store/applies.py); the table is drawn from the store at delivery."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=new_apply_id, pattern=APPLY_ID_RE.pattern)
    plan_id: str  # the kept plan (migration_plans), applied by its id
    requester: str
    origin: str  # the channel it was asked from
    rebuilds: str  # JSON: the apply's rebuilds (bot/migration/apply.py `rebuilds_document`)
    build_ids: tuple[str, ...]
    created_at: datetime = Field(default_factory=utcnow)
    ended_at: datetime | None = None
