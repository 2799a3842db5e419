"""The example package ``examples/hetfed_example`` on sys.path (it need not be pip-installed), and its helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hetfed_example"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))


def example_env() -> dict[str, str]:
    """The environment for a subprocess that must import ``hetfed_example`` (PYTHONPATH extended)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), env.get("PYTHONPATH", "")) if p)
    return env
