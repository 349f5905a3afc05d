"""Imports point one way: handlers -> bot -> (backends, store); no package has an import
cycle (counting imports made only for type checking or inside functions); handlers
never reach the store but through the core; the Slack front end is a package that
nothing else loads at import time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What each package may import from the project. The backends take only the root of the
# one exception tree (bot/models/errors.py imports nothing of the project) from bot.
ALLOWED = {
    "handlers": {"handlers", "bot", "backends"},
    "bot": {"bot", "backends", "store"},
    "backends": {"backends", "bot.models.errors"},
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


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (anywhere in it)."""
    paths = {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    modules = set(paths)
    return {name: module_imports(path, modules) - {name} for name, path in paths.items()}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle(package: str) -> None:
    """A cycle hidden under TYPE_CHECKING or inside a function is still a cycle: the two
    modules cannot be understood (or split) one without the other."""
    assert find_cycle(import_graph(package)) is None


def test_the_cycle_check_sees_type_only_and_function_local_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n"
    )
    (tmp_path / "b.py").write_text("def f() -> None:\n    from pkg import a\n")
    modules = {"pkg.a", "pkg.b"}
    graph = {f"pkg.{n}": module_imports(tmp_path / f"{n}.py", modules) for n in "ab"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_slack_front_end_is_in_the_graph() -> None:
    graph = import_graph("handlers")
    assert SLACK + ".app" in graph and SLACK + ".interact" in graph[SLACK + ".app"]


def test_handlers_never_reach_the_store() -> None:
    """Front ends ask the core (its queries, its chat outbox...), never the store: no
    `.store` attribute anywhere in handlers/ (the import rule above keeps `store` out)."""
    bad = []
    for path in sorted((ROOT / "handlers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "store":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reaches .store")
    assert bad == []


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
