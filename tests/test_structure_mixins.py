"""Composition over mixins (issue 27 item 5): no class of backends/, handlers/, bot/ or
store/ is assembled from two or more of the project's classes, and no docstring says a
class is "mixed into" another. A part that owns its own state is held, not inherited.

Protocols, generics, exceptions, enums and other bases from outside the project are
not counted; a base the project defines as a `Protocol` is not either (declaring the
interfaces a class implements is no mixin)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backends", "handlers", "bot", "store")


def modules() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def base_name(base: ast.expr) -> str | None:
    """`Name` or `module.Name` as written; a subscripted base (`Generic[T]`) by its name."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return None


class Index:
    """Every class the project defines, by module, and whether it is a Protocol."""

    def __init__(self) -> None:
        self.trees = {module_name(p): ast.parse(p.read_text(), str(p)) for p in modules()}
        self.protocols: set[tuple[str, str]] = set()
        for module, tree in self.trees.items():
            for node in ast.walk(tree):
                bases = {base_name(b) for b in getattr(node, "bases", [])}
                if isinstance(node, ast.ClassDef) and "Protocol" in bases:
                    self.protocols.add((module, node.name))

    def project_names(self, module: str) -> dict[str, tuple[str, str]]:
        """The names in `module` that are classes of the project: its own, and those it
        imports from the project (where defined, as far as the index can tell)."""
        names: dict[str, tuple[str, str]] = {}
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.ClassDef):
                names[node.name] = (module, node.name)
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.split(".")[0] in PACKAGES
            ):
                for alias in node.names:
                    names[alias.asname or alias.name] = (node.module, alias.name)
        return names

    def project_bases(self, module: str, node: ast.ClassDef) -> list[str]:
        names = self.project_names(module)
        found = []
        for base in node.bases:
            name = base_name(base)
            if name is None or name not in names or names[name] in self.protocols:
                continue
            found.append(name)
        return found


def docstrings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node)
            if text:
                yield getattr(node, "lineno", 1), text


def test_no_class_is_assembled_from_two_of_the_projects_classes() -> None:
    index = Index()
    found = []
    for module, tree in index.trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = index.project_bases(module, node)
                if len(bases) >= 2:
                    found.append(f"{module}:{node.lineno} {node.name}({', '.join(bases)})")
    assert found == [], "classes built from mixins (hold the parts instead):\n" + "\n".join(found)


def test_no_docstring_says_a_class_is_mixed_into_another() -> None:
    index = Index()
    found = [
        f"{module}:{line}"
        for module, tree in index.trees.items()
        for line, text in docstrings(tree)
        if "mixed into" in " ".join(text.lower().split())
    ]
    assert found == [], "mixins (hold the parts instead):\n" + "\n".join(found)


def test_the_guard_sees_a_mixin_and_passes_a_protocol() -> None:
    """The check itself: two project bases are found; Protocol bases are not counted."""
    index = Index()
    index.trees["bot.example"] = ast.parse(
        "from typing import Protocol\n"
        "from backends.base import Backend\n"
        "class A: ...\n"
        "class B: ...\n"
        "class C(A, B): ...\n"
        "class D(Backend, Exception): ...\n"
    )
    classes = {
        n.name: n for n in ast.walk(index.trees["bot.example"]) if isinstance(n, ast.ClassDef)
    }
    assert index.project_bases("bot.example", classes["C"]) == ["A", "B"]
    assert index.project_bases("bot.example", classes["D"]) == []
