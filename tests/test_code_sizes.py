"""No product class over 300 lines and no function over 100 (scripts/code_sizes.py measures them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sizes():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("code_sizes", ROOT / "scripts" / "code_sizes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_sizes"] = module
    spec.loader.exec_module(module)
    return module


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
