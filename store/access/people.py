"""`Store`'s people and housekeeping (split from store/db.py): saved settings and keys
(store/users.py), the audit log, and the gc runs whose dry run an apply must follow
(store/gc.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from bot.models import AuditEvent, UserPrefs
from store import gc, users
from store.access.base import Access


class PeopleAccess(Access):
    """Mixed into `Store`."""

    async def get_prefs(self, user: str) -> UserPrefs:
        return await self._call(users.get_prefs, user)

    async def put_prefs(self, prefs: UserPrefs) -> None:
        await self._call(users.put_prefs, prefs)

    async def add_ssh_key(self, user: str, key: str, max_keys: int) -> UserPrefs | None:
        return await self._call(users.add_key, user, key, max_keys)

    async def add_audit(self, event: AuditEvent) -> None:
        await self._write(users.add_audit, event)

    async def audit_events(self, limit: int = 50) -> list[AuditEvent]:
        """Newest first."""
        return await self._call(users.audit_events, limit)

    # --- gc runs ------------------------------------------------------------------

    async def record_gc_run(
        self, scope: Sequence[str], vm_keys: Sequence[str], *, applied: bool
    ) -> None:
        await self._call(gc.record_gc_run, scope, vm_keys, applied)

    async def last_gc_dry_run(self, scope: Sequence[str], *, since: datetime) -> set[str] | None:
        return await self._call(gc.last_gc_dry_run, scope, since)
