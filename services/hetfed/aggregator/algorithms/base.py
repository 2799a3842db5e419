"""The server-half interface every algorithm implements (numpy only); the round engine owns the loop.

A server half is generic in its algorithm's config type: the registry pairs it with the spec whose
``config_type`` it names, and a test checks that pairing for every algorithm, so no half inspects its
config's type at run time. Hooks receive typed payloads (``Received``) and the run's ``Phase``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import numpy as np

from hetfed.wire.payloads import Payload, PayloadKind, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import TrainConfig
from hetfed.wire.summation import Summed

C = TypeVar("C", bound=TrainConfig)


def round_seed(run_seed: int, round_: int) -> int:
    """The seed of a round's shared random draws, derived from the run seed (sent in every round's
    instructions; a server half that draws what the clients draw derives it here)."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{round_}".encode()).digest()[:8], "little")


@dataclass(frozen=True)
class SeedSetInfo:
    """The run's shared seed set: its id, size and each organization's part [start, stop) (empty: unchecked)."""

    id: str
    size: int = 0
    parts: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunInfo:
    """What a server half knows of its run besides its config: the seed, the participants, the seed set."""

    seed: int
    organizations: tuple[str, ...]
    seed_set: SeedSetInfo | None = None


def _nothing() -> None:
    """The default ``range_folded``: no crash point."""


class ServerHalf(Generic[C]):
    """Numpy state and the hooks the round engine calls; one instance per run. Hooks default to no-ops."""

    # True when every organization receives the same payloads in a round (the engine builds them once).
    broadcast: ClassVar[bool] = True
    # True when ``accumulate`` keeps the update's arrays until ``close_round`` (folded there, by ranges): the
    # engine then hands it the logged copy, arrays that view the write-ahead log's file, never the received
    # bytes, so the round's updates cost file pages the kernel can drop, not memory.
    keeps_updates: ClassVar[bool] = False
    # True when the arrays ``payloads_for`` returns are written only by ``close_round``, in place only where they
    # are writable: the engine then sends them without a copy (their bytes are the broadcast's), and makes them
    # read-only before a close while a pull may still send them (the close then writes new arrays).
    shares_payloads: ClassVar[bool] = False

    def __init__(self, config: C, run: RunInfo) -> None:
        self.config = config
        self.run = run
        # Called after each range of elements a close folds (a half that folds by ranges calls it): the engine
        # sets its crash point here, so a kill can land in the middle of a close.
        self.range_folded: Callable[[], None] = _nothing

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """What ``organization`` receives with its instructions for ``round_`` of ``phase``."""
        return []

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """Algorithm-specific checks of a contract-checked update; raise WireError to reject it."""

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Fold one accepted update into the round's running aggregate (streaming)."""

    def secure_aggregation_refusal(self) -> str:
        """Why this run cannot sum its uploads under secure aggregation (one line), or "" when it can: a half
        that sums overrides it, and refuses a config under which it would do more than sum."""
        return "its server half needs each organization's own payloads"

    @property
    def summed_unit_weights(self) -> bool:
        """True when the half sums its uploads unweighted (``hetfed.wire.summation``: every weight 1)."""
        return False

    def summed_shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes of the summed form (``hetfed.wire.summation.shapes``) when the half fixes them from
        its config (no organization declares them at Join); empty: the run's declared tensor schema gives them."""
        return {}

    def accumulate_sum(self, phase: Phase, sums: Mapping[PayloadKind, Summed], organizations: tuple[str, ...]) -> None:
        """Fold the secure sum of the round's uploads of the summed kinds (``organizations``: whose uploads it
        holds), instead of ``accumulate`` on each: the same round as those uploads one by one would give.
        Payloads that are not summed (EvalMetrics) still arrive one by one through ``accumulate``. A half may
        refuse an implausible sum (``WireError``) before it changes anything: the round's aggregate is abandoned."""
        raise NotImplementedError(f"{type(self).__name__} does not take secure sums")

    def close_round(self, phase: Phase, round_: int) -> None:
        """Finish the round: turn the running aggregate into the new server state."""

    def state(self) -> dict[str, np.ndarray]:
        """Named arrays that, with the stored updates of the open round, restore this half after a restart."""
        return {}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()`` output."""
