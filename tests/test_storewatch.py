"""StoreWatch tells an outage from a burst: a slow probe is not a dead database.

On SQLite the probe runs on the store's one thread, behind whatever writes are queued
there; here one write waits for a lock another connection holds (as during a burst, or
a CLI's long write), so probes get no answer in time while the database is fine. Only
several such probes in a row count as an outage; a driver's error counts at once.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from bot.ownership.storewatch import StoreWatch
from store.db import Store


async def test_slow_probes_behind_a_waiting_write_are_an_outage_only_in_a_row(
    tmp_path: Path,
) -> None:
    store = await Store.open(tmp_path / "jobs.db")
    other = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
    try:
        watch = StoreWatch(store, every_s=1.0, timeout_s=0.05, slow_probes=3)
        assert await watch.check() and watch.problem == ""
        other.execute("BEGIN EXCLUSIVE")  # the store's next write waits for this
        write = asyncio.ensure_future(
            store.engine.call(lambda db: db.execute("CREATE TABLE blocked (x INTEGER)"))
        )
        await asyncio.sleep(0)  # let it reach the store's thread first (a yield, no wait)
        assert await watch.check(), "one slow probe is not an outage"
        assert await watch.check(), "two are not either"
        assert not await watch.check()
        assert "no answer to 3 probes in a row" in watch.problem
        other.execute("COMMIT")
        await write
        assert await watch.check() and watch.problem == ""
        assert await watch.check(), "the count of slow probes starts again"
    finally:
        other.close()
        await store.close()


async def test_an_error_from_the_database_is_an_outage_at_once(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "jobs.db")
    watch = StoreWatch(store, every_s=1.0, timeout_s=5.0, slow_probes=3)
    await store.close()  # every call now fails, as with a connection that is gone
    assert not await watch.check()
    assert watch.problem
