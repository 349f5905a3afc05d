"""Names show where things live (issue 27 item 7): no star imports, no name re-exported
under another module's roof (`from m import X as X`, an `__all__` naming what the
module only imports, `X = Y` aliases of imported names, an `__init__.py` importing what
it never uses), and no module-level logger that nothing logs to (issue 27 item 10)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The project's packages; the store is checked for star imports and loggers only (its
# repositories are being reshaped in their own change).
PACKAGES = ("bot", "handlers", "backends", "store", "benchmarks")
REEXPORT_CHECKED = ("bot", "handlers", "backends")


def modules(packages: tuple[str, ...]) -> Iterator[tuple[Path, ast.Module]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT), ast.parse(path.read_text(), filename=str(path))


def imported_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """The names a module's top level binds by importing, each with its statement."""
    names: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def loaded_names(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def test_no_star_imports() -> None:
    found = [
        f"{path}:{node.lineno}: from {node.module} import *"
        for path, tree in modules(PACKAGES)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
    ]
    assert not found, "import each name from the module that defines it:\n" + "\n".join(found)


def is_logger(node: ast.stmt) -> str | None:
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return None
    target = node.targets[0]
    called = ast.unparse(node.value.func)
    if isinstance(target, ast.Name) and called.endswith(("getLogger", "get_logger")):
        return target.id
    return None


def test_every_module_logger_is_used() -> None:
    found = []
    for path, tree in modules(PACKAGES):
        for node in tree.body:
            name = is_logger(node)
            if name and name not in loaded_names(tree):
                found.append(f"{path}:{node.lineno}: {name} is never logged to")
    assert not found, "delete the unused loggers:\n" + "\n".join(found)


def reexports(path: Path, tree: ast.Module) -> Iterator[str]:
    imported = imported_names(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname == alias.name:
                    yield f"{path}:{node.lineno}: {alias.name} re-exported (`as {alias.name}`)"
        if not isinstance(node, ast.Assign):
            continue
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        value = node.value
        if names == ["__all__"] and isinstance(value, ast.List | ast.Tuple):
            for element in value.elts:
                if isinstance(element, ast.Constant) and element.value in imported:
                    yield f"{path}:{node.lineno}: __all__ re-exports {element.value}"
        elif len(names) == 1:
            root = value.value if isinstance(value, ast.Attribute) else value
            if isinstance(root, ast.Name) and root.id in imported:
                yield f"{path}:{node.lineno}: {names[0]} = {ast.unparse(value)} is an alias"
    if path.name == "__init__.py":
        used = loaded_names(tree)
        for name, node in imported.items():
            if name not in used and name != "annotations":
                yield f"{path}:{node.lineno}: {name} imported only to be re-exported"


def test_no_reexports_or_aliases() -> None:
    found = [line for path, tree in modules(REEXPORT_CHECKED) for line in reexports(path, tree)]
    assert not found, (
        "import each name from the module that defines it, under its own name:\n" + "\n".join(found)
    )
