"""Server halves of Local, FedAvg / FedProx (whole model) and head-only FedAvg."""

from __future__ import annotations

import numpy as np

from hetfed.aggregator.algorithms.base import WeightedMean
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import HeadWeights, ModelWeights, Payload, PayloadKind
from hetfed.wire.specs import TrainConfig


class LocalServer:
    """Local training: nothing to aggregate, nothing to send."""

    broadcast = True

    def __init__(self, config: TrainConfig, seed: int) -> None:
        self.config = config

    def payloads_for(self, phase: str, round_: int, organization: str) -> list[Payload]:
        """Local clients receive nothing."""
        return []

    def validate(self, phase: str, organization: str, payloads: dict[PayloadKind, Payload]) -> None:
        """Metrics need no further checks."""

    def accumulate(self, phase: str, organization: str, payloads: dict[PayloadKind, Payload]) -> None:
        """Nothing to fold in."""

    def close_round(self, phase: str, round_: int) -> None:
        """Nothing to finish."""

    def state(self) -> dict[str, np.ndarray]:
        """No state."""
        return {}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """No state."""


class _FedAvgServer:
    """FedAvg over the named arrays of one payload kind, weighted by example counts (McMahan et al.)."""

    broadcast = True
    kind: PayloadKind

    def __init__(self, config: TrainConfig, seed: int) -> None:
        self.config = config
        self.global_: dict[str, np.ndarray] | None = None
        self._acc = WeightedMean()

    def _arrays(self, payload: Payload) -> tuple[dict[str, np.ndarray], int]:
        raise NotImplementedError

    def _payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        raise NotImplementedError

    def payloads_for(self, phase: str, round_: int, organization: str) -> list[Payload]:
        """The current global arrays (none before the first aggregation: clients start from the run seed)."""
        if self.global_ is None or phase == "setup":
            return []
        return [self._payload(self.global_)]

    def validate(self, phase: str, organization: str, payloads: dict[PayloadKind, Payload]) -> None:
        """The aggregation weight must be a positive example count."""
        if self.kind in payloads:
            _, n = self._arrays(payloads[self.kind])
            if n <= 0:
                raise WireError("invalid_value", f"{self.kind.value}.num_examples must be > 0, got {n}")

    def accumulate(self, phase: str, organization: str, payloads: dict[PayloadKind, Payload]) -> None:
        """Add n_i · w_i to the running sum."""
        if self.kind in payloads:
            arrays, n = self._arrays(payloads[self.kind])
            self._acc.add(arrays, float(n))

    def close_round(self, phase: str, round_: int) -> None:
        """w ← Σ n_i w_i / Σ n_i over the clients that pushed."""
        if self._acc.count:
            self.global_ = {k: v.astype(np.float32) for k, v in self._acc.mean().items()}
        self._acc.reset()

    def state(self) -> dict[str, np.ndarray]:
        """The global arrays."""
        return dict(self.global_ or {})

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore the global arrays."""
        self.global_ = dict(arrays) or None


class ModelFedAvgServer(_FedAvgServer):
    """FedAvg and FedProx: average whole models (FedProx differs only in the client objective)."""

    kind = PayloadKind.MODEL_WEIGHTS

    def _arrays(self, payload: Payload) -> tuple[dict[str, np.ndarray], int]:
        assert isinstance(payload, ModelWeights)
        return payload.tensors, payload.num_examples

    def _payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        return ModelWeights(arrays)


class HeadFedAvgServer(_FedAvgServer):
    """Head-only FedAvg: average the classifier head; encoders never leave the clients."""

    kind = PayloadKind.HEAD_WEIGHTS

    def _arrays(self, payload: Payload) -> tuple[dict[str, np.ndarray], int]:
        assert isinstance(payload, HeadWeights)
        return {"weight": payload.weight, "bias": payload.bias}, payload.num_examples

    def _payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        return HeadWeights(arrays["weight"], arrays["bias"])
