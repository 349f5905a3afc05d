"""Per-user settings and front-end references, mixed into `Deployer` (split from
bot/service.py): a person's saved keys and default template (checked by bot/prefs.py),
and where a front end shows a job (its thread, approval card, destroy card), kept so a
restart can find them."""

from __future__ import annotations

from typing import Any

from bot import prefs as user_prefs
from bot.auditing import Audited
from bot.models import UserPrefs
from bot.queries import Queries


class Personal(Audited, Queries):
    """Mixed into `Deployer`."""

    async def prefs(self, user: str) -> UserPrefs:
        """Saved settings to show or prefill a form with (bot/prefs.py)."""
        return await user_prefs.shown(self.store, user)

    async def save_ssh_key(self, user: str, text: str) -> UserPrefs:
        """Validate one public key and add it to the user's saved keys."""
        async with self._audited(user, "save key"):
            return await user_prefs.add_key(self.store, user, text)

    async def save_prefs(
        self, user: str, ssh_keys: tuple[str, ...], default_template: str | None
    ) -> UserPrefs:
        """Replace the user's keys and default template, after checking both."""
        async with self._audited(user, "save settings"):
            return await user_prefs.replace(
                self.store, user, ssh_keys, default_template, self.templates
            )

    async def set_refs(
        self,
        job_id: str,
        *,
        thread_ref: str | None = None,
        approval_ref: str | None = None,
        destroy_ref: str | None = None,
    ) -> None:
        """Remember where a front end shows this job (kept so a restart can find it)."""
        fields = {
            "thread_ref": thread_ref,
            "approval_ref": approval_ref,
            "destroy_ref": destroy_ref,
        }
        given: dict[str, Any] = {k: v for k, v in fields.items() if v}  # columns only
        await self.store.update_job(job_id, **given)
