"""The history (``history.jsonl``): one JSON line per closed round, with the CRC-32 of its content.

A closing round's line is written and fsync'd past the committed lines *before* the checkpoint that counts it
(``history_len``). A line beyond that count (a close whose checkpoint never landed) is cut off at start-up and
overwritten by the retried close. The checkpoint keeps a copy of the last committed line, so a torn last line
is repaired from it. ``RoundRecord`` is the typed record; the file holds its JSON form.
"""

from __future__ import annotations

import json
import logging
import zlib
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.aggregator.journal.disk import Disk, StateError, StorageError
from hetfed.wire import messages
from hetfed.wire.messages import RoundSummary
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.phases import Phase
from hetfed.wire.traffic import KindCount, TrafficBreakdown

log = logging.getLogger("hetfed.aggregator")


def _traffic_json(b: TrafficBreakdown) -> dict[str, dict[str, int]]:
    return {k: {"bytes": c.bytes, "messages": c.messages, "elements": c.elements} for k, c in b.kinds.items()}


def _traffic_from_json(d: dict[str, Any]) -> TrafficBreakdown:
    # Older checkpoints stored [bytes, messages, elements] lists.
    return TrafficBreakdown({k: KindCount(*v) if isinstance(v, list) else KindCount(**v) for k, v in d.items()})


def _metrics_json(m: EvalMetrics) -> dict[str, Any]:
    return {"train_loss": m.train_loss, "num_train_examples": m.num_train_examples, "test_accuracy": m.test_accuracy,
            "test_loss": m.test_loss, "num_test_examples": m.num_test_examples, "extra": dict(m.extra),
            "withheld": list(m.withheld)}


def _metrics_from_json(v: Any) -> EvalMetrics:
    if isinstance(v, list):  # older checkpoints: positional
        return EvalMetrics(v[0], v[1], v[2], v[3], v[4], dict(v[5]))
    return EvalMetrics(**{**v, "extra": dict(v["extra"]), "withheld": tuple(v.get("withheld", ()))})


