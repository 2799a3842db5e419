"""No product class over 300 lines and no function over 100 (scripts/code_sizes.py measures them)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.conftest import load_script


def _sizes() -> ModuleType:
    """scripts/code_sizes.py, imported once."""
    return load_script("code_sizes")


def test_no_product_class_or_function_is_over_its_limit() -> None:
    sizes = _sizes()
    assert sizes.over_limits() == [], (
        f"over {sizes.CLASS_LIMIT} lines a class or {sizes.FUNCTION_LIMIT} a function: split by concern")


def test_the_limits_see_a_long_function(tmp_path: Path) -> None:
    sizes = _sizes()
    module = tmp_path / "services" / "hetfed" / "long.py"
    module.parent.mkdir(parents=True)
    body = "\n".join(f"        x{i} = {i}" for i in range(sizes.FUNCTION_LIMIT))
    module.write_text(f"class Short:\n    def long(self):\n{body}\n")
    assert sizes.over_limits(tmp_path) == [f"services/hetfed/long.py:Short.long ({sizes.FUNCTION_LIMIT + 1} lines)"]
