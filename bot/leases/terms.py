"""Lease lengths as people write them ("7d", "12h", "never") and the `[leases]` section.

Kept apart from bot/leases/enforce.py (which runs leases) so the parser and the settings can
use them without importing the store. A length is whole seconds; `None` is "never".
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

NEVER = "never"
# [0-9], not \d: \d matches U+FF17 (a full-width 7), which int() then reads as 7.
_LENGTH_RE = re.compile(r"^([0-9]{1,6})([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
EXAMPLE = "7d"


def parse_length(text: str) -> int | None:
    """Seconds for "30m", "12h", "7d", "2w"; None for "never"; ValueError otherwise.
    ASCII only, lower-cased only then (no Unicode folding into a unit)."""
    word = text.strip().lower() if text.isascii() else text
    if word == NEVER:
        return None
    match = _LENGTH_RE.fullmatch(word) if word.isascii() else None
    if not match:
        raise ValueError(
            f"{text[:40]!r} is not a lease length: give a number and a unit (m, h, d or w), "
            f"like {EXAMPLE}, or {NEVER}"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def show_length(seconds: int | None) -> str:
    """A length written back in the largest exact unit up to days: 1209600 -> "14d"
    (people count leases in days, so no weeks)."""
    if seconds is None:
        return NEVER
    for unit in ("d", "h", "m"):
        if seconds and seconds % _UNIT_S[unit] == 0:
            return f"{seconds // _UNIT_S[unit]}{unit}"
    return f"{seconds}s"


def _length(value: object) -> object:
    return parse_length(value) if isinstance(value, str) else value


def _finite(value: object) -> object:
    seconds = _length(value)
    if seconds is None:
        raise ValueError(f"{NEVER!r} is not allowed here: give a length like {EXAMPLE}")
    return seconds


Length = Annotated[int | None, BeforeValidator(_length)]  # "never" allowed
Finite = Annotated[int, BeforeValidator(_finite), Field(ge=0)]


class LeaseSettings(BaseModel):
    """`[leases]`: how long a VM lives unless extended, and what happens around its end.

    `default` per template (`templates`) or backend (`backends`) overrides, template
    first; `max` caps what a request or an extension may ask; `never` (no end) only
    for approvers and members of `never_groups`. Reminders go `reminders` before the
    end; at the end the VM is powered off, and destroyed `grace` later."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: Length = 14 * 86400
    max: Finite = 90 * 86400
    grace: Finite = 3 * 86400
    reminders: tuple[Finite, ...] = (3 * 86400, 86400)
    step: Finite = 7 * 86400  # the Extend button
    templates: dict[str, Length] = {}
    backends: dict[str, Length] = {}
    never_groups: tuple[str, ...] = ()
    check_every_s: float = Field(default=60, gt=0)

    @model_validator(mode="after")
    def _within_max(self) -> LeaseSettings:
        defaults = {"default": self.default}
        defaults.update({f"templates.{k}": v for k, v in self.templates.items()})
        defaults.update({f"backends.{k}": v for k, v in self.backends.items()})
        for key, seconds in defaults.items():
            if seconds is not None and seconds > self.max:
                raise ValueError(
                    f"{key} ({show_length(seconds)}) is longer than max "
                    f"({show_length(self.max)}): shorten it or raise max"
                )
        if self.step <= 0:
            raise ValueError("step must be longer than 0s: the Extend button adds it")
        return self

    def default_for(self, template: str, backend: str) -> int | None:
        """The lease a request gets when it asks for none."""
        if template in self.templates:
            return self.templates[template]
        return self.backends.get(backend, self.default)
