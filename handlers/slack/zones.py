"""People's time zones, from Slack: `users.info` -> `user.tz`, kept per person.

Lease times are computed in UTC (bot/leases/enforce.py) and shown in the reader's zone
("expires Tue 8 Dec 14:00 CET"). One look-up per person per `KEEP_S`; a person Slack
does not answer for, or whose zone this machine does not know, reads UTC.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

log = logging.getLogger(__name__)
KEEP_S = 3600.0  # people travel: look again after an hour


class Zones:
    def __init__(self, client: AsyncWebClient) -> None:
        self.client = client
        self._known: dict[str, tuple[tzinfo, float]] = {}

    async def of(self, user: str) -> tzinfo:
        known = self._known.get(user)
        if known is not None and time.monotonic() - known[1] < KEEP_S:
            return known[0]
        zone = await self._look_up(user)
        self._known[user] = (zone, time.monotonic())
        return zone

    async def _look_up(self, user: str) -> tzinfo:
        try:
            answer = await self.client.users_info(user=user)
        except SlackApiError as exc:
            log.info("users.info for %s: %s; showing times in UTC", user, exc.response.get("error"))
            return UTC
        except Exception:
            log.exception("users.info for %s failed; showing times in UTC", user)
            return UTC
        name = (answer.get("user") or {}).get("tz")
        if not isinstance(name, str) or not name:
            return UTC
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            log.warning("time zone %r of %s is unknown here; showing times in UTC", name, user)
            return UTC
