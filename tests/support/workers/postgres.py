"""A separate process on a shared PostgreSQL store, for tests/test_postgres_store.py.

    python -m tests.support.workers.postgres open URL
        open (and so migrate) the store, print how many migration steps ran
    python -m tests.support.workers.postgres claim URL RUNNER
        claim queued jobs three at a time until none is left; print one id a line

The password comes from DEPLOYBOT_DATABASE_PASSWORD, as deploybot reads it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import timedelta

import psycopg

from bot.models import utcnow
from store.db import Store
from store.postgres import schema


async def claim(url: str, runner: str) -> None:
    store = await Store.open(url, password=os.environ["DEPLOYBOT_DATABASE_PASSWORD"])
    try:
        print("ready", flush=True)
        sys.stdin.readline()  # all claimers start together, each with its store open
        while True:
            now = utcnow()
            got = await store.runners.claim_queued(runner, now, now + timedelta(minutes=5), 3)
            if not got:
                return
            for job_id, _backend in got:
                print(job_id, flush=True)
    finally:
        await store.close()


def open_and_count(url: str) -> None:
    password = os.environ["DEPLOYBOT_DATABASE_PASSWORD"]
    with psycopg.connect(url, password=password, autocommit=True) as conn:
        print(schema.migrate(conn), flush=True)


def main() -> None:
    mode, url, *rest = sys.argv[1:]
    if mode == "open":
        open_and_count(url)
    else:
        asyncio.run(claim(url, rest[0]))


if __name__ == "__main__":
    main()
