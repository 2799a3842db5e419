"""A run's ``Aggregation``: its numpy server half, kept in step with the journal.

It folds checked updates in with their aggregation weights, closes rounds, and rebuilds the half when a close
failed to persist. A round's close changes the half before the close is durable. Should its history line fail to
be written, the half is ahead of the disk (``stale``) until it is rebuilt from the checkpoint's arrays and the
open round's logged updates, which is what a restart would read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.aggregator.journal.journal import Journal
from hetfed.aggregator.journal.store import StateError
from hetfed.aggregator.run import admission, resume
from hetfed.aggregator.run.state import Close, RunState
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import Received

log = logging.getLogger("hetfed.aggregator")
Half = ServerHalf  # type: ignore[type-arg]


class Aggregation:
    """The run's server half (made by ``make``) and what is folded into it; call under the run's lock."""

    def __init__(self, make: Callable[[], Half], cfg: RunConfig, journal: Journal, max_tensor_elements: int) -> None:
        self._make, self.cfg, self.journal, self.max_tensor_elements = make, cfg, journal, max_tensor_elements
        self.half: Half = self._new()
        self._stale = False

    def _new(self) -> Half:
        """A new server half, with the close's crash point set."""
        half = self._make()
        half.range_folded = lambda: crash_point("close.folding")
        return half

    @property
    def stale(self) -> bool:
        """Whether the half is ahead of the durable state (a close that failed to persist)."""
        return self._stale

    def current(self, state: RunState) -> Half:
        """The half as the disk has it: rebuilt first when a failed close left it ahead (``storage_unavailable``
        when it cannot be)."""
        if self._stale:
            self._rebuild(state)
        return self.half

    def logged(self, state: RunState) -> list[resume.Logged]:
        """The open round's logged updates, checked again (views of the mapped log for a half that keeps its
        updates until the close, read into memory for any other)."""
        read = self.journal.views if self.half.keeps_updates else self.journal.logged
        return resume.logged_updates(read(state.round), self.cfg, state.phase, state.round, state.schema,
                                     self.max_tensor_elements)

    def revalidate(self, state: RunState, organization: str, received: Received, checked_by: Half) -> None:
        """Check an update again when the half that validated it (``checked_by``) is no longer the durable one: a
        failed close changed it while the update was decoded."""
        if checked_by is not self.half or self._stale:
            self.current(state).validate(state.phase, organization, received)

    def fold(self, state: RunState, organization: str, received: Received) -> None:
        """Fold a checked, logged update in, weighted as the run weighs updates (``admission.weighted``). A half
        that keeps its updates until the close gets the logged copy, parsed again from the mapped log, so the
        received bytes are not held past the push."""
        half = self.current(state)
        if half.keeps_updates:
            received = self._from_log(state, organization)
        half.accumulate(state.phase, organization, self._weighted(state, organization, received))

    def _from_log(self, state: RunState, organization: str) -> Received:
        """The organization's logged update of the open round, its arrays viewing the mapped log. Its values
        are not scanned again (the received copy passed every check): only the structure is parsed, so the
        pages of the tensors stay on disk until the close reads them."""
        data = dict(self.journal.views(state.round))[organization]
        _, received = resume.parse_logged(organization, data, self.cfg, state.phase, state.round, state.schema,
                                          self.max_tensor_elements, scan=False)
        return received

    def close_round(self, state: RunState, close: Close, release: Callable[[], None] = lambda: None,
                    ) -> dict[str, np.ndarray]:
        """Aggregate the round ``close`` names; the half is ``stale`` until ``durable`` says the close is on disk.
        ``release`` is called first: it drops what the closing round holds beside the half (its built broadcast),
        so the fold does not hold the old model's broadcast beside the new model. Returns the arrays the close's
        checkpoint holds."""
        release()
        half = self.current(state)
        self._stale = True
        half.close_round(close.phase, close.round)
        return half.state()

    def durable(self) -> None:
        """The close's history line is on disk: the half is the durable state again."""
        self._stale = False

    def load(self, arrays: dict[str, np.ndarray], checkpoint: Path) -> None:
        """Restore the half from a checkpoint's arrays; ``RunConflictError`` when they do not fit it."""
        resume.load_arrays(self.half.load_state, arrays, self.cfg, checkpoint)

    def _weighted(self, state: RunState, organization: str, received: Received) -> Received:
        return admission.weighted(self.cfg, state.examples.get(organization, 0), received)

    def _rebuild(self, state: RunState) -> None:
        """A new half from the checkpoint's arrays and the open round's accepted updates."""
        try:
            _, arrays = self.journal.read_checkpoint()
            half = self._new()
            half.load_state(arrays)
            for u in self.logged(state):
                if u.organization in state.pushed:
                    half.accumulate(state.phase, u.organization, self._weighted(state, u.organization, u.received))
        except (StateError, OSError) as exc:
            raise WireError("storage_unavailable", f"run {self.cfg.id!r} cannot reload its state after a failed "
                                                   f"write ({exc})") from None
        self.half, self._stale = half, False
        log.info("run %s: server state rebuilt from the checkpoint and %d logged updates", self.cfg.id,
                 len(state.pushed))
