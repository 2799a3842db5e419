"""FedAvg's server half (McMahan et al. 2017) and the weighted average it shares with head-only FedAvg."""

from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf, TrimmedMean, WeightedMean
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ModelWeights, Payload, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs.fedavg import AveragingConfig, FedAvgConfig

A = TypeVar("A", bound=AveragingConfig)


class AveragingServer(ServerHalf[A], Generic[A]):
    """Averages the named arrays of one payload type and sends the result back: the mean weighted by example
    counts, or (``aggregation = "trimmed_mean"``) the coordinate-wise trimmed mean."""

    def __init__(self, config: A, run: RunInfo) -> None:
        super().__init__(config, run)
        self.global_: dict[str, np.ndarray] | None = None
        self._acc: WeightedMean | TrimmedMean = (
            TrimmedMean(config.trim) if config.aggregation == "trimmed_mean" else WeightedMean())

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
        """The aggregation weight must be a positive example count."""
        got = self.arrays(update)
        if got is not None and got[1] <= 0:
            raise WireError("invalid_value", f"num_examples must be > 0, got {got[1]}")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Add n_i · w_i to the running sum (or w_i to the trimmed mean's running state)."""
        got = self.arrays(update)
        if got is not None:
            self._acc.add(got[0], float(got[1]))

    def close_round(self, phase: Phase, round_: int) -> None:
        """w ← Σ n_i w_i / Σ n_i over the organizations that pushed (or their trimmed mean)."""
        if self._acc.count:
            self.global_ = {k: v.astype(np.float32) for k, v in self._acc.mean().items()}
        self._acc.reset()

    def state(self) -> dict[str, np.ndarray]:
        """The global arrays."""
        return dict(self.global_ or {})

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore the global arrays."""
        self.global_ = dict(arrays) or None


class FedAvgServer(AveragingServer[FedAvgConfig]):
    """FedAvg: average whole models (FedProx shares it: its difference is in the client objective)."""

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """The example count must be positive, whichever weighting the run uses."""
        mw = update.maybe(ModelWeights)
        if mw is not None and mw.num_examples <= 0:
            raise WireError("invalid_value", f"num_examples must be > 0, got {mw.num_examples}")

    def arrays(self, update: Received) -> tuple[dict[str, np.ndarray], int] | None:
        """The model's tensors and their weight: the example count, or 1 under uniform weighting."""
        mw = update.maybe(ModelWeights)
        if mw is None:
            return None
        return mw.tensors, 1 if self.config.weighting == "uniform" else mw.num_examples

    def payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        """The global model."""
        return ModelWeights(arrays)
