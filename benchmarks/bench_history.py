"""`deploybot history N` on a large database: wall time and peak memory of the real CLI.

The CLI reads the history a page at a time (store.history_pages), so its memory must not
grow with N. This builds a SQLite database of `--jobs` jobs (one recorded through the
store, then copied by SQL, ended so no unique index applies), runs the real `deploybot
history` for a small and a large N as processes, and prints each run's wall time and
peak RSS beside the goals. Before paging, `history 100000` on 1M jobs took 6.4 s and
1 GB.

    .venv/bin/python -m benchmarks.bench_history              # 1,000,000 jobs
    .venv/bin/python -m benchmarks.bench_history --jobs 3000 --large 2500   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bot.config.settings import BUNDLED_CONFIG, load_settings
from bot.models import Job, JobState
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from bot.requests.validation import build_request
from store.db import Store

SMALL = 1000
GOAL_MIB = 200  # peak RSS of `history N` for any N
GOAL_GROWTH_MIB = 30  # large N over small N


async def seed(database: Path, jobs: int, log_file: Path) -> None:
    """One job recorded as the bot records it, then `jobs - 1` copies of its row."""
    settings = load_settings(BUNDLED_CONFIG, database=str(database), log_file=str(log_file))
    store = await Store.open(database)
    try:
        args = parse("web0 10.0.0.50")
        assert isinstance(args, DeployArgs)
        request = build_request(args, settings, "alice")
        await store.jobs.insert(Job.for_request(request, JobState.FAILED))
    finally:
        await store.close()
    db = sqlite3.connect(database)
    columns = [r[1] for r in db.execute("PRAGMA table_info(jobs)")]
    made = {
        "id": "printf('j%020d', n)",
        # The store's own form (microseconds, Z): one second apart, newest first.
        "created_at": "strftime('%Y-%m-%dT%H:%M:%S', created_at, printf('-%d seconds', n))"
        " || '.000000Z'",
        "dedupe_key": "NULL",
    }
    picks = ", ".join(made.get(c, c) for c in columns)
    db.execute(
        f"WITH RECURSIVE n(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM n WHERE n < ?) "
        f"INSERT INTO jobs ({', '.join(columns)}) SELECT {picks} FROM n, "
        f"(SELECT * FROM jobs LIMIT 1)",
        (jobs - 1,),
    )
    db.commit()
    db.close()


def history(folder: Path, n: int) -> tuple[float, float, int]:
    """`deploybot history n` as a process: wall s, its peak RSS in MiB, lines printed.
    The bundled configuration (the simulator), on this database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env.update(
        DEPLOYBOT_DATABASE=str(folder / "jobs.db"), DEPLOYBOT_LOG_FILE=str(folder / "bot.log")
    )
    command = [str(Path(sys.executable).with_name("deploybot")), "history", str(n)]
    began = time.perf_counter()
    # A process per measurement: RUSAGE_CHILDREN's peak is of the largest child so far,
    # so each run is measured in a fresh interpreter of its own.
    probe = (
        "import resource, subprocess, sys;"
        "out = subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True).stdout;"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, out.count(chr(10)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *command], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"deploybot history {n} failed:\n{result.stderr}")
    peak_kib, lines = result.stdout.split()
    return wall, int(peak_kib) / 1024, int(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--large", type=int, default=100_000, help="N of the large listing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp:
        folder = Path(tmp)
        database = folder / "jobs.db"
        began = time.perf_counter()
        asyncio.run(seed(database, args.jobs, folder / "seed.log"))
        print(f"{args.jobs} jobs recorded in {time.perf_counter() - began:.1f} s")
        rows = []
        for n in (min(SMALL, args.large), args.large):
            wall, peak, lines = history(folder, n)
            assert lines >= n, (n, lines)  # every job asked for was printed
            rows.append((n, wall, peak))
        growth = rows[1][2] - rows[0][2]
        print(f"{'history N':>10} {'wall s':>7} {'peak MiB':>9} {'goal':>8}")
        for n, wall, peak in rows:
            print(f"{n:>10} {wall:>7.2f} {peak:>9.1f} {'<=' + str(GOAL_MIB):>8}")
        sizes = f"{rows[0][0]} -> {rows[1][0]}"
        print(f"peak growth {sizes}: {growth:.1f} MiB (goal <= {GOAL_GROWTH_MIB})")


if __name__ == "__main__":
    main()
