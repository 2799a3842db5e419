"""The ``OpenRound``: the record of the round a run has open (traffic, reports, timing) and its deadline's clock.

The event loop counts traffic into the record while a worker may hold the run's lock for disk writes, so the record
has a lock of its own, never held across I/O.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hetfed.aggregator.journal.history import RoundRecord
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.phases import Phase
from hetfed.wire.traffic import Direction, TrafficBreakdown


class OpenRound:
    """The open round's ``record``; its deadline counts from the first organization's arrival (``arm``)."""

    def __init__(self, round_: int, phase: Phase, armed: bool = False) -> None:
        self._lock = threading.Lock()
        self.record = RoundRecord(round_, phase, time.monotonic())
        self.armed = armed

    def arm(self) -> None:
        """Start the deadline's clock, unless it runs already."""
        if not self.armed:
            self.armed = True
            self.record.started = time.monotonic()

    def overdue(self, deadline_seconds: float) -> bool:
        """Whether the round's deadline has passed."""
        return self.armed and time.monotonic() - self.record.started >= deadline_seconds

    def count(self, round_: int, direction: Direction, b: TrafficBreakdown) -> None:
        """Add traffic to the record when it belongs to the open round (any thread)."""
        with self._lock:
            rec = self.record
            if round_ == rec.round:
                (rec.up if direction is Direction.UP else rec.down).add(b)

    def report(self, organization: str, m: EvalMetrics) -> None:
        """The metrics an organization's folded update reported."""
        self.record.reports[organization] = m

    def end(self, clients: int) -> RoundRecord:
        """The record of the round closing now with ``clients`` updates (its traffic may still be counted)."""
        self.record.duration = time.monotonic() - self.record.started
        self.record.clients = clients
        return self.record

    def line(self) -> dict[str, Any]:
        """The record's history line, as its traffic stands now."""
        with self._lock:  # the event loop may be counting traffic into this record
            return self.record.to_json()

    def open(self, round_: int, phase: Phase) -> None:
        """A new record for the next round (its clock runs: the run has members)."""
        with self._lock:
            self.record = RoundRecord(round_, phase, time.monotonic())
