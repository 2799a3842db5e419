"""A run's ``Journal``: its store, the group commit of pushed updates, and the pending checkpoint of a close.

A push claims its organization's place (``claim_locked``) before its update is checked; the checked update is
appended to the log under the run's lock (``log_locked``), made durable outside it, where concurrent pushes share
one fsync (``sync``), and settled under the lock again (``settle_locked``) before the run folds it in: nothing is
folded, nor acknowledged, before it is on disk. At most one update per organization is on its way in at a time.
A round's close writes its history line at once (``append_history``) and leaves its checkpoint pending
(``set_close_locked``) until ``commit_pending`` writes it outside the lock.

``lock`` is the run's lock: methods whose name ends in ``_locked`` are called with it held, the others without.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from hetfed.aggregator.journal.checkpoint import CheckpointMeta
from hetfed.aggregator.journal.committer import CloseCommitter
from hetfed.aggregator.journal.stages import StageKind, StageRecord
from hetfed.aggregator.journal.store import Disk, Recovered, RunStore, StateError, StorageError, WalTicket
from hetfed.wire.errors import WireError


class Journal:
    """One run's durable record (see the module docstring)."""

    def __init__(self, run_id: str, state_dir: str, disk: Disk | None, lock: threading.RLock,
                 on_error: Callable[[], None]) -> None:
        self.store = RunStore(state_dir, run_id, disk)
        self._run_id, self._lock, self._on_error = run_id, lock, on_error
        self._committer = CloseCommitter(run_id, lock, self.store, on_error)
        self._syncing: set[str] = set()  # organizations whose update is on its way in (claimed, not settled)

    @property
    def dir(self) -> Path:
        """The run's state directory."""
        return self.store.dir

    @property
    def committed(self) -> threading.Condition:
        """Notified (on the run's lock) whenever a pending close checkpoint is written or fails."""
        return self._committer.committed

    @property
    def commit_error(self) -> str:
        """Why the last write of a close checkpoint failed ("" when it did not)."""
        return self._committer.error

    # ----------------------------------------------------------------- start-up and reads
    def recover(self) -> Recovered | None:
        """The durable state (None for a new run); ``StateError`` when it cannot be read."""
        return self.store.recover()

    def recover_or_start(self, first: Callable[[], tuple[CheckpointMeta, Mapping[str, np.ndarray]]],
                         ) -> Recovered | None:
        """The durable state, or None for a new run, whose first checkpoint (``first()``: its metadata and
        arrays) is written now; ``StateError`` naming the run when it cannot be read or written."""
        try:
            loaded = self.recover()
        except StateError as exc:
            raise StateError(f"run {self._run_id!r}: {exc}") from None
        if loaded is None:
            try:
                self.save_checkpoint(*first())
            except StorageError as exc:
                raise StateError(f"run {self._run_id!r}: cannot write its first checkpoint: {exc}") from None
        return loaded

    def read_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The checkpoint's metadata and arrays."""
        return self.store.read_checkpoint()

    def logged(self, round_: int) -> list[tuple[str, bytes]]:
        """The open round's logged updates, ``(organization, data)``, in log order."""
        return list(self.store.updates(round_))

    def views(self, round_: int) -> list[tuple[str, memoryview]]:
        """The open round's logged updates, ``(organization, data)`` in organization order, as read-only views of
        the mapped log (valid until the round's records are dropped after its close)."""
        return self.store.views(round_)

    def drop_rounds_before(self, round_: int) -> None:
        """Forget the logged updates of rounds before ``round_``."""
        self.store.drop_rounds_before(round_)

    # ----------------------------------------------------------------- writes
    def save_checkpoint(self, meta: CheckpointMeta, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the checkpoint (a join's, a refusal's, a new run's); ``StorageError`` on failure."""
        self.store.save_checkpoint(meta.to_json(), arrays)

    def persist_locked(self, meta: CheckpointMeta, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the checkpoint for a change that takes effect once it is on disk (a join's, a refusal's);
        ``storage_unavailable`` (nothing changed) on failure."""
        try:
            self.save_checkpoint(meta, arrays)
        except StorageError as exc:
            self.unavailable(exc)

    def append_history(self, record: dict[str, Any]) -> None:
        """Make a closing round's history line durable; ``storage_unavailable`` on failure."""
        try:
            self.store.append_history(record)
        except StorageError as exc:
            self.unavailable(exc)

    def unavailable(self, exc: StorageError) -> NoReturn:
        """Count a failed write and refuse the request it served: ``storage_unavailable``, retryable."""
        self._on_error()
        raise WireError("storage_unavailable", f"{exc}; nothing changed: try again") from None

    def claim_locked(self, organization: str, round_: int) -> None:
        """Hold the organization's place in the log from its push's checks until ``settle_locked``:
        ``too_many_streams`` while another update of it is on its way in (being checked or made durable)."""
        if organization in self._syncing:
            raise WireError("too_many_streams", f"an update of {organization!r} for round {round_} is being "
                                                "received; try again in a moment")
        self._syncing.add(organization)

    def log_locked(self, organization: str, round_: int, data: bytes | memoryview, digest: bytes) -> WalTicket:
        """Append a checked update of a claimed organization to the log (not yet durable);
        ``storage_unavailable`` when the append fails."""
        try:
            return self.store.append_update(round_, organization, data, digest)
        except StorageError as exc:
            self.unavailable(exc)

    def sync(self, organization: str, round_: int, ticket: WalTicket) -> bool:
        """Make the record durable (concurrent pushes share one fsync). False when a failed fsync of another
        record cut it back (``refuse_cut``); ``storage_unavailable`` (every record past the last durable point
        cut) when the fsync fails."""
        try:
            return self.store.sync(ticket)
        except StorageError as exc:
            with self._lock:
                self._syncing.discard(organization)
                self.store.repair()  # every record past the last durable point is cut: none was acknowledged
            self.unavailable(StorageError(self.store.failed_update(organization, round_, exc)))

    def settle_locked(self, organization: str) -> None:
        """The organization's update is no longer on its way in (durable, cut, or refused before it was logged)."""
        self._syncing.discard(organization)

    def refuse_cut(self, organization: str, round_: int) -> NoReturn:
        """Refuse an update that a failed fsync of another record cut back: ``storage_unavailable``."""
        self.unavailable(StorageError(self.store.failed_update(organization, round_, "it was cut back with the "
                                                                                     "records of a failed fsync")))

    # ----------------------------------------------------------------- a secure round's stages
    def stage_records(self, round_: int) -> tuple[list[StageRecord], str]:
        """The stage log's records of ``round_`` read back at start-up, and why the log was damaged ("")."""
        return self.store.stages.records(round_)

    def open_stages_locked(self, round_: int, roster: bytes) -> None:
        """Start the stage log of a secure round (after the last close's checkpoint: until it is on disk, a
        restart closes that round again from its own stage log); ``storage_unavailable`` on failure."""
        self.await_commit_locked(round_ - 1)
        try:
            self.store.stages.start(round_, roster)
        except StorageError as exc:
            self.unavailable(exc)

    def log_stage(self, round_: int, kind: StageKind, organization: str, data: bytes) -> None:
        """Append a record to the stage log durably; ``storage_unavailable`` on failure."""
        try:
            self.store.stages.append(round_, kind, organization, data)
        except StorageError as exc:
            self.unavailable(exc)

    # ----------------------------------------------------------------- a close's checkpoint
    def set_close_locked(self, meta: CheckpointMeta, arrays: Mapping[str, np.ndarray], keep_from: int) -> None:
        """The checkpoint that commits a close, to be written by ``commit_pending``; logged updates of rounds
        before ``keep_from`` are dropped once it is on disk."""
        self._committer.set(meta, arrays, keep_from)

    def commit_pending(self, closed_round: Callable[[], int]) -> None:
        """Write the pending close checkpoint, if any (without the run's lock)."""
        self._committer.commit(closed_round)

    def pending(self) -> bool:
        """Whether a close checkpoint waits to be written."""
        return self._committer.pending()

    def await_commit_locked(self, closed_round: int) -> None:
        """Wait until the pending close checkpoint is on disk; ``storage_unavailable`` when it cannot be."""
        self._committer.await_locked(closed_round)

    def close(self) -> None:
        """Close the run's files and its directory lock."""
        self.store.close()
