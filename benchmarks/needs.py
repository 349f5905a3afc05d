"""What a benchmark needs beyond this checkout, said plainly when it is missing.

Some benchmarks run against the parts the tests use (../shared/reference, Debian's
PostgreSQL, VMware's vcsim) through the tests' support modules, which skip (or, under
DEPLOYBOT_REQUIRE_<PART>=1, fail) a test when their part is missing. Outside pytest
that would end the benchmark with a bare traceback; `run` turns it into one line that
says what is missing and how to get it, and exit status MISSING, which the smoke tests
(tests/test_benchmarks.py) tell apart from a benchmark that broke.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.support.reference import REFERENCE

MISSING = 3
T = TypeVar("T")


class Missing(Exception):
    """A part this benchmark needs is not here; the text says which and how to get it."""


def run(main: Callable[[], T]) -> T:
    """Run a benchmark's `main`; a missing part ends it with MISSING and the reason."""
    try:
        return main()
    except Missing as exc:
        reason = str(exc)
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:  # the tests' support
        reason = str(exc.msg)
    print(f"this benchmark cannot run here: {reason}", file=sys.stderr)
    raise SystemExit(MISSING)


def reference(name: str) -> Path:
    """A file of the shared reference (../shared/reference beside the checkout)."""
    path = REFERENCE / name
    if not path.exists():
        raise Missing(
            f"{path} is missing: this benchmark reads the shared reference data; put "
            f"the shared/reference folder beside this checkout (at {REFERENCE})"
        )
    return path
