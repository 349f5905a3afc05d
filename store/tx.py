"""Times as the store writes them."""

from __future__ import annotations

from datetime import UTC, datetime


def ts(moment: datetime) -> str:
    """One fixed-width UTC format, so text order is time order in every query."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
