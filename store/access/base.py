"""What every part of `Store` (store/db.py) runs its store functions through: reads and
rare writes on the engine's connection, the writes every deploy makes batched
(store/writer.py), and the wake-up of the outbox's delivery when a notice was kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from store.engine import Engine
from store.sql import Db

P = ParamSpec("P")
T = TypeVar("T")


class Access:
    """The base of `Store`'s parts: `Store.__init__` sets the attributes below."""

    engine: Engine
    # Set by a front end that delivers the outbox: told when this process kept a notice.
    on_notice: Callable[[], None] | None

    async def _call(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Reads, and writes that are rare."""
        return await self.engine.call(fn, *args, **kwargs)

    async def _write(
        self, fn: Callable[Concatenate[Db, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """The writes every deploy makes: batched with those made at the same moment
        where the engine can (store/writer.py)."""
        return await self.engine.write(fn, *args, **kwargs)

    def _noticed(self, written: bool) -> None:
        if written and self.on_notice is not None:
            self.on_notice()
