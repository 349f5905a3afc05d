"""The tests' own layout (issue 27 item 8): test files hold tests, `tests/support/` holds
what they share. A test module never imports another test module (nor conftest.py, which
pytest loads itself), and no helper module sits beside the tests in tests/: a helper that
two test files need lives in the support package, where a reader looks for it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# What may sit directly in tests/ besides the test_*.py files.
ALLOWED = {"__init__.py", "conftest.py", "support", "__pycache__"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports too), as a
    dotted name under `tests.` where it is one of ours."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative to the tests package
                base = "tests" + (f".{node.module}" if node.module else "")
            else:
                base = node.module or ""
            found.add(base)
            if base == "tests":  # `from tests import test_x`
                found.update(f"tests.{alias.name}" for alias in node.names)
    return found


def test_no_test_module_imports_another_test_module() -> None:
    wrong = []
    for path in sorted(TESTS.glob("test_*.py")):
        for module in sorted(imported_modules(path)):
            parts = module.split(".")
            if parts[0] != "tests" or len(parts) < 2:
                continue
            if parts[1].startswith("test_") or parts[1] == "conftest":
                wrong.append(f"{path.name} imports {module}")
    assert not wrong, "move what they share to tests/support/:\n" + "\n".join(wrong)


def test_no_helper_module_beside_the_tests() -> None:
    extra = sorted(
        entry.name
        for entry in TESTS.iterdir()
        if entry.name not in ALLOWED
        and not (entry.name.startswith("test_") and entry.suffix == ".py")
        and not entry.name.startswith(".")
    )
    assert not extra, f"helpers belong in tests/support/, not tests/: {extra}"


def test_the_guard_sees_an_import_of_a_test_module(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "from tests.test_crash import restart\n"
        "def f():\n"
        "    from tests import test_cli\n"
        "    from . import conftest\n"
    )
    assert {"tests.test_crash", "tests.test_cli", "tests.conftest"} <= imported_modules(sample)
