"""``hetfed bench NAME``: reproductions of the papers' claims and system benchmarks, by name.

Each entry maps a name to ``module:function``; the function takes the remaining arguments and
returns an exit code. Benchmarks use the same aggregator and client processes as everything else.
"""

from __future__ import annotations

import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "fedh2l": ("hetfed.cli.bench_fedh2l:main",
               "FedH2L vs IND, AGG and no-projection on Rotated MNIST-5k, heterogeneous nets; bytes vs FedAvg"),
    "fedcma": ("hetfed.cli.bench_fedcma:main",
               "Fed-CMA vs Local and head-only FedAvg on MNIST-5k, 20 orgs, CNN+MLP encoders; latent discriminator; bytes vs FedAvg"),
    # name: ("module:function", one-line description)
}


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` with ``argv``; ``--list`` prints what exists."""
    if name in ("--list", "list"):
        for key, (_, desc) in sorted(BENCHMARKS.items()):
            print(f"{key:<16} {desc}")
        return 0
    if name not in BENCHMARKS:
        raise SystemExit(f"hetfed bench: unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS)) or 'none'}")
    module, _, func = BENCHMARKS[name][0].partition(":")
    return int(getattr(importlib.import_module(module), func)(argv))
