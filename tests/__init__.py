"""deploybot's tests: tests/test_*.py, with what they share in tests/support/."""

import pytest

# The shared helpers' asserts report like the tests' own (they lived in test files before).
pytest.register_assert_rewrite("tests.support")
