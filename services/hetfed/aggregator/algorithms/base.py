"""The server-half interface every algorithm implements; the round engine owns the loop."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hetfed.wire.payloads import Payload, PayloadKind


class ServerHalf(Protocol):
    """Numpy state and hooks the round engine calls; one instance per run."""

    # True when every organization receives the same payloads in a round (instructions are cached).
    broadcast: bool

    def payloads_for(self, phase: str, round_: int, organization: str) -> list[Payload]:
        """What ``organization`` receives with its instructions for ``round_`` of ``phase``."""
        ...

    def validate(self, phase: str, organization: str, payloads: dict[PayloadKind, Payload]) -> None:
        """Algorithm-specific checks of a contract-checked update; raise WireError to reject it."""
        ...

    def accumulate(self, phase: str, organization: str, payloads: dict[PayloadKind, Payload]) -> None:
        """Fold one accepted update into the round's running aggregate (streaming)."""
        ...

    def close_round(self, phase: str, round_: int) -> None:
        """Finish the round: turn the running aggregate into the new server state."""
        ...

    def state(self) -> dict[str, np.ndarray]:
        """Arrays that, with the stored updates of the open round, restore this half after a restart."""
        ...

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()`` output."""
        ...


class WeightedMean:
    """A running weighted sum of named arrays in float64: memory does not grow with the clients."""

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}
        self.weight = 0.0
        self.count = 0

    def add(self, arrays: dict[str, np.ndarray], weight: float) -> None:
        """Add ``weight`` × arrays to the sum."""
        if weight <= 0:
            raise ValueError("weights must be positive")
        for name, a in arrays.items():
            contrib = np.asarray(a, dtype=np.float64) * weight
            if name in self._sums:
                self._sums[name] += contrib
            else:
                self._sums[name] = contrib
        self.weight += weight
        self.count += 1

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean of everything added (float64)."""
        if self.weight <= 0:
            raise ValueError("no contributions")
        return {k: v / self.weight for k, v in self._sums.items()}

    def reset(self) -> None:
        """Forget every contribution."""
        self._sums = {}
        self.weight = 0.0
        self.count = 0
