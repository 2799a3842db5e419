"""A run's durable state: the journal of three files in one directory, with one lock.

- ``checkpoint.npz`` (``hetfed.aggregator.journal.checkpoint``): the run's state and its server half's arrays, replaced
  atomically; the commit point of a close, a join and a refusal.
- ``history.jsonl`` (``hetfed.aggregator.journal.history``): one line per closed round. A closing round's line is
  fsync'd before the checkpoint that counts it; the engine writes the line (``append_history``) before it wakes
  the round's clients, and the checkpoint that counts it (``commit_close``) after.
- ``updates.wal`` (``hetfed.aggregator.journal.wal``): the open round's accepted updates, durable before acknowledged.
- ``secure.log`` (``hetfed.aggregator.journal.stages``): a secure round's stage messages and closes, durable before
  they are answered.

What is acknowledged is on disk, what failed left no trace. A missing or unreadable checkpoint next to existing
history or log records, or a history line the checkpoint counts that cannot be read or repaired, is refused with
``StateError`` naming the file: the run is never silently started over.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.aggregator.journal.checkpoint import CheckpointFile
from hetfed.aggregator.journal.disk import DISK, Disk, RunConflictError, StateError, StorageError
from hetfed.aggregator.journal.history import HistoryFile
from hetfed.aggregator.journal.stages import StageLog
from hetfed.aggregator.journal.wal import WalTicket, WriteAheadLog, scan_wal

__all__ = ["DISK", "Disk", "Recovered", "RunConflictError", "RunStore", "StateError", "StorageError", "WalTicket",
           "holder_of", "scan_wal"]


@dataclass
class Recovered:
    """A run's durable state, read at start-up: checkpoint metadata and arrays, committed history."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    history: list[dict[str, Any]]


def holder_of(run_dir: Path) -> str | None:
    """Who holds the lock of a run's state directory (an aggregator serving it), or None when nobody does."""
    path = run_dir / "lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)
    return None


def _holder(fd: int) -> str:
    """What the holder of a run directory's lock wrote into it ("pid N")."""
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"


class RunStore:
    """One run's directory. Construct it, then call ``recover()`` once before anything else: it checks and
    repairs the files and returns the durable state (None for a new run)."""

    def __init__(self, root: str | Path, run_id: str, disk: Disk | None = None) -> None:
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.disk = disk or DISK
        self.checkpoint = CheckpointFile(self.dir / "checkpoint.npz", self.disk)
        self.history = HistoryFile(self.dir / "history.jsonl", self.disk)
        self.wal = WriteAheadLog(self.dir / "updates.wal", self.disk)
        self.stages = StageLog(self.dir / "secure.log", self.disk)
        self.checkpoint_path, self.history_path, self.wal_path = self.checkpoint.path, self.history.path, self.wal.path
        self._lock_fd = -1
        # The write-ahead log's operations, as the engine calls them.
        self.append_update, self.sync, self.repair = self.wal.append, self.wal.sync, self.wal.repair
        self.views = self.wal.views
        self.failed_update, self.updates, self.write_update = self.wal.failed_update, self.wal.updates, \
            self.wal.write_update
        self.drop_rounds_before = self.wal.drop_rounds_before

    def _lock(self) -> None:
        """Hold an exclusive lock on the run's directory for this store's lifetime: a second aggregator on
        the same state directory (a stale process, a copy started by hand) would interleave its writes with
        this one's, so it is refused, naming the holder."""
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateError(f"{self.dir} is in use by another aggregator ({holder}); stop it first, or give "
                             "this one another state_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def recover(self) -> Recovered | None:
        """Check and repair the run's files; the durable state, or None for a new run. Raises StateError."""
        if self._lock_fd < 0:
            self._lock()
        for stale in self.dir.glob(".checkpoint.npz.tmp*"):
            stale.unlink(missing_ok=True)
        if not self.checkpoint_path.exists():
            found = []
            if self.history_path.exists() and self.history_path.stat().st_size:
                found.append(f"{self.history_path.name} holds closed rounds")
            if self.wal.holds_records():
                found.append(f"{self.wal_path.name} holds {self.wal_path.stat().st_size} bytes of updates")
            if found:
                raise StateError(
                    f"{self.checkpoint_path} is missing, but {' and '.join(found)}: the run's state is incomplete, "
                    "and starting the run over would discard it. Restore checkpoint.npz from a backup, or move "
                    f"{self.dir} aside to start run {self.dir.name!r} from its first round")
            self.history.open(0, None)
            self.wal.open()
            self.stages.open()
            return None
        meta, arrays = self.checkpoint.read()
        history = self.history.open(int(meta.get("history_len", 0)), meta.get("last_record"))
        self.history.last = meta.get("last_record")
        self.wal.open()
        self.stages.open()
        return Recovered(meta, arrays, history)

    def read_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The checkpoint's metadata and arrays; StateError names the file when it cannot be read."""
        return self.checkpoint.read()

    def save_checkpoint(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Atomically replace the checkpoint (the history it counts unchanged); StorageError leaves the old one."""
        self._write_checkpoint({**meta, "history_len": self.history.count, "last_record": self.history.last}, arrays)

    def append_history(self, record: dict[str, Any]) -> None:
        """Write and fsync a closing round's history line past the committed lines (``commit_close`` counts it)."""
        self.history.append(record)

    def commit_close(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Write the checkpoint that counts the line of ``append_history``: the close's commit point. On
        ``StorageError`` the old checkpoint stands and the call may be repeated with the same arguments."""
        record = self.history.pending()
        self._write_checkpoint({**meta, "history_len": self.history.count + 1, "last_record": record}, arrays)
        self.history.commit()

    def close_round(self, record: dict[str, Any], meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """``append_history`` then ``commit_close``: on ``StorageError`` nothing is committed."""
        self.append_history(record)
        self.commit_close(meta, arrays)

    def _write_checkpoint(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        self.checkpoint.write(meta, arrays)

    def close(self) -> None:
        """Close the files and release the directory's lock."""
        self.wal.close()
        self.history.close()
        self.stages.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
