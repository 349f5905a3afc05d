"""One exception tree: every exception class the project defines (in bot/, backends/,
store/, handlers/) derives from `bot.models.errors.DeployBotError`, and no exception
class name is defined twice, so each name has one meaning wherever it is caught.

Classes defined inside functions are found too (by reading the source), and must not
be exceptions: an exception is a name others catch, so it lives at module level."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from bot.models.errors import DeployBotError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bot", "backends", "store", "handlers")
# Exception classes allowed outside the tree, each with the reason.
JUSTIFIED: dict[str, str] = {
    "backends.sim.vm.SimulatedCrash": "the fake backend's stand-in for a bug (a `crash` "
    "fault): it must be caught by nothing that catches the tree's errors, exactly as an "
    "unexpected exception would not be, so the tests see how a bug is handled",
}


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def exception_classes() -> list[type[BaseException]]:
    """Every exception class defined at module level in the project's packages."""
    found = []
    for name in module_names():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                found.append(cls)
    return found


def test_every_exception_derives_from_the_one_root() -> None:
    outside = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in exception_classes()
        if not issubclass(cls, DeployBotError)
        and f"{cls.__module__}.{cls.__qualname__}" not in JUSTIFIED
    ]
    assert outside == []


def test_no_exception_name_is_defined_twice() -> None:
    where: dict[str, list[str]] = {}
    for cls in exception_classes():
        where.setdefault(cls.__name__, []).append(cls.__module__)
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def test_no_exception_class_is_defined_inside_a_function() -> None:
    """The check above imports modules, which only shows module-level classes; a class
    inside a function whose base looks like an exception would escape it."""
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.ClassDef) and any(
                        ast.unparse(b).endswith(("Error", "Exception")) for b in node.bases
                    ):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert bad == []


def test_the_root_module_imports_nothing_of_the_project() -> None:
    """Every layer imports the root, so it must import none of them."""
    path = ROOT / "bot" / "models" / "errors.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert [m for m in imported if m.split(".")[0] in PACKAGES] == []


def test_nothing_catches_the_root() -> None:
    """The branches mean different things (a refusal to show, a bug in a backend's
    signal, a store's answer): catching the root would treat them alike."""
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ExceptHandler) or node.type is None:
                    continue
                if "DeployBotError" in ast.unparse(node.type):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []
