"""``hetfed bench NAME``: reproductions of the papers' claims, found automatically.

Every ``<name>.bench.toml`` grid of the experiment package (``hetfed.cli.experiments``) is a benchmark of that
name, run by the generic runner in :mod:`hetfed.cli.reproduce`; a new algorithm's grid is listed without
touching this module. System benchmarks are scripts in ``benchmarks/`` (docs/benchmarks.md).
"""

from __future__ import annotations

from hetfed.cli.reproduce import grids, load_grid
from hetfed.cli.reproduce import main as reproduce
from hetfed.wire.config import ConfigError


def list_benchmarks() -> int:
    """Print every benchmark with its title."""
    for name in grids():
        print(f"{name:<16} {load_grid(name).title}")
    return 0


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` with ``argv``."""
    if name not in grids():
        raise ConfigError(f"unknown benchmark {name!r}; available: {', '.join(grids()) or 'none'}")
    return reproduce(name, argv)
