"""`Host`: the few things of the bot (handlers/slack/app.py) that the listeners in
interact.py and modals.py use. `SlackBot` is one; naming only these keeps those modules
from importing app.py, which imports them to register the listeners."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

from slack_bolt.async_app import AsyncApp
from slack_sdk.web.async_client import AsyncWebClient

from bot.app.service import Deployer
from bot.config.settings import Settings
from handlers.messages.text import Said
from handlers.slack.catalog import Catalog
from handlers.slack.home import HomeTabs
from handlers.slack.zones import Zones


class Host(Protocol):
    """What the listeners need of the bot that registers them."""

    app: AsyncApp
    deployer: Deployer
    settings: Settings
    client: AsyncWebClient
    catalog: Catalog  # the last look-up of templates, kept for external_select
    home: HomeTabs  # the App Home, published again after a click on its buttons
    zones: Zones  # people's time zones: times are shown in the reader's

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` after the ack, in a task the host keeps until it is done."""
        ...

    async def tell(
        self,
        channel: str,
        user: str,
        lines: Sequence[str | Said],
        *,
        monospace: bool = False,
        reply_url: str | None = None,
    ) -> None:
        """An ephemeral answer to `user` (through `reply_url`, a response_url, if it can)."""
        ...

    async def answering(
        self,
        channel: str,
        user: str,
        work: Coroutine[Any, Any, Sequence[str | Said]],
        *,
        mono: bool = False,
        reply_url: str | None = None,
    ) -> None:
        """Run `work` and tell the user its lines, or what went wrong."""
        ...

    async def show(
        self,
        channel: str,
        user: str,
        text: str,
        blocks: list[dict[str, Any]],
        *,
        reply_url: str | None = None,
    ) -> None:
        """An ephemeral message of Block Kit to `user` (`text`: its notification)."""
        ...
