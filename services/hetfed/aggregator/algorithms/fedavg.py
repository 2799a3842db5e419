"""FedAvg's server half (McMahan et al. 2017) and the weighted average it shares with head-only FedAvg."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

import numpy as np

from hetfed.aggregator.algorithms.aggregators import (
    DROP_EVERY,
    Aggregator,
    CoordinateMedian,
    Term,
    TrimmedMean,
    WeightedMean,
    distance,
    drop_pages,
    fold_ranges,
    global_norm,
    moved,
)
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import ditto, fedavg, fedavg_body, fedprox, fedrep, fedsr
from hetfed.wire.specs.fedavg import AveragingConfig, FedAvgConfig
from hetfed.wire.summation import Summed

A = TypeVar("A", bound=AveragingConfig)
# Relative slack of the distance's shortcut past ``max_abs_weight``: far above the distance's rounding (about 10⁻⁸,
# float32 differences summed in float64), so a value the shortcut passes is within the bound exactly.
_SLACK = 1e-6
# The largest running exact sum a round keeps (25 bytes an element: about 2.7 M float32 values, a 10 MB model):
# below it the close only divides, off the round's critical path; above it the updates are folded at the close.
RUNNING_SUM_BYTES = 64 << 20


def _max_abs(a: np.ndarray) -> float:
    """The largest magnitude in ``a``, a block at a time: a block of a mapped update gives its pages back."""
    flat, largest = a.reshape(-1), 0.0
    for lo in range(0, flat.size, DROP_EVERY):
        block = flat[lo:lo + DROP_EVERY]
        largest = max(largest, abs(float(block.max())), abs(float(block.min())))
        drop_pages(block)
    return largest


class AveragingServer(ServerHalf[A], Generic[A]):
    """Averages the named arrays of one payload type and sends the result back: the mean weighted by example
    counts, or (``aggregation``) the coordinate-wise trimmed mean or median.

    Every update is checked against the run's plausibility bounds first: no value beyond ``max_abs_weight``,
    and a distance from the current global model of at most ``max_update_norm_ratio`` times its norm (refused,
    or clipped onto that bound under ``update_norm_policy = "clip"``).

    The round's updates are kept as they came (in the engine, arrays that view the write-ahead log's file) and
    folded at the close, a range of elements at a time (``fold_ranges``): the only model-sized array it makes is
    the new global model."""

    keeps_updates: ClassVar[bool] = True
    shares_payloads: ClassVar[bool] = True  # the global model: written only by the close's fold

    def __init__(self, config: A, run: RunInfo) -> None:
        super().__init__(config, run)
        self.global_: dict[str, np.ndarray] | None = None
        self._global_norm: float | None = None
        self._global_max_abs: float | None = None
        self._terms: list[Term] = []  # the round's updates, folded at the close
        self._running = WeightedMean()  # or their running sum, for a small model under the weighted mean
        self._summed: tuple[dict[str, np.ndarray], float] | None = None  # or their secure sum (Σ w·x, Σ w)

    def _aggregator(self) -> Aggregator:
        """A fresh aggregator of the configured kind (one per range at the close)."""
        config = self.config
        return (TrimmedMean(config.trim) if config.aggregation == "trimmed_mean"
                else CoordinateMedian() if config.aggregation == "median" else WeightedMean())

    # The payload kind whose arrays are averaged.
    summed_kind: ClassVar[PayloadKind] = PayloadKind.MODEL_WEIGHTS

    def arrays(self, update: Received) -> tuple[dict[str, np.ndarray], int] | None:
        """The arrays an update contributes and their weight (None: nothing to average)."""
        raise NotImplementedError

    def payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        """The payload that carries the global arrays down."""
        raise NotImplementedError

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The current global arrays (none before the first aggregation: clients start from the run seed)."""
        if self.global_ is None or phase is Phase.SETUP:
            return []
        return [self.payload(self.global_)]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """The aggregation weight must be a positive example count, and the arrays plausible."""
        got = self.arrays(update)
        if got is not None and got[1] <= 0:
            raise WireError("invalid_value", f"num_examples must be > 0, got {got[1]}")
        if got is not None:
            self.check_plausible(got[0])

    def _radius(self) -> float:
        """How far an update may be from the global model (0: no bound now)."""
        ratio = self.config.max_update_norm_ratio
        if not ratio or self.global_ is None:
            return 0.0
        if self._global_norm is None:
            self._global_norm = global_norm(self.global_)
        return ratio * self._global_norm

    def check_plausible(self, arrays: dict[str, np.ndarray]) -> None:
        """WireError ``implausible_update`` for a value beyond ``max_abs_weight``, or (policy "refuse") an update
        farther from the global model than ``max_update_norm_ratio`` times its norm.

        Under both bounds the distance is taken first (one pass), and the values are scanned for ``max_abs_weight``
        only when the distance leaves it in doubt: every value is within max|global| + distance of 0, since
        |aᵢ| ≤ |gᵢ| + |aᵢ − gᵢ| ≤ max|g| + ||a − g||₂ (a tensor missing from the global model counts from 0)."""
        bound = self.config.max_abs_weight
        radius = self._radius()
        refuse = bool(radius) and self.config.update_norm_policy == "refuse"
        dist = distance(arrays, self.global_) if refuse and self.global_ is not None else None
        if bound and not (dist is not None and (self._max_abs_global() + dist) * (1 + _SLACK) < bound):
            for name, a in arrays.items():
                if a.dtype.kind == "f" and a.size:
                    largest = _max_abs(a)
                    if largest > bound:
                        raise WireError("implausible_update", f"{name} holds a value of magnitude {largest:.3g}; "
                                                              f"at most {bound:g} (max_abs_weight)")
        if dist is not None and dist > radius:
            raise WireError("implausible_update", f"the update is {dist:.4g} from the global model, whose "
                                                  f"norm is {self._global_norm:.4g}; at most "
                                                  f"{self.config.max_update_norm_ratio:g} times that "
                                                  "(max_update_norm_ratio)")

    def _max_abs_global(self) -> float:
        """The largest magnitude in the global model (0 before the first aggregation), once per global model."""
        if self._global_max_abs is None:
            self._global_max_abs = max((max(abs(float(a.max())), abs(float(a.min())))
                                        for a in (self.global_ or {}).values() if a.size), default=0.0)
        return self._global_max_abs

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Keep the update's arrays and weight for the close; under ``update_norm_policy = "clip"`` its distance
        from the global model is taken now, and the factor that moves it onto the bound kept with it."""
        got = self.arrays(update)
        if got is not None:
            arrays, weight = got
            if weight <= 0:
                raise ValueError("weights must be positive")
            radius = self._radius()
            clip = None
            if radius and self.config.update_norm_policy == "clip":
                assert self.global_ is not None
                dist = distance(arrays, self.global_)
                clip = radius / dist if dist > radius else None
                for a in arrays.values():
                    drop_pages(np.asarray(a))
            term = Term(arrays, float(weight), clip)
            if self._runs(arrays):
                self._running.add(moved(term, self.global_), term.weight)
                for a in arrays.values():
                    drop_pages(np.asarray(a))
            else:
                self._terms.append(term)

    def secure_aggregation_refusal(self) -> str:
        """The weighted mean is a sum; the trimmed mean, the median and norm clipping need each update."""
        if self.config.aggregation != "mean":
            return f"aggregation = {self.config.aggregation!r} needs each update (secure aggregation sums them)"
        if self.config.update_norm_policy == "clip" and self.config.max_update_norm_ratio:
            return "update_norm_policy = 'clip' needs each update's distance from the global model"
        return ""

    def accumulate_sum(self, phase: Phase, sums: Mapping[PayloadKind, Summed], organizations: tuple[str, ...]) -> None:
        """Take Σ w_i·x_i and Σ w_i of the round's arrays: the close divides, as it would the running sum."""
        summed = sums.get(self.summed_kind)
        if summed is None:
            return
        weight = float(summed.weight)
        if not (math.isfinite(weight) and weight > 0):
            raise WireError("implausible_update", f"the summed weight is {weight:g}; it must be finite and > 0")
        if self._terms or self._running.count or self._summed is not None:
            raise ValueError("a round takes one secure sum and no single update")
        self._summed = (dict(summed.values), weight)

    def _runs(self, arrays: dict[str, np.ndarray]) -> bool:
        """Whether the round's updates go into a running sum as they arrive (then the close only divides): under
        the weighted mean, for a model whose exact sum takes at most ``RUNNING_SUM_BYTES``, as the round's first
        update decides. Elsewhere they are kept and folded at the close, a range at a time."""
        if self._terms or self._running.count:
            return bool(self._running.count)
        elements = sum(np.size(a) for a in arrays.values())
        return self.config.aggregation not in ("trimmed_mean", "median") and elements * 25 <= RUNNING_SUM_BYTES

    def close_round(self, phase: Phase, round_: int) -> None:
        """w ← Σ n_i w_i / Σ n_i over the organizations that pushed (or their trimmed mean or median), a range of
        elements at a time."""
        if self._summed is not None:
            values, weight = self._summed
            known = self.global_ or {}
            order = list(known) + [name for name in values if name not in known]  # the model's own order
            self.global_ = {name: (values[name] / weight).astype(np.float32) for name in order if name in values}
            self._global_norm = self._global_max_abs = None
        elif self._running.count:
            self.global_ = self._running.mean(np.float32)
            self._global_norm = self._global_max_abs = None
        elif self._terms:
            # In place: the old global model's arrays take the new one, so a close does not hold two models.
            # The broadcast views them: the engine made them read-only if a pull may still send them (then the
            # fold writes new arrays); the checkpoint of the last close is written before this one begins.
            self.global_ = fold_ranges(self._aggregator, self._terms, self.global_, np.float32,
                                       after_range=self.range_folded, into=self.global_)
            self._global_norm = self._global_max_abs = None
        self._terms = []
        self._running.reset()
        self._summed = None

    def state(self) -> dict[str, np.ndarray]:
        """The global arrays."""
        return dict(self.global_ or {})

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore the global arrays."""
        self.global_ = dict(arrays) or None
        self._global_norm = self._global_max_abs = None


@fedavg.SPEC.server_half
@fedprox.SPEC.server_half
@fedsr.SPEC.server_half
@fedavg_body.SPEC.server_half
@fedrep.SPEC.server_half
@ditto.SPEC.server_half
class FedAvgServer(AveragingServer[FedAvgConfig]):
    """FedAvg: average whole models (FedProx shares it: its difference is in the client objective; FedAvg of the
    body and FedRep too: their clients send the body alone)."""

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """The example count must be positive, whichever weighting the run uses."""
        mw = update.maybe(ModelWeights)
        if mw is not None and mw.num_examples <= 0:
            raise WireError("invalid_value", f"num_examples must be > 0, got {mw.num_examples}")
        if mw is not None:
            self.check_plausible(mw.tensors)

    # The payload kind whose arrays are averaged.
    summed_kind: ClassVar[PayloadKind] = PayloadKind.MODEL_WEIGHTS

    @property
    def summed_unit_weights(self) -> bool:
        """Uniform weighting sums the models unweighted."""
        return self.config.weighting == "uniform"

    def arrays(self, update: Received) -> tuple[dict[str, np.ndarray], int] | None:
        """The model's tensors and their weight: the example count, or 1 under uniform weighting."""
        mw = update.maybe(ModelWeights)
        if mw is None:
            return None
        return mw.tensors, 1 if self.config.weighting == "uniform" else mw.num_examples

    def payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        """The global model."""
        return ModelWeights(arrays)
