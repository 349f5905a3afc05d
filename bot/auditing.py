"""The audit of refusals, mixed into `Deployer` (split from bot/service.py): every action a
front end asks for runs inside `_audited`, so a refusal or a redelivery leaves one audit
event, the only store change a refused action makes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from bot.errors import DeployBotError, Duplicate
from bot.models import AuditEvent
from store.db import Store

log = logging.getLogger("bot.service")


class Audited:
    """Mixed into `Deployer`: `store` is the deployer's."""

    store: Store

    @contextlib.asynccontextmanager
    async def _audited(self, actor: str, action: str) -> AsyncIterator[None]:
        """Record a refusal (the only store change a refused action makes), then re-raise."""
        try:
            yield
        except Duplicate as dup:
            await self.audit(actor, action, dup.message, outcome="duplicate")
            raise
        except DeployBotError as exc:
            await self.audit(actor, action, exc.message)
            raise

    async def audit(self, actor: str, action: str, detail: str, outcome: str = "refused") -> None:
        """Keep a refused or repeated action in the audit log (front ends call it for
        refusals they decide themselves, such as a command that does not parse)."""
        try:
            await self.store.add_audit(
                AuditEvent(actor=actor, action=action, outcome=outcome, detail=detail[:2000])
            )
        except Exception:
            log.exception("could not write the audit event for %s by %s", action, actor)
