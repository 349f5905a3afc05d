"""The store is composed, not mixed: `Store` holds one repository per table, each query
is one function of a `Db` (store/repositories.py), and nothing writes a query a second
time as an async wrapper around the engine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "store"
# Where the engine is driven itself: the engines, the descriptor that runs a
# repository's functions on them, and `Store`'s own probes.
ENGINE_USERS = {"engine.py", "writer.py", "repository.py", "db.py", "postgres/__init__.py"}


def store_modules() -> list[Path]:
    return sorted(STORE.rglob("*.py"))


def project_classes() -> dict[str, ast.ClassDef]:
    return {
        node.name: node
        for path in store_modules()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.ClassDef)
    }


def base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]


def test_the_mixins_of_store_access_are_gone() -> None:
    assert not (STORE / "access").exists()


def test_no_store_class_is_made_of_mixins() -> None:
    classes = project_classes()
    mixed = {
        name: bases
        for name, node in classes.items()
        if len(bases := [b for b in base_names(node) if b in classes]) > 1
    }
    assert mixed == {}
    said = [
        name for name, node in classes.items() if "Mixed into" in (ast.get_docstring(node) or "")
    ]
    assert said == []


def test_store_is_composed_of_repositories() -> None:
    from store.db import Store
    from store.repository import Repository

    assert Store.__bases__ == (object,)
    # Each repository holds only its queries, bound once.
    for cls in Repository.__subclasses__():
        assert cls.__bases__ == (Repository,), cls


def test_no_query_is_written_twice_around_the_engine() -> None:
    """Outside the engines and the descriptor, nothing in the store calls an engine's
    `call` or `write`: a second, async copy of a query would."""
    found = []
    for path in store_modules():
        if str(path.relative_to(STORE)) in ENGINE_USERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("call", "write")
                and "engine" in ast.unparse(node.value)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_quota_policy_is_the_core_s() -> None:
    """The store counts what jobs hold; whether that is too much (`Cap`, `over`,
    `OverQuota`) is decided in bot/requests/quotas.py."""
    from store import quotas

    assert not {"Cap", "OverQuota", "over", "asked", "check"} & set(vars(quotas))


def test_live_on_host_takes_no_time_it_does_not_use() -> None:
    import inspect

    from store import owners

    assert list(inspect.signature(owners.live_on_host).parameters) == ["db", "host"]
