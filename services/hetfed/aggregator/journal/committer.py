"""The checkpoint that commits a round's close, written after the round's clients are woken.

A closing round's history line is durable before its clients are woken; the checkpoint that counts it is
written afterwards, outside the run's lock (in the worker pool), so the next round's instructions do not wait
for it. Until it is on disk, joins, refusals and the next round's pushes wait (``await_locked``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from hetfed.aggregator.journal.checkpoint import CheckpointMeta
from hetfed.aggregator.journal.store import RunStore, StorageError
from hetfed.wire.errors import WireError

log = logging.getLogger("hetfed.aggregator")


class CloseCommitter:
    """At most one pending close checkpoint of a run; ``lock`` is the run's lock."""

    def __init__(self, run_id: str, lock: threading.RLock, store: RunStore, on_error: Callable[[], None]) -> None:
        self.run_id, self.store, self.on_error = run_id, store, on_error
        self._lock = lock
        self.committed = threading.Condition(lock)
        self._writer = threading.Lock()  # one checkpoint writer at a time
        # (metadata, arrays, first round whose logged updates are kept)
        self._pending: tuple[CheckpointMeta, Mapping[str, np.ndarray], int] | None = None
        self.error = ""

    def set(self, meta: CheckpointMeta, arrays: Mapping[str, np.ndarray], keep_from: int) -> None:
        """A close's checkpoint to write (call with the run's lock held)."""
        self._pending = (meta, arrays, keep_from)

    def pending(self) -> bool:
        """Whether a closed round's checkpoint waits to be written."""
        return self._pending is not None

    def commit(self, closed_round: Callable[[], int]) -> None:
        """Write the pending checkpoint, if any (call without holding the run's lock), then drop the closed
        round's logged updates. A failure is logged once and retried by the deadline ticker; meanwhile the next
        round's pushes are answered ``storage_unavailable``."""
        with self._writer:
            with self._lock:
                pending = self._pending
            if pending is None:
                return
            meta, arrays, keep_from = pending
            try:
                self.store.commit_close(meta.to_json(), arrays)
            except StorageError as exc:
                self.on_error()
                with self._lock:
                    if str(exc) != self.error:
                        log.error("run %s: the checkpoint of round %d's close could not be written (%s); retried "
                                  "by the deadline ticker", self.run_id, closed_round(), exc)
                    self.error = str(exc)
                    self.committed.notify_all()
                return
            with self._lock:
                self._pending = None
                self.error = ""
                # A finished run keeps no logged update: a restart must not replay the evaluation round.
                self.store.drop_rounds_before(keep_from)
                self.committed.notify_all()

    def await_locked(self, closed_round: int, timeout: float = 30.0) -> None:
        """Wait (releasing the run's lock) until the pending checkpoint is on disk; ``storage_unavailable`` when
        its write failed or does not finish in ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._pending is not None:
            left = deadline - time.monotonic()
            if self.error or left <= 0:
                raise WireError("storage_unavailable", f"round {closed_round}'s checkpoint is not on disk yet "
                                                       f"({self.error or 'still being written'}); try again")
            self.committed.wait(left)
