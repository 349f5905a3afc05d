"""Answers through a command's `response_url`, so that nobody's answer waits for another
person's burst.

Ephemeral answers by `chat.postEphemeral` share one workspace-wide budget (Tier 4, paced
in handlers/slack/pacing.py): behind 200 commands, an answer waited most of two minutes.
Slack hands every slash command a `response_url` of its own instead: it takes up to 5
messages within 30 minutes of the command, on a budget of that command alone. An answer
goes there while the URL is fresh and unused up; once Slack refuses it (spent, expired)
or cannot be reached, the caller falls back to the Web API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from slack_sdk.webhook.async_client import AsyncWebhookClient

log = logging.getLogger(__name__)
RESPONSE_URL_TTL_S = 30 * 60.0  # Slack: valid for 30 minutes after the command
RESPONSE_URL_USES = 5  # Slack: at most 5 messages per response_url
MARGIN_S = 60.0  # not too near the end: a message under way must arrive in time
TIMEOUT_S = 10
KEPT = 10_000  # URLs remembered at most; the oldest are forgotten first


class ResponseUrls:
    """What this process knows of the response URLs it has used: when each was first
    seen, how many messages it took, and which Slack refused. `clock` is injectable."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # url -> (first seen, uses)

    def note(self, url: str) -> None:
        """A command brought `url` (its 30 minutes start about now)."""
        if url not in self._seen:
            if len(self._seen) >= KEPT:
                del self._seen[next(iter(self._seen))]
            self._seen[url] = (self._clock(), 0)

    def usable(self, url: str) -> bool:
        since, uses = self._seen.get(url, (self._clock(), 0))
        fresh = self._clock() - since < RESPONSE_URL_TTL_S - MARGIN_S
        return fresh and uses < RESPONSE_URL_USES

    async def send(self, url: str, text: str, blocks: list[dict[str, Any]]) -> bool:
        """Post an ephemeral answer to `url`; False if it was not taken (the caller then
        answers through the Web API)."""
        self.note(url)
        if not self.usable(url):
            return False
        since, uses = self._seen[url]
        self._seen[url] = (since, uses + 1)  # counted before: Slack may count a failure
        try:
            answer = await AsyncWebhookClient(url, timeout=TIMEOUT_S).send(
                text=text, blocks=blocks, response_type="ephemeral", replace_original=False
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("the command's response_url did not answer (%s); using the Web API", exc)
            self._seen[url] = (since, RESPONSE_URL_USES)
            return False
        if answer.status_code != 200:
            log.warning(
                "Slack refused the command's response_url (%s %s); using the Web API",
                answer.status_code,
                answer.body,
            )
            self._seen[url] = (since, RESPONSE_URL_USES)
            return False
        return True
