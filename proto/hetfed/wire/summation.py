"""The linear form of a payload the aggregator only sums: what a client feeds secure aggregation, and what the
aggregator gets back.

Under secure aggregation the aggregator learns the sum of the clients' inputs and nothing about any one of
them, so an algorithm can run under it only where its server half needs nothing but a weighted sum. Each
summable payload kind has one weighted form, (w·x, w), with the weight the payload itself carries:

==========================  ==================================  ======================================
kind                        summed fields                       weight w
==========================  ==================================  ======================================
ModelWeights                every tensor times w                ``num_examples`` (a scalar)
HeadWeights                 ``weight`` and ``bias`` times w     ``num_examples`` (a scalar)
ClassMeanEmbeddings         ``means`` row k times w[k]          ``counts`` (one per class)
==========================  ==================================  ======================================

so the aggregator gets Σ w_i·x_i and Σ w_i (``Summed``) and never a single count. Under unit weights (a
server half that averages uniformly says so: ``ServerHalf.summed_unit_weights``) w is 1, or per class 1 where
the class is present (count > 0), 0 where absent. ``fields`` flattens one
payload into named float64 arrays (the inputs of ``hetfed.secagg.ring.Encoding``), ``sums`` reads a decoded
sum back. An algorithm declares which of its upload kinds are summed (``AlgorithmSpec.summed_upload``); its
server half takes the sums through ``ServerHalf.accumulate_sum``, and a test proves, per algorithm, that the
half fed the uploads one by one equals the half fed their sums once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassMeanEmbeddings, HeadWeights, ModelWeights, Payload, PayloadKind

# Kinds with a weighted form. Any other kind (posteriors a peer must see, factorised weights matched by
# similarity, metrics) cannot be summed.
SUMMABLE = frozenset({PayloadKind.MODEL_WEIGHTS, PayloadKind.HEAD_WEIGHTS, PayloadKind.CLASS_MEAN_EMBEDDINGS})
# The name of a kind's weight among its fields; a value is "<kind>/<name>", so the two never collide.
WEIGHT = "#weight"


@dataclass(frozen=True)
class Summed:
    """The secure sum of one payload kind over the round's survivors: Σ w_i·x_i per named array and Σ w_i
    (shape () for a scalar weight, [K] for one per class), float64."""

    kind: PayloadKind
    values: dict[str, np.ndarray]
    weight: np.ndarray


def _key(kind: PayloadKind, name: str) -> str:
    return f"{kind.value}/{name}"


def _weight_key(kind: PayloadKind) -> str:
    return kind.value + WEIGHT


def fields(payload: Payload, unit: bool = False) -> dict[str, np.ndarray]:
    """One payload's weighted form as named float64 arrays: each value times its weight, and the weight (1,
    or 1 per present class, under ``unit`` weights)."""
    if isinstance(payload, ModelWeights | HeadWeights):
        w = 1.0 if unit else float(payload.num_examples)
        if not w > 0:
            raise WireError("invalid_value", f"a summed {payload.kind.value} needs num_examples > 0, got {w:g}")
        named = payload.tensors if isinstance(payload, ModelWeights) else \
            {"weight": payload.weight, "bias": payload.bias}
        out = {_key(payload.kind, n): np.asarray(a, np.float64) * w for n, a in named.items()}
        out[_weight_key(payload.kind)] = np.array(w)
        return out
    if isinstance(payload, ClassMeanEmbeddings):
        counts = np.asarray(payload.counts, np.float64)
        means = np.asarray(payload.means, np.float64)
        if counts.ndim != 1 or means.shape[:1] != counts.shape or (counts < 0).any():
            raise WireError("invalid_value", "a summed class_mean_embeddings needs counts >= 0, one per row of means")
        if unit:
            counts = (counts > 0).astype(np.float64)
        weighted = np.where(counts[:, None] > 0, means * counts[:, None], 0.0)  # an absent class adds nothing
        kind = payload.kind
        return {_key(kind, "means"): weighted, _weight_key(kind): counts}
    raise WireError("payload_kind_not_allowed", f"{payload.kind.value} has no summed form")


def shapes(payload: Payload) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``fields`` gives for ``payload`` (the schema both sides fix before a round)."""
    return {name: a.shape for name, a in fields(payload, unit=True).items()}


def sums(kinds: Iterable[PayloadKind], arrays: Mapping[str, np.ndarray]) -> dict[PayloadKind, Summed]:
    """The decoded sum of ``fields`` outputs, read back per kind."""
    out: dict[PayloadKind, Summed] = {}
    for kind in sorted(kinds, key=lambda k: k.value):
        if kind not in SUMMABLE:
            raise WireError("payload_kind_not_allowed", f"{kind.value} has no summed form")
        prefix = kind.value + "/"
        values = {name[len(prefix):]: np.asarray(a, np.float64) for name, a in arrays.items()
                  if name.startswith(prefix)}
        weight = arrays.get(_weight_key(kind))
        if weight is None:
            raise WireError("missing_payload", f"the sum carries no weight of {kind.value}")
        out[kind] = Summed(kind, values, np.asarray(weight, np.float64))
    extra = set(arrays) - {n for s in out.values() for n in [*(_key(s.kind, v) for v in s.values),
                                                               _weight_key(s.kind)]}
    if extra:
        raise WireError("payload_kind_not_allowed", f"the sum holds arrays of no declared kind: {sorted(extra)}")
    return out


def add(total: dict[str, np.ndarray], payload: Payload, unit: bool = False) -> dict[str, np.ndarray]:
    """``total`` plus one payload's weighted form, in place (float64; a reference sum for tests and checks)."""
    for name, a in fields(payload, unit).items():
        if name in total:
            total[name] = total[name] + a
        else:
            total[name] = a.copy()
    return total
