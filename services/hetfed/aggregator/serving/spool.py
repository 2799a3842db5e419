"""Pushes received into files: each push's chunks are written, as they arrive, to a spool file under the state
directory, and a push cut mid-stream is kept there for a while so that its sender can resume it.

A push holds about one chunk of memory while it is received; once complete and verified, the handler reads the
update from a read-only memory map of its file. A push smaller than ``MEMORY_BELOW_BYTES`` is received in memory
instead (a file costs a 4 MB push 1.7 ms more CPU, a third more: ``python benchmarks/spool_cost.py``); cut, it
moves to its file and is kept as the others are. Writes are not fsynced: a partial push lives as long as the
aggregator process (a restart empties the spool and the push starts again from chunk 0), and the update is made
durable by the write-ahead log before it is acknowledged, as before.

One partial push per run and organization: a new push of the organization replaces it. A partial push the
sender left is dropped when it is older than ``partial_push_seconds``, when its round is no longer open, or,
oldest first, when the partial pushes together hold more than ``max_partial_push_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter

from hetfed.wire import chunks
from hetfed.wire.chunks import Bytes
from hetfed.wire.errors import WireError
from hetfed.wire.rpc import Receiving

log = logging.getLogger("hetfed.aggregator")
# A run id starts with a letter or digit (config.NAME_RE), so no run's state directory can be this one.
SPOOL_DIR = ".spool"
# Pushes announcing fewer bytes are received in memory: at most max_concurrent_reassemblies of them at once.
MEMORY_BELOW_BYTES = 64 << 20


class FileSink:
    """A reassembler's sink in a file: chunks written at their offsets, the whole mapped read-only at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._total = 0

    def allocate(self, total: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._total = total

    def write(self, offset: int, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def view(self) -> memoryview:
        fd, self._fd = self._fd, -1
        try:
            if self._total == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(fd, self._total, access=mmap.ACCESS_READ))
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Close and delete the file (a memory map of it stays readable until its last view is gone)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


@dataclass(eq=False)
class Partial:
    """One push being received, or cut and kept for its sender to resume."""

    run_id: str
    organization: str
    round: int
    digest: bytes
    path: Path
    receiving: Receiving
    sink: FileSink | None = None  # None while it is received in memory
    attached: bool = True  # a stream is feeding it
    touched: float = field(default_factory=time.monotonic)
    detached: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def held(self) -> tuple[int, int]:
        """(chunks, bytes) received."""
        return self.receiving.assembler.next_index, self.receiving.assembler.received


class Spool:
    """The spool directory and its partial pushes (its methods run on the event loop, ``sweep`` anywhere)."""

    def __init__(self, directory: Path, run_ids: Iterable[str], keep_seconds: float, max_bytes: int,
                 max_update_bytes: int, dropped: Counter, round_open: Callable[[str, str, int], bool]) -> None:
        self.directory = directory
        self.keep_seconds = keep_seconds
        self.max_bytes = max_bytes
        self.max_update_bytes = max_update_bytes
        self._dropped = dropped
        self._round_open = round_open
        # Partial pushes of a previous process cannot be resumed (their hash state is gone). Only the hosted
        # runs' folders: another aggregator may host other runs on the same state directory.
        for run_id in run_ids:
            shutil.rmtree(directory / run_id, ignore_errors=True)
        self._partials: dict[tuple[str, str], Partial] = {}
        self.memory_below = MEMORY_BELOW_BYTES
        self._lock = threading.Lock()
        self._names = itertools.count()

    def __len__(self) -> int:
        with self._lock:
            return len(self._partials)

    async def receive(self, organization: str, run_id: str, round_: int, digest: bytes,
                      first: tuple[int, int, int], wait: float) -> Receiving:
        """The reception of a push whose first chunk has the header ``first`` (index, count, total bytes): a new
        one from chunk 0, or the partial push it resumes (WireError ``not_resumable`` when none is held)."""
        self.sweep()
        index, count, total_bytes = first
        old = await self._settled((run_id, organization), wait)
        if index == 0:
            if old is not None:
                self._drop(old, "replaced")
            return self._start(organization, run_id, round_, digest, total_bytes).receiving
        if not digest:
            raise WireError("malformed", f"chunk {index}/{count} out of order (expected 0): only a "
                                         "stream naming its push by update_blake3 resumes it past chunk 0")
        held = old.held[0] if old is not None and self._same(old, round_, digest, total_bytes) else 0
        if old is None or held != index or old.receiving.assembler.shape != (count, total_bytes):
            raise WireError("not_resumable", f"a push resuming at chunk {index}, but the aggregator holds "
                                             f"{held} chunks of it; push it again from chunk 0")
        with self._lock:  # taken back from a sweep in another thread, or dropped by it just now
            taken = self._partials.get((run_id, organization)) is old
            old.attached = taken
        if not taken:
            raise WireError("not_resumable", "the partial push was dropped just now; push it again from chunk 0")
        old.detached.clear()
        return old.receiving

    def held(self, run_id: str, organization: str) -> tuple[int, int]:
        """(chunks, bytes) of the organization's push being received or kept; (0, 0) when none."""
        with self._lock:
            partial = self._partials.get((run_id, organization))
        return partial.held if partial is not None else (0, 0)

    async def progress(self, organization: str, run_id: str, round_: int, digest: bytes, total_bytes: int,
                       wait: float) -> tuple[int, int]:
        """(chunks, bytes) held of the push of ``digest``, once no stream feeds it; (0, 0) when none is held."""
        self.sweep()
        if not digest:
            return 0, 0
        partial = await self._settled((run_id, organization), wait)
        if partial is None or not self._same(partial, round_, digest, total_bytes):
            return 0, 0
        return partial.held

    def finish(self, receiving: Receiving, accepted: bool) -> None:
        """A stream of a push ended: accepted (the file goes, its map stays), cut while it waited for a chunk
        (kept, when resumable), or refused (dropped)."""
        partial = receiving.owner
        if not isinstance(partial, Partial):
            return
        if accepted:
            self._forget(partial)
            self._remove(partial)
            self._release_waiters(partial)
        elif receiving.waiting and partial.digest and not receiving.assembler.complete:
            if partial.sink is None:  # kept on disk, not in memory
                partial.sink = FileSink(partial.path)
                receiving.assembler.move_to(partial.sink)
            partial.attached = False
            partial.touched = time.monotonic()
            partial.detached.set()
            log.info("push of %s for run %s round %d cut after %d chunks (%d bytes): kept for resumption",
                     partial.organization, partial.run_id, partial.round, *partial.held)
            self.sweep()
        else:
            self._drop(partial, "refused")
            self._release_waiters(partial)

    @staticmethod
    def _release_waiters(partial: Partial) -> None:
        """No stream feeds ``partial`` any more: a stream of the same organization waiting for it goes on."""
        partial.attached = False
        partial.detached.set()

    def sweep(self) -> None:
        """Drop the partial pushes past their time, of closed rounds, then the oldest past the size bound."""
        now = time.monotonic()
        with self._lock:
            idle = sorted((p for p in self._partials.values() if not p.attached), key=lambda p: p.touched)
        for p in idle:
            if now - p.touched > self.keep_seconds:
                self._drop(p, "expired")
            elif not self._round_open(p.run_id, p.organization, p.round):
                self._drop(p, "round_closed")
        with self._lock:
            total = sum(p.held[1] for p in self._partials.values())
            idle = sorted((p for p in self._partials.values() if not p.attached), key=lambda p: p.touched)
        for p in idle:
            if total <= self.max_bytes:
                break
            total -= p.held[1]
            self._drop(p, "over_size")

    @staticmethod
    def _same(p: Partial, round_: int, digest: bytes, total_bytes: int) -> bool:
        return (p.round, p.digest, p.receiving.assembler.shape[1]) == (round_, digest, total_bytes)

    async def _settled(self, key: tuple[str, str], wait: float) -> Partial | None:
        """The partial push of ``key`` once no stream feeds it (WireError ``busy`` after ``wait`` seconds)."""
        with self._lock:
            partial = self._partials.get(key)
        if partial is not None and partial.attached:
            try:
                await asyncio.wait_for(partial.detached.wait(), wait)
            except TimeoutError:
                raise WireError("busy", "another stream of this organization's push is still being received; "
                                        "retry later") from None
        with self._lock:
            return self._partials.get(key)

    def _start(self, organization: str, run_id: str, round_: int, digest: bytes, total_bytes: int) -> Partial:
        tag = digest[:8].hex() if digest else f"stream{next(self._names)}"
        path = self.directory / run_id / f"{organization}-{round_}-{tag}.part"
        sink = FileSink(path) if total_bytes >= self.memory_below else None
        receiving = Receiving(chunks.Reassembler(self.max_update_bytes, sink))
        partial = Partial(run_id, organization, round_, digest, path, receiving, sink)
        receiving.owner = partial
        with self._lock:
            self._partials[(run_id, organization)] = partial
        return partial

    def _forget(self, partial: Partial, idle_only: bool = False) -> bool:
        with self._lock:
            key = (partial.run_id, partial.organization)
            if self._partials.get(key) is not partial or (idle_only and partial.attached):
                return False
            del self._partials[key]
            return True

    @staticmethod
    def _remove(partial: Partial) -> None:
        if partial.sink is not None:
            partial.sink.remove()

    def _drop(self, partial: Partial, reason: str) -> None:
        if self._forget(partial, idle_only=reason in ("expired", "round_closed", "over_size")):
            self._remove(partial)
            if partial.held[0] and reason != "refused":
                log.info("dropped the partial push of %s for run %s round %d (%s, %d bytes)",
                         partial.organization, partial.run_id, partial.round, reason, partial.held[1])
            self._dropped.labels(reason).inc()
