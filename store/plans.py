"""Migration plans made from chat (bot/migration/), kept by id until applied."""

from __future__ import annotations

from typing import Any

from bot.models.plans import KeptPlan
from store.sql import Db, immediate, insert_sql
from store.tx import ts


def keep_plan(db: Db, /, plan: KeptPlan) -> KeptPlan:
    row: dict[str, Any] = {**plan.model_dump(), "created_at": ts(plan.created_at)}
    with immediate(db):
        db.execute(insert_sql("migration_plans", list(row)), row)
    return plan


def get_plan(db: Db, plan_id: str) -> KeptPlan | None:
    rows = db.query("SELECT * FROM migration_plans WHERE id = ?", [plan_id])
    if not rows:
        return None
    return KeptPlan.model_validate({k: v for k, v in rows[0].items() if k != "rowid"})
