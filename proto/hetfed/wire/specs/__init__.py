"""Algorithm specs: the declared wire contract of every algorithm, shared by aggregator and clients.

One module per algorithm holds its config dataclass and its ``SPEC``; ``REGISTERED`` below lists every spec
by import, so adding an algorithm adds its files and one import here. Each half binds itself to its spec by
import (``@fedcma.SPEC.server_half``), and each side's package imports only its own halves, on first use. An
algorithm kept outside hetfed registers through the ``HETFED_ALGORITHMS`` environment variable
(comma-separated ``"module:NAME"`` references, read by every process) and names its halves in its spec as
``"module:Class"``, since no package of hetfed imports them. Presets (``ditto_cos``, ``fedl2r``, ...) are
another algorithm's config under their own names. This package imports no half.
"""

from __future__ import annotations

import importlib
import os
from typing import TypeVar

from hetfed.wire.specs import (
    ditto,
    fedavg,
    fedavg_body,
    fedavg_head,
    fedcma,
    fedfomo,
    fedgen,
    fedh2l,
    fedmd,
    fedproto,
    fedprox,
    fedrep,
    fedsr,
    fml,
    local,
    simfed,
)
from hetfed.wire.specs.base import SIDES, AlgorithmSpec, Figure, TrainConfig, WireDtype

__all__ = ["REGISTERED", "SPECS", "AlgorithmSpec", "Figure", "TrainConfig", "WireDtype", "get_spec", "load_half",
           "register"]

# Every algorithm and preset, in the order `hetfed run --help` lists them.
REGISTERED: tuple[AlgorithmSpec, ...] = (
    local.SPEC,
    fedavg.SPEC,
    fedprox.SPEC,
    fedavg_head.SPEC,
    fedcma.SPEC,
    fedcma.PAPER_SPEC,
    fedh2l.SPEC,
    fedsr.SPEC,
    fedsr.FEDL2R,
    fedsr.FEDCMI,
    fedavg_body.SPEC,
    fedavg_body.FEDPER,
    fedrep.SPEC,
    simfed.SPEC,
    ditto.SPEC,
    ditto.COS_SPEC,
    ditto.MKMMD_SPEC,
    ditto.MMDD_SPEC,
    fedproto.SPEC,
    fedmd.SPEC,
    fedfomo.SPEC,
    fml.SPEC,
    fedgen.SPEC,
    fedgen.HEAD_SPEC,
)
# Further specs from outside hetfed, as "module:NAME", comma-separated.
ENVIRONMENT = "HETFED_ALGORITHMS"

SPECS: dict[str, AlgorithmSpec] = {}
H = TypeVar("H")


def register(spec: AlgorithmSpec | str) -> AlgorithmSpec:
    """Add a spec to ``SPECS`` (each name once), given as itself or as ``"module:NAME"`` (imported); returns it."""
    if isinstance(spec, str):
        module, _, attr = spec.strip().partition(":")
        reference, spec = spec, getattr(importlib.import_module(module), attr or "SPEC")
    else:
        reference = repr(spec.name)
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"{reference} is not an AlgorithmSpec")
    if SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"algorithm {spec.name!r} is registered twice (again by {reference})")
    SPECS[spec.name] = spec
    return spec


for _spec in REGISTERED:
    register(_spec)
for _reference in filter(None, os.environ.get(ENVIRONMENT, "").split(",")):
    register(_reference)


def load_half(spec: AlgorithmSpec, base: type[H], side: str) -> type[H]:
    """``spec``'s ``side`` half ("server" or "client"): the class bound to it by import, else the one its
    ``"module:Class"`` names (an algorithm kept outside hetfed), imported now; checked to be a ``base``.
    ValueError names the algorithm and the side. The caller imports its side's own halves first."""
    assert side in SIDES, side
    half = spec.half(side)
    reference = getattr(spec, side)
    if half is None and not reference:
        raise ValueError(f"algorithm {spec.name!r}: its {side} half cannot be loaded: no class is bound to it "
                         f"(@SPEC.{side}_half) and the spec names none ({side}='module:Class')")
    if half is None:
        module, _, name = reference.partition(":")
        try:
            half = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"algorithm {spec.name!r}: its {side} half {reference!r} cannot be loaded: {exc}") \
                from None
    if not (isinstance(half, type) and issubclass(half, base)):
        raise ValueError(f"algorithm {spec.name!r}: {reference or half!r} is not a {base.__name__}")
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
