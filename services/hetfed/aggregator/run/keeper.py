"""The ``Keeper`` of a run's server half: what is folded in, a round's close, and a rebuild from the journal.

A round's close changes the half before the close is durable. Should its history line fail to be written, the
half is ahead of the disk (``stale``) until the run rebuilds it from the checkpoint's arrays and the open round's
logged updates, which is what a restart would read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.wire.payloads import Received
from hetfed.wire.phases import Phase

Half = ServerHalf  # type: ignore[type-arg]


class Keeper:
    """Holds the run's server half (``half``), made by ``make``."""

    def __init__(self, make: Callable[[], Half]) -> None:
        self._make = make
        self.half: Half = make()
        self._stale = False

    @property
    def stale(self) -> bool:
        """Whether the half is ahead of the durable state (a close that failed to persist)."""
        return self._stale

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore the half's state from a checkpoint's arrays."""
        self.half.load_state(arrays)

    def state(self) -> dict[str, np.ndarray]:
        """The half's arrays, for a checkpoint."""
        return self.half.state()

    def accumulate(self, phase: Phase, organization: str, received: Received) -> None:
        """Fold a checked, weighted update in."""
        self.half.accumulate(phase, organization, received)

    def close_round(self, phase: Phase, round_: int) -> dict[str, np.ndarray]:
        """Aggregate the round; the half is ``stale`` until ``durable`` says the close is on disk. Returns the
        arrays the close's checkpoint holds."""
        self._stale = True
        self.half.close_round(phase, round_)
        return self.half.state()

    def durable(self) -> None:
        """The close's history line is on disk: the half is the durable state again."""
        self._stale = False

    def rebuild(self, arrays: dict[str, np.ndarray], phase: Phase,
                updates: Iterable[tuple[str, Received]]) -> None:
        """A new half from a checkpoint's arrays and the open round's accepted, weighted updates."""
        half = self._make()
        half.load_state(arrays)
        for organization, received in updates:
            half.accumulate(phase, organization, received)
        self.half, self._stale = half, False
