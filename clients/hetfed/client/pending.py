"""A push kept on disk until the aggregator acknowledges it, so that a restarted client resumes it.

Before a round's update leaves, the client writes it to ``<state_dir>/<run>/pending-push.update`` (the exact
bytes it pushes, from the encoded buffer: no copy) and, beside it, ``pending-push.pt``: the update's BLAKE3
digest and size, the round and what the round was (its action, round seed and the round the half had finished
before it), the half's private state after the round's work, the organization's own exact figures and, under
``[privacy]``, the figures the round released. Each file is written to a temporary file and fsynced; then the
update is renamed into place, the record after it, and the directory is fsynced: a record on disk always names
a complete update. The runtime keeps a push of ``keep_push_from_bytes`` or more, and every push under
``[privacy]``.

A client restarted with the same state directory that is asked for the same round (same run, organization,
algorithm, seed, model, action, round seed, and the same finished round) does not work the round again: it
loads the private state the record holds, maps the update read-only (its pages are the file's, not the
process's own) and pushes it from the chunks the aggregator holds (``PushProgress``). The same already-noised
bytes go out, so the privacy ledger is not charged again. A record that does not match is removed, with a log
line, and never pushed. The runtime removes the record once the round is over for the organization
(acknowledged, or refused ``late``).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hetfed.client.crashpoints import crash_point
from hetfed.client.state import fsync_directory, pack, unpack
from hetfed.wire.chunks import Bytes
from hetfed.wire.payloads import EvalMetrics

log = logging.getLogger("hetfed.client")

FORMAT = 1
RECORD_NAME = "pending-push.pt"
DATA_NAME = "pending-push.update"
# os.write moves at most about 2 GiB a call on Linux: larger updates go in slices of this.
_WRITE_SLICE = 1 << 30


@dataclass(frozen=True)
class RoundKey:
    """What a round was, as the client was asked for it: a kept push resumes only the same round."""

    round: int
    action: str
    round_seed: int
    # The round the half's private state had finished before this one (-1: none).
    after: int

    def describe(self) -> str:
        return (f"round {self.round} ({self.action}, round seed {self.round_seed}, after round {self.after})")


@dataclass
class PendingPush:
    """A kept push: the update's bytes (a read-only memory map of its file) and what resuming it needs."""

    key: RoundKey
    data: Bytes
    digest: bytes
    # The half's private state after the round's work.
    state: dict[str, Any]
    # The organization's own exact figures of the round (its record, gauges and reports).
    exact: list[EvalMetrics]
    # Under [privacy]: the figures the round released (name -> value), which later uploads carry.
    released: dict[str, float]


def _write_all(fd: int, data: Bytes) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        done = os.write(fd, view[:_WRITE_SLICE])
        view = view[done:]


class PendingPushFile:
    """The kept push of one organization in one run (at most one: the round being pushed)."""

    def __init__(self, state_dir: str | Path, run: str, identity: Mapping[str, Any]) -> None:
        self.dir = Path(state_dir) / run
        self.record = self.dir / RECORD_NAME
        self.update = self.dir / DATA_NAME
        # Where each is written before it is renamed into place (left behind only by a process killed meanwhile).
        self._temporary = (self.update.with_suffix(".update-tmp"), self.record.with_suffix(".tmp"))
        # What must match besides the round: the run, organization, algorithm, seed and model (as StateFile's).
        self.identity = dict(identity)

    def save(self, key: RoundKey, data: Bytes, digest: bytes, state: Mapping[str, Any], exact: Sequence[EvalMetrics],
             released: Mapping[str, float]) -> None:
        """Keep a push before it leaves: the update from its own buffer, then the record naming it (atomically)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.record.unlink(missing_ok=True)  # an older record never names the new update
        tmp_data, tmp_record = self._temporary
        fd = os.open(tmp_data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("pending.update_written")
        body = {"format": FORMAT, "identity": self.identity, "key": asdict(key), "digest": bytes(digest),
                "size": memoryview(data).nbytes, "state": pack(state), "exact": [_metrics(m) for m in exact],
                "released": dict(released)}
        with open(tmp_record, "wb") as f:
            torch.save(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_data, self.update)
        os.replace(tmp_record, self.record)
        fsync_directory(self.dir)

    def take(self, key: RoundKey) -> PendingPush | None:
        """The kept push of the round ``key`` names; None when there is none. One that cannot be read or belongs
        to something else (another run, round, round seed, algorithm...) is removed, with a log line."""
        if not self.record.exists():
            self.remove()  # an update whose record was never written names nothing
            return None
        why, pending = self._read(key)
        if pending is None:
            log.warning("discarded the kept push in %s: %s; it is not sent", self.record, why)
            self.remove()
        return pending

    def _read(self, key: RoundKey) -> tuple[str, PendingPush | None]:
        try:
            raw = torch.load(self.record, map_location="cpu", weights_only=True)
        except Exception as exc:
            return f"it cannot be read ({type(exc).__name__}: {exc})", None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            return f"it is not a kept push of format {FORMAT}", None
        saved = raw.get("identity", {})
        differ = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in self.identity.items() if saved.get(k) != v]
        if differ:
            return f"it belongs to another run: {', '.join(differ)}", None
        kept = RoundKey(**raw["key"])
        if kept != key:
            return f"it is the push of {kept.describe()}, and the aggregator asks for {key.describe()}", None
        size = int(raw["size"])
        try:
            data = _mapped(self.update, size)
        except (OSError, ValueError) as exc:
            return f"its update {self.update} cannot be read ({exc})", None
        return "", PendingPush(kept, data, bytes(raw["digest"]), unpack(raw["state"]),
                               [EvalMetrics(**{**m, "withheld": tuple(m["withheld"])}) for m in raw["exact"]],
                               {str(k): float(v) for k, v in raw["released"].items()})

    def remove(self) -> None:
        """Forget the kept push (the record first: an update without its record names nothing), and any temporary
        file a killed process left."""
        paths = (self.record, self.update, *self._temporary)
        if any(p.exists() for p in paths):
            for p in paths:
                p.unlink(missing_ok=True)
            fsync_directory(self.dir)


def _metrics(m: EvalMetrics) -> dict[str, Any]:
    return {**asdict(m), "withheld": list(m.withheld)}


def _mapped(path: Path, size: int) -> Bytes:
    """The file's bytes as a read-only memory map (ValueError when it does not hold ``size`` bytes)."""
    with open(path, "rb") as f:
        found = os.fstat(f.fileno()).st_size
        if found != size:
            raise ValueError(f"{found} bytes, the record says {size}")
        if size == 0:
            return b""
        return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
