"""Per-organization accounting of a run: its last accepted round and the bytes it sent and received.

The round engine feeds it (``count`` where traffic is recorded, ``pushed`` where an update is folded in)
and checkpoints it with the run's metadata; ``Status`` reports it per organization (``hetfed status``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hetfed.wire.messages import OrganizationStatus
from hetfed.wire.traffic import Direction, TrafficBreakdown


@dataclass
class OrganizationCounts:
    """One organization's figures in one run."""

    last_round_pushed: int = -1
    bytes_up: int = 0
    bytes_down: int = 0


class OrganizationLedger:
    """Counts per organization, thread-safe: traffic is counted outside the run's lock (by the servicer's
    handlers) while pushes are recorded and checkpoints taken under it."""

    def __init__(self) -> None:
        self._counts: dict[str, OrganizationCounts] = {}
        self._lock = threading.Lock()

    def get(self, organization: str) -> OrganizationCounts:
        """A copy of the counts of ``organization`` (zero when it has done nothing yet)."""
        with self._lock:
            c = self._counts.get(organization, OrganizationCounts())
            return OrganizationCounts(c.last_round_pushed, c.bytes_up, c.bytes_down)

    def count(self, organization: str, direction: str, traffic: TrafficBreakdown) -> None:
        """Add a message's bytes in ``direction`` (a ``Direction``: up from the organization, down to it)."""
        with self._lock:
            c = self._counts.setdefault(organization, OrganizationCounts())
            if direction == Direction.UP:
                c.bytes_up += traffic.total_bytes
            else:
                c.bytes_down += traffic.total_bytes

    def pushed(self, organization: str, round_: int) -> None:
        """Record that an update of ``organization`` for ``round_`` was accepted."""
        with self._lock:
            c = self._counts.setdefault(organization, OrganizationCounts())
            c.last_round_pushed = max(c.last_round_pushed, round_)

    def to_json(self) -> dict[str, list[int]]:
        """A JSON-ready form for the run's checkpoint."""
        with self._lock:
            return {org: [c.last_round_pushed, c.bytes_up, c.bytes_down] for org, c in sorted(self._counts.items())}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> OrganizationLedger:
        """Inverse of ``to_json``; an older checkpoint without a ledger gives an empty one."""
        ledger = cls()
        for org, (last, up, down) in (data or {}).items():
            ledger._counts[org] = OrganizationCounts(int(last), int(up), int(down))
        return ledger

    def statuses(self, organizations: Iterable[str], joined: set[str]) -> tuple[OrganizationStatus, ...]:
        """One OrganizationStatus per organization of the run, in the run's order."""
        out = []
        for org in organizations:
            c = self.get(org)
            out.append(OrganizationStatus(org, org in joined, c.last_round_pushed, c.bytes_up, c.bytes_down))
        return tuple(out)
