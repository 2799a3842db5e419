"""The throwaway algorithm's server half (numpy only): the plain mean of the heads, times ``shrink``."""

from __future__ import annotations

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.payloads import HeadWeights, Payload, Received
from hetfed.wire.phases import Phase
from tests.throwaway.spec import ShrinkConfig


class ShrinkServer(ServerHalf[ShrinkConfig]):
    """Sums the heads of a round; the global head is their mean times ``shrink``."""

    def __init__(self, config: ShrinkConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        self.head: dict[str, np.ndarray] = {}
        self._sums: dict[str, np.ndarray] = {}
        self._count = 0

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The global head, once there is one."""
        return [HeadWeights(self.head["weight"], self.head["bias"])] if self.head else []

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Add the organization's head to the round's sums."""
        hw = update.maybe(HeadWeights)
        if hw is not None:
            for name, a in (("weight", hw.weight), ("bias", hw.bias)):
                self._sums[name] = self._sums.get(name, 0.0) + np.asarray(a, dtype=np.float64)
            self._count += 1

    def close_round(self, phase: Phase, round_: int) -> None:
        """head ← shrink · Σ heads / count."""
        if self._count:
            self.head = {k: (self.config.shrink * v / self._count).astype(np.float32) for k, v in self._sums.items()}
        self._sums, self._count = {}, 0

    def state(self) -> dict[str, np.ndarray]:
        """The global head."""
        return dict(self.head)

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore the global head."""
        self.head = dict(arrays)
