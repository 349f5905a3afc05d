"""bot/ shows the architecture: its modules live in subpackages by concern, each of which
says in its docstring what it owns, and the installed package carries every module and
data file (a package missing from pyproject.toml would ship an image that cannot start)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
# Modules that may stay at bot/'s top: none but the package itself.
FLAT_ALLOWED = {"__init__.py"}


def test_bot_has_no_flat_modules() -> None:
    flat = {p.name for p in (ROOT / "bot").glob("*.py")} - FLAT_ALLOWED
    assert not flat, f"modules at bot/'s top, not in a subpackage by concern: {sorted(flat)}"


def test_every_bot_subpackage_says_what_it_owns() -> None:
    for init in sorted((ROOT / "bot").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 12, f"{init.parent.name}: no docstring of what it owns"


def test_pyproject_ships_every_package_and_data_file() -> None:
    """What `pip install .` (the Dockerfile) installs: setuptools' own discovery, run with
    pyproject.toml's settings, must find every package; package-data must name every data
    file (the example configuration, the image catalogue, py.typed)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config["packages"]
    found = (
        set(packages)
        if isinstance(packages, list)
        else set(find_packages(str(ROOT), include=packages["find"]["include"]))
    )
    tops = ("bot", "handlers", "backends", "store")
    wanted = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in tops
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert wanted - found == set(), "packages `pip install .` would leave out"
    data = config["package-data"]
    for top in tops:
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and p.suffix in {".toml", ".typed", ".json", ".yml"}:
                package = ".".join(p.parent.relative_to(ROOT).parts)
                assert p.name in data.get(package, []), f"{p.relative_to(ROOT)} not in package-data"
