"""Access to ../shared/reference/: skip with a reason on a laptop, fail in CI.

CI sets DEPLOYBOT_REQUIRE_REFERENCE=1, so a missing folder is an error there and never
a silently skipped check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"


def reference_json(name: str) -> Any:
    path = REFERENCE / name
    if not path.exists():
        message = f"{path} is missing (the shared reference data is not beside this checkout)"
        if os.environ.get("DEPLOYBOT_REQUIRE_REFERENCE") == "1":
            pytest.fail(message + "; DEPLOYBOT_REQUIRE_REFERENCE=1 forbids skipping")
        pytest.skip(message)
    return json.loads(path.read_text(encoding="utf-8"))