@dataclass
class RoundRecord:
    """What happened in one round: who pushed, how long it took, traffic and reported metrics."""

    round: int
    phase: Phase
    started: float
    duration: float = 0.0
    clients: int = 0
    up: TrafficBreakdown = field(default_factory=TrafficBreakdown)
    down: TrafficBreakdown = field(default_factory=TrafficBreakdown)
    reports: dict[str, EvalMetrics] = field(default_factory=dict)
    # Why the round's secure aggregate was abandoned (it closed with the model unchanged); "" when it was not.
    abandoned: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form with named fields (for the history file)."""
        return {
            "round": self.round,
            "phase": self.phase.value,
            "duration": self.duration,
            "clients": self.clients,
            "up": _traffic_json(self.up),
            "down": _traffic_json(self.down),
            "reports": {org: _metrics_json(m) for org, m in sorted(self.reports.items())},
            **({"abandoned": self.abandoned} if self.abandoned else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RoundRecord:
        """Inverse of ``to_json``."""
        rec = cls(d["round"], Phase(d["phase"]), 0.0, d["duration"], d["clients"], _traffic_from_json(d["up"]),
                  _traffic_from_json(d["down"]))
        rec.reports = {org: _metrics_from_json(v) for org, v in d["reports"].items()}
        rec.abandoned = str(d.get("abandoned", ""))
        return rec

    def summary(self, clients: int | None = None) -> RoundSummary:
        """The typed summary Status reports, its reports by organization name: a mean over them is then the
        same float whatever order the organizations pushed in."""
        return RoundSummary(self.round, self.clients if clients is None else clients, self.duration,
                            messages.summary_traffic(self.up, self.down), dict(sorted(self.reports.items())),
                            self.abandoned)


# Each history line carries the CRC-32 of the rest of its JSON object (lines written before it have none).
_LINE_CRC = "crc32"


def _line_crc(record: dict[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps(record).encode()):08x}"


def _history_line(record: dict[str, Any]) -> bytes:
    return json.dumps({**record, _LINE_CRC: _line_crc(record)}).encode() + b"\n"


class HistoryFile:
    """The committed round records and at most one pending line (``append`` then ``commit``)."""

    def __init__(self, path: Path, disk: Disk) -> None:
        self.path = path
        self.disk = disk
        self._fd = -1
        self._size = 0  # bytes of the committed lines
        self.count = 0  # committed lines
        self._dirty = False  # bytes past _size may remain (an uncommitted or failed append)
        self.last: dict[str, Any] | None = None  # the last committed record (the checkpoint keeps a copy)
        self._pending: tuple[dict[str, Any], int] | None = None  # (record, bytes) written, not yet counted

    def open(self, count: int, last: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The ``count`` committed records; lines past them are cut off, a torn last one repaired from ``last``."""
        path = self.path
        blob = path.read_bytes() if path.exists() else b""
        records: list[dict[str, Any]] = []
        pos = 0
        problem = ""
        while len(records) < count:
            nl = blob.find(b"\n", pos)
            line = blob[pos:] if nl == -1 else blob[pos:nl]
            what = f"line {len(records) + 1} of the {count} the checkpoint counts"
            if nl == -1:
                problem = f"{what} is missing" if not line else f"{what} is cut short ({len(line)} bytes)"
                break
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError) as exc:
                problem = f"{what} is not JSON ({exc})"
                break
            if not isinstance(rec, dict):
                problem = f"{what} is not a JSON object"
                break
            crc = rec.pop(_LINE_CRC, None)
            if crc is not None and crc != _line_crc(rec):
                problem = f"{what} fails its CRC-32"
                break
            records.append(rec)
            pos = nl + 1
        repaired = b""
        if problem:
            if len(records) == count - 1 and isinstance(last, dict):
                repaired = _history_line(last)
                records.append(last)
                log.warning("%s: %s; rewritten from the checkpoint's copy", path, problem)
            else:
                raise StateError(f"{path}: {problem}. The closed rounds' records cannot be rebuilt: restore the "
                                 "file from a backup")
        if pos < len(blob) and not repaired:
            log.info("%s: cut off %d bytes after the %d committed rounds (a close that did not complete)",
                     path, len(blob) - pos, count)
        try:
            self._fd = self.disk.open(path)
            if repaired or pos < len(blob):
                self.disk.truncate(self._fd, pos)
                if repaired:
                    self.disk.pwrite(self._fd, repaired, pos)
                self.disk.fsync(self._fd)
        except OSError as exc:
            raise StateError(f"{path} cannot be repaired ({exc.strerror or exc})") from None
        self._size = pos + len(repaired)
        self.count = count
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Write and fsync a closing round's history line past the committed lines (not yet counted: the
        checkpoint of ``commit_close`` counts it). A line written before and never counted is replaced."""
        line = _history_line(record)
        self._pending = None
        try:
            if self._dirty:
                self.disk.truncate(self._fd, self._size)
            self._dirty = True
            self.disk.pwrite(self._fd, line, self._size)
            crash_point("history.written")
            self.disk.fsync(self._fd)
            crash_point("history.synced")
        except OSError as exc:
            raise StorageError(f"could not append round {record.get('round')}'s record to {self.path} "
                               f"({exc.strerror or exc})") from None
        self._pending = (record, len(line))

    def pending(self) -> dict[str, Any]:
        """The record ``append`` wrote and no checkpoint counts yet; StorageError when there is none."""
        if self._pending is None:
            raise StorageError("no closing round's history line to commit")
        return self._pending[0]

    def commit(self) -> None:
        """The checkpoint that counts the pending line is on disk: it is committed."""
        record, size = self._pending  # type: ignore[misc]
        self._size += size
        self.count += 1
        self._dirty = False
        self.last = record
        self._pending = None

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            with suppress(OSError):
                self.disk.close(self._fd)
        self._fd = -1
