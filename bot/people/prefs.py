"""Per-user settings (saved SSH keys, a default template): read, checked, kept.

Split out of bot/app/service.py, which keeps the audited entry points front ends call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from backends.base import Template
from bot.models import UserPrefs
from bot.models.errors import RequestInvalid
from bot.models.keys import MAX_SSH_KEYS, check_ssh_key
from store.db import RowUnreadable, Store


async def shown(store: Store, user: str) -> UserPrefs:
    """Saved settings to show or prefill a form with. Unreadable ones (the store has
    quarantined them) show as none, so the person can save new ones over them."""
    try:
        return await store.people.get_prefs(user)
    except RowUnreadable:
        return UserPrefs(user=user)


async def for_deploy(store: Store, user: str) -> UserPrefs:
    """Saved settings for a deploy, which must not go out with other keys than the
    person saved: unreadable ones are refused, saying how to replace them."""
    try:
        return await store.people.get_prefs(user)
    except RowUnreadable as bad:
        raise RequestInvalid(
            [
                f"Your saved settings could not be read ({bad.reason}), so they were set "
                "aside. Save your SSH key again with `/deploy key ssh-ed25519 AAAA... "
                "comment` (or in `/deploy settings`); that replaces them."
            ]
        ) from None


async def add_key(store: Store, user: str, text: str) -> UserPrefs:
    """Validate one public key and add it to the user's saved keys."""
    try:
        key = check_ssh_key(text)
    except ValueError as exc:
        raise RequestInvalid([f"SSH key: {exc}."]) from None
    saved = await store.people.add_ssh_key(user, key, MAX_SSH_KEYS)
    if saved is None:
        raise RequestInvalid(
            [f"You already have {MAX_SSH_KEYS} keys saved; remove one in the settings."]
        )
    return saved


def check_keys(texts: tuple[str, ...]) -> tuple[str, ...]:
    keys: list[str] = []
    problems: list[str] = []
    for number, text in enumerate(texts, start=1):
        try:
            keys.append(check_ssh_key(text))
        except ValueError as exc:
            problems.append(f"SSH key {number}: {exc}.")
    if len(keys) > MAX_SSH_KEYS:
        problems.append(f"Save at most {MAX_SSH_KEYS} SSH keys.")
    if problems:
        raise RequestInvalid(problems)
    return tuple(keys)


async def replace(
    store: Store,
    user: str,
    ssh_keys: tuple[str, ...],
    default_template: str | None,
    templates: Callable[[], Awaitable[Mapping[str, Sequence[Template] | str]]],
) -> UserPrefs:
    """Replace the user's keys and default template, after checking both (the template
    must exist on some backend: `templates` lists them per backend)."""
    keys = check_keys(ssh_keys)
    if default_template is not None:
        found = await templates()
        names = {t.name for items in found.values() if not isinstance(items, str) for t in items}
        if default_template not in names:
            raise RequestInvalid(
                [
                    f"template: {default_template!r} is not a template on any backend; "
                    "see `/deploy templates`."
                ]
            )
    prefs = UserPrefs(user=user, ssh_keys=keys, default_template=default_template)
    await store.people.put_prefs(prefs)
    return prefs
