"""Algorithm specs: the declared wire contract of every algorithm, shared by aggregator and clients.

One module per algorithm holds its config dataclass and its ``SPEC``; the registry below lists them (adding
an algorithm adds one line here). The aggregator's server half (numpy) and the client's client half (torch)
are registered under the same name in their own packages; this package imports neither.
"""

from __future__ import annotations

from hetfed.wire.specs import (
    ditto,
    fedavg,
    fedavg_body,
    fedavg_head,
    fedcma,
    fedh2l,
    fedprox,
    fedsr,
    local,
    simfed,
)
from hetfed.wire.specs.base import (
    ANY_DATASET,
    AlgorithmSpec,
    Figure,
    LocalDefaults,
    TrainConfig,
    WireDtype,
)

__all__ = ["ANY_DATASET", "DEFAULT_COMPARISON", "SPECS", "AlgorithmSpec", "Figure", "LocalDefaults", "TrainConfig", "WireDtype",
           "get_spec"]

SPECS: dict[str, AlgorithmSpec] = {
    s.name: s
    for s in (
        local.SPEC,
        fedavg.SPEC,
        fedprox.SPEC,
        fedavg_head.SPEC,
        fedcma.SPEC,
        fedh2l.SPEC,
        fedsr.SPEC,
        fedsr.FEDL2R,
        fedsr.FEDCMI,
        fedavg_body.SPEC,
        simfed.SPEC,
        ditto.SPEC,
        ditto.COS_SPEC,
        ditto.MKMMD_SPEC,
        ditto.MMDD_SPEC,
    )
}


# What ``hetfed run`` compares when the user names no algorithm: the federated baseline against local training.
DEFAULT_COMPARISON: tuple[str, ...] = (fedavg.SPEC.name, local.SPEC.name)


def get_spec(name: str) -> AlgorithmSpec:
    """The spec registered under ``name``; a clear error lists the known algorithms."""
    try:
        return SPECS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(SPECS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown algorithm {name!r}{hint}; available: {', '.join(sorted(SPECS))}") from None
