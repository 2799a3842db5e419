"""Algorithm specs: the declared wire contract of every algorithm, shared by aggregator and clients.

One module per algorithm holds its config dataclass and its ``SPEC``, which names the algorithm's server
half and client half as ``"module:Class"`` (imported only by the side that runs them). ``REGISTERED`` below
is the one registration: adding an algorithm adds its files and one line there. An algorithm kept outside
hetfed registers the same way through the ``HETFED_ALGORITHMS`` environment variable (comma-separated
``"module:NAME"`` references, read by every process). Presets (``ditto_cos``, ``fedl2r``, ...) are another
algorithm's config under their own names. This package imports no half.
"""

from __future__ import annotations

import importlib
import os
from typing import TypeVar

from hetfed.wire.specs.base import AlgorithmSpec, Figure, TrainConfig, WireDtype

__all__ = ["REGISTERED", "SPECS", "AlgorithmSpec", "Figure", "TrainConfig", "WireDtype", "get_spec", "load_half", "register"]

# Every algorithm's spec, as "module:NAME" (one line per algorithm or preset).
REGISTERED: tuple[str, ...] = (
    "hetfed.wire.specs.local:SPEC",
    "hetfed.wire.specs.fedavg:SPEC",
    "hetfed.wire.specs.fedprox:SPEC",
    "hetfed.wire.specs.fedavg_head:SPEC",
    "hetfed.wire.specs.fedcma:SPEC",
    "hetfed.wire.specs.fedcma:PAPER_SPEC",
    "hetfed.wire.specs.fedh2l:SPEC",
    "hetfed.wire.specs.fedsr:SPEC",
    "hetfed.wire.specs.fedsr:FEDL2R",
    "hetfed.wire.specs.fedsr:FEDCMI",
    "hetfed.wire.specs.fedavg_body:SPEC",
    "hetfed.wire.specs.simfed:SPEC",
    "hetfed.wire.specs.ditto:SPEC",
    "hetfed.wire.specs.ditto:COS_SPEC",
    "hetfed.wire.specs.ditto:MKMMD_SPEC",
    "hetfed.wire.specs.ditto:MMDD_SPEC",
)
# Further specs from outside hetfed, same form, comma-separated.
ENVIRONMENT = "HETFED_ALGORITHMS"

SPECS: dict[str, AlgorithmSpec] = {}
H = TypeVar("H")


def register(reference: str) -> AlgorithmSpec:
    """Import the spec ``"module:NAME"`` names and add it to ``SPECS`` (each name once); returns it."""
    module, _, attr = reference.strip().partition(":")
    spec = getattr(importlib.import_module(module), attr or "SPEC")
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"{reference} is not an AlgorithmSpec")
    if SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"algorithm {spec.name!r} is registered twice (again by {reference})")
    SPECS[spec.name] = spec
    return spec


for _reference in (*REGISTERED, *filter(None, os.environ.get(ENVIRONMENT, "").split(","))):
    register(_reference)


def load_half(spec: AlgorithmSpec, reference: str, base: type[H], side: str) -> type[H]:
    """The class ``reference`` (``"module:Class"``, one of ``spec``'s halves) names, imported on first use and
    checked to be a ``base``; ValueError names the algorithm and the ``side`` ("server", "client")."""
    module, _, name = reference.partition(":")
    try:
        half = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"algorithm {spec.name!r}: its {side} half {reference!r} cannot be loaded: {exc}") from None
    if not (isinstance(half, type) and issubclass(half, base)):
        raise ValueError(f"algorithm {spec.name!r}: {reference!r} is not a {base.__name__}")
    return half


def get_spec(name: str) -> AlgorithmSpec:
    """The spec registered under ``name``; a clear error lists the known algorithms."""
    try:
        return SPECS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(SPECS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown algorithm {name!r}{hint}; available: {', '.join(sorted(SPECS))}") from None
