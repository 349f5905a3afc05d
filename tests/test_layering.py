"""Imports point one way: handlers -> bot -> (backends, store); the Slack front end is a
package that nothing else loads at import time, and whose modules import in a line."""

from __future__ import annotations

import ast
import subprocess
import sys
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
SLACK = "handlers.slack"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in ALLOWED}


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (inside functions and under
    TYPE_CHECKING too: a cycle hidden there is still a cycle): `from P import M` counts
    as importing the module P.M when there is one."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules


def top_level_imports(path: Path) -> set[str]:
    """Modules imported when `path` is imported (not those imported inside functions)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `graph` (module -> modules it imports), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                return [*path[path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    allowed = ALLOWED[package]
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in project_imports(path):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_the_front_ends_import_without_cycles() -> None:
    paths = {module_name(p): p for p in sorted((ROOT / "handlers").rglob("*.py"))}
    modules = set(paths)
    graph = {name: module_imports(path, modules) for name, path in paths.items()}
    assert SLACK + ".app" in graph and SLACK + ".interact" in graph[SLACK + ".app"]
    assert find_cycle(graph) is None


def test_find_cycle_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": set()}
    assert find_cycle(graph) == ["b", "c", "b"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_serve_and_manifest_commands_load_the_slack_package() -> None:
    """The shell and the CLI must not need Bolt: outside handlers/slack/, only
    entry.py names the package, and only inside the commands that use it."""
    bad = []
    for path in sorted((ROOT / "handlers").rglob("*.py")):
        if module_name(path).startswith(SLACK):
            continue
        loaded = top_level_imports(path)
        for name in project_imports(path):
            slack = name == SLACK or name.startswith(SLACK + ".")
            if slack and (path.name != "entry.py" or name in loaded):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_the_cli_and_the_manifest_do_not_load_bolt() -> None:
    code = (
        "import sys, handlers.entry, handlers.slack.manifest; "
        "print(sorted(m for m in sys.modules if m.startswith(('slack_bolt', 'slack_sdk'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert loaded.stdout.strip() == "[]"
