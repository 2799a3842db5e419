"""Per-organization accounting of a run: its last accepted round, the bytes it sent and received, and the
privacy its updates declared.

The round engine feeds it (``count`` where traffic is recorded, ``pushed`` where an update is folded in)
and checkpoints it with the run's metadata; ``Status`` reports it per organization (``hetfed status``), and the
metrics collector reads the declared privacy (``hetfed_privacy_*``). A restart restores it from the checkpoint,
then replays the open round's logged updates, which carry their declarations again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hetfed.wire.messages import OrganizationStatus
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.traffic import Direction, TrafficBreakdown


@dataclass
class OrganizationCounts:
    """One organization's figures in one run."""

    last_round_pushed: int = -1
    bytes_up: int = 0
    bytes_down: int = 0
    # The last privacy declaration of its accepted updates (None before its first), and whether its last accepted
    # update carried one (``protected``).
    privacy: PrivacyDeclaration | None = None
    protected: bool = False

    @property
    def unprotected(self) -> bool:
        """Whether it has an accepted update and the last one declared no privacy."""
        return self.last_round_pushed >= 0 and not self.protected


class OrganizationLedger:
    """Counts per organization, thread-safe: traffic is counted outside the run's lock (by the servicer's
    handlers) while pushes are recorded and checkpoints taken under it."""

    def __init__(self) -> None:
        self._counts: dict[str, OrganizationCounts] = {}
        self._lock = threading.Lock()

    def get(self, organization: str) -> OrganizationCounts:
        """A copy of the counts of ``organization`` (zero when it has done nothing yet)."""
        with self._lock:
            return dataclasses.replace(self._counts.get(organization, OrganizationCounts()))

    def count(self, organization: str, direction: str, traffic: TrafficBreakdown) -> None:
        """Add a message's bytes in ``direction`` (a ``Direction``: up from the organization, down to it)."""
        with self._lock:
            c = self._counts.setdefault(organization, OrganizationCounts())
            if direction == Direction.UP:
                c.bytes_up += traffic.total_bytes
            else:
                c.bytes_down += traffic.total_bytes

    def pushed(self, organization: str, round_: int, privacy: PrivacyDeclaration | None = None) -> None:
        """Record that an update of ``organization`` for ``round_`` was accepted, declaring ``privacy``."""
        with self._lock:
            c = self._counts.setdefault(organization, OrganizationCounts())
            if round_ >= c.last_round_pushed:
                c.protected = privacy is not None
                c.privacy = privacy or c.privacy
            c.last_round_pushed = max(c.last_round_pushed, round_)

    def to_json(self) -> dict[str, list[Any]]:
        """A JSON-ready form for the run's checkpoint: ``[last round, bytes up, bytes down]``, and a fourth item
        once the organization declared privacy (so runs without it keep the older form)."""
        with self._lock:
            return {org: [c.last_round_pushed, c.bytes_up, c.bytes_down,
                          *(() if c.privacy is None else (_privacy_to_json(c),))]
                    for org, c in sorted(self._counts.items())}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> OrganizationLedger:
        """Inverse of ``to_json``; an older checkpoint without a ledger gives an empty one."""
        ledger = cls()
        for org, (last, up, down, *rest) in (data or {}).items():
            c = OrganizationCounts(int(last), int(up), int(down))
            if rest:
                c.privacy = PrivacyDeclaration(**rest[0]["last"])
                c.protected = bool(rest[0]["protected"])
            ledger._counts[org] = c
        return ledger

    def statuses(self, organizations: Iterable[str], joined: set[str]) -> tuple[OrganizationStatus, ...]:
        """One OrganizationStatus per organization of the run, in the run's order."""
        out = []
        for org in organizations:
            c = self.get(org)
            out.append(OrganizationStatus(org, org in joined, c.last_round_pushed, c.bytes_up, c.bytes_down,
                                          c.protected, c.privacy.epsilon if c.privacy is not None else 0.0))
        return tuple(out)


def _privacy_to_json(c: OrganizationCounts) -> dict[str, Any]:
    assert c.privacy is not None
    return {"protected": c.protected, "last": dataclasses.asdict(c.privacy)}
