"""Imports point one way: handlers -> bot -> (backends, store)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What each package may import from the project.
ALLOWED = {
    "handlers": {"handlers", "bot", "backends", "store"},
    "bot": {"bot", "backends", "store"},
    "backends": {"backends"},
    "store": {"store", "bot.models"},
}


def project_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in ALLOWED}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    allowed = ALLOWED[package]
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in project_imports(path):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []
