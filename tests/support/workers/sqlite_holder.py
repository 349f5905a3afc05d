"""A second process holding a SQLite file's write lock (BEGIN IMMEDIATE) until told.

Prints "holding" once it has the lock; a line on stdin makes it let go (ROLLBACK) and
print "released". Run as `python -m tests.support.workers.sqlite_holder PATH`.
"""

from __future__ import annotations

import sqlite3
import sys


def main(path: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("BEGIN IMMEDIATE")
    print("holding", flush=True)
    sys.stdin.readline()
    conn.execute("ROLLBACK")
    conn.close()
    print("released", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
