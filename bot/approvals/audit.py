"""The audit of refusals: every action a front end asks for runs inside `Audit.audited`
(bot/app/service.py), so a refusal or a redelivery leaves one audit event, the only store
change a refused action makes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from bot.models import AuditEvent
from bot.models.errors import Duplicate, UserError
from store.db import Store

log = logging.getLogger("bot.app.service")


class Audit:
    def __init__(self, store: Store) -> None:
        self.store = store

    @contextlib.asynccontextmanager
    async def audited(self, actor: str, action: str) -> AsyncIterator[None]:
        """Record a refusal (the only store change a refused action makes), then re-raise."""
        try:
            yield
        except Duplicate as dup:
            await self.record(actor, action, dup.message, outcome="duplicate")
            raise
        except UserError as exc:
            await self.record(actor, action, exc.message)
            raise

    async def record(self, actor: str, action: str, detail: str, outcome: str = "refused") -> None:
        """Keep a refused or repeated action in the audit log (front ends ask for it,
        through `Deployer.audit`, for refusals they decide themselves, such as a command
        that does not parse)."""
        try:
            await self.store.audit.add(
                AuditEvent(actor=actor, action=action, outcome=outcome, detail=detail[:2000])
            )
        except Exception:
            log.exception("could not write the audit event for %s by %s", action, actor)
