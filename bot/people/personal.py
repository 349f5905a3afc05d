"""Per-user settings and front-end references: a person's saved keys and default
template (checked by bot/people/prefs.py), and where a front end shows a job or a template
build (its thread, approval card, destroy card), kept so a restart can find them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from backends.base import Template
from bot.models import UserPrefs
from bot.people import prefs as user_prefs
from store.db import Store

# The templates each backend offers (bot/app/queries.py `Queries.templates`).
Templates = Callable[[], Awaitable[dict[str, list[Template] | str]]]


class Personal:
    def __init__(self, store: Store, templates: Templates) -> None:
        """`templates`: what a saved default template is checked against."""
        self.store, self.templates = store, templates

    async def prefs(self, user: str) -> UserPrefs:
        """Saved settings to show or prefill a form with (bot/people/prefs.py)."""
        return await user_prefs.shown(self.store, user)

    async def add_key(self, user: str, text: str) -> UserPrefs:
        """Validate one public key and add it to the user's saved keys."""
        return await user_prefs.add_key(self.store, user, text)

    async def replace(
        self, user: str, ssh_keys: tuple[str, ...], default_template: str | None
    ) -> UserPrefs:
        """Replace the user's keys and default template, after checking both."""
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
        await self.store.jobs.update(job_id, **given)

    async def set_build_refs(
        self, build_id: str, *, thread_ref: str | None = None, approval_ref: str | None = None
    ) -> None:
        """Remember where a front end shows this build (kept so a restart can find it)."""
        fields = {"thread_ref": thread_ref, "approval_ref": approval_ref}
        await self.store.builds.update(build_id, None, (), **{k: v for k, v in fields.items() if v})
