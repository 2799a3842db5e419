"""Pushes received into files: each push's chunks are written, as they arrive, to a spool file under the state
directory, and a push cut mid-stream is kept there for a while so that its sender can resume it, by this
process or, after a restart, by the next one.

A push holds about one chunk of memory while it is received; once complete and verified, the handler reads the
update from a read-only memory map of its file. A push smaller than ``MEMORY_BELOW_BYTES`` is received in memory
instead (a file costs a 4 MB push 1.7 ms more CPU, a third more: ``python benchmarks/spool_cost.py``); cut, it
moves to its file and is kept as the others are.

Durability (``spool_record``): a push in its file is fsync'd each ``SYNC_BYTES`` received and when it is cut,
and after each fsync a small record beside the file is replaced atomically: which push it is and how many of its
chunks and bytes are durable, with the BLAKE3 digest of those bytes. The fsyncs run in a thread of the spool's
own, never on the event loop; a cut push is offered for resumption (``progress``) once its fsync is done, so what
``PushProgress`` reports of it has been made durable (unless that fsync failed, which is logged: the push is then
kept as long as this process lives, and a restart falls back to its last record). A push received in memory is
made durable only when it is cut. A restarted aggregator loads the partial pushes of its runs whose record is
sound and whose round is still open, cuts each file to its durable prefix and hashes that again (in blocks), and
keeps them as partial pushes cut at the restart; the rest are deleted and counted in
``hetfed_partial_pushes_dropped_total`` (``invalid``, ``torn``, ``unsynced``, ``round_closed``, ``replaced``).

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
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter

from hetfed.aggregator.serving import spool_record
from hetfed.aggregator.serving.spool_record import Loaded, Record
from hetfed.wire import chunks
from hetfed.wire.chunks import Bytes
from hetfed.wire.errors import WireError
from hetfed.wire.rpc import Receiving

log = logging.getLogger("hetfed.aggregator")
# A run id starts with a letter or digit (config.NAME_RE), so no run's state directory can be this one.
SPOOL_DIR = ".spool"
# Pushes announcing fewer bytes are received in memory: at most max_concurrent_reassemblies of them at once.
MEMORY_BELOW_BYTES = 64 << 20
# A push received into its file is fsync'd (and its record written) each time this many more bytes have arrived.
SYNC_BYTES = 64 << 20


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

    def adopt(self, fd: int, total: int) -> None:
        """Go on in the open file ``fd`` (a partial push an earlier process began) instead of ``allocate``."""
        self._fd = fd
        self._total = total

    def dup(self) -> int:
        """A descriptor of the file of its own (for an fsync in another thread, which closes it)."""
        return os.dup(self._fd)

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

    def close(self) -> None:
        """Close the file (a memory map of it stays readable until its last view is gone)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Close and delete the file."""
        self.close()
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
    durable: tuple[int, int] = (0, 0)  # (chunks, bytes) fsync'd and named by its record
    synced_from: int = 0  # the bytes received when its last fsync was started
    gone: bool = False  # its files are deleted: no fsync may write its record any more
    lock: threading.Lock = field(default_factory=threading.Lock)  # over ``gone`` and its record's rename

    @property
    def held(self) -> tuple[int, int]:
        """(chunks, bytes) received."""
        return self.receiving.assembler.next_index, self.receiving.assembler.received

    def record(self) -> Record:
        """What its record says once the chunks received so far are durable (on the event loop)."""
        asm, r = self.receiving.assembler, self.receiving
        return Record(self.run_id, self.organization, self.round, self.digest, *asm.shape, *self.held,
                      asm.prefix_digest(), r.wire_bytes, r.messages)


class Syncer:
    """Makes partial pushes durable in a thread of its own, one fsync at a time, in the order asked (so a
    push's records only move forward, and the event loop never waits for a disk)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetfed-spool")

    def submit(self, partial: Partial, record: Record, fd: int) -> asyncio.Future[bool]:
        """Fsync ``fd`` (a descriptor of the partial push's file of its own, closed after), then write ``record``
        (its chunks received when the fsync was asked for); the future is whether both were done."""
        return asyncio.get_running_loop().run_in_executor(self._pool, self.sync, partial, record, fd)

    @staticmethod
    def sync(partial: Partial, record: Record, fd: int) -> bool:
        """The fsync and the record (in the spool's thread)."""
        first = partial.durable == (0, 0)
        try:
            spool_record.sync_data(fd)
            spool_record.write_record(partial.path, record, partial.lock, lambda: not partial.gone)
            if first:  # the names of a new run folder and of a new spool directory
                spool_record.sync_directory(partial.path.parent.parent)
                spool_record.sync_directory(partial.path.parent.parent.parent)
        except OSError as exc:
            log.warning("the partial push of %s for run %s round %d was not made durable at %d bytes: %s",
                        partial.organization, partial.run_id, partial.round, record.held_bytes, exc)
            return False
        finally:
            os.close(fd)
        if not partial.gone:
            partial.durable = (record.chunks, record.held_bytes)
        return True

    def close(self) -> None:
        """Finish the fsyncs asked for (a graceful stop keeps the pushes it cut)."""
        self._pool.shutdown(wait=True)


class Spool:
    """The spool directory and its partial pushes (its methods run on the event loop, ``sweep`` anywhere).

    At construction it loads the hosted runs' partial pushes that an earlier process made durable (blocking)."""

    def __init__(self, directory: Path, run_ids: Iterable[str], keep_seconds: float, max_bytes: int,
                 max_update_bytes: int, dropped: Counter, round_open: Callable[[str, str, int], bool]) -> None:
        self.directory = directory
        self.keep_seconds = keep_seconds
        self.max_bytes = max_bytes
        self.max_update_bytes = max_update_bytes
        self._dropped = dropped
        self._round_open = round_open
        self._partials: dict[tuple[str, str], Partial] = {}
        self.memory_below = MEMORY_BELOW_BYTES
        self.sync_bytes = SYNC_BYTES
        self._syncer = Syncer()
        self._lock = threading.Lock()
        self._names = itertools.count()
        # Only the hosted runs' folders: another aggregator may host other runs on the same state directory.
        for run_id in run_ids:
            for found in spool_record.scan(directory / run_id, run_id, max_update_bytes, round_open, self._gone):
                self._restore(found)
        self.sweep()  # the size bound over what was loaded

    def __len__(self) -> int:
        with self._lock:
            return len(self._partials)

    def _gone(self, part: Path, reason: str, why: str) -> None:
        log.warning("dropped the partial push in %s at start-up (%s): %s", part, reason, why)
        self._dropped.labels(reason).inc()

    def _restore(self, found: Loaded) -> None:
        """Keep a partial push an earlier process made durable, as if its stream had been cut just now."""
        r = found.record
        sink = FileSink(found.part)
        sink.adopt(found.fd, r.total_bytes)
        receiving = Receiving(chunks.Reassembler(self.max_update_bytes, sink), r.wire_bytes, r.messages)
        receiving.assembler.restore((r.count, r.total_bytes), (r.chunks, r.held_bytes), found.hash_state)
        receiving.waiting = True  # cut while it waited for its next chunk, as a partial push of this process is
        partial = Partial(r.run_id, r.organization, r.round, r.digest, found.part, receiving, sink, attached=False,
                          durable=(r.chunks, r.held_bytes), synced_from=r.held_bytes)
        receiving.owner = partial
        self._watch(partial)
        partial.detached.set()
        with self._lock:
            self._partials[(r.run_id, r.organization)] = partial
        log.info("kept the partial push of %s for run %s round %d from before the restart: %d chunks (%d bytes)",
                 r.organization, r.run_id, r.round, r.chunks, r.held_bytes)

    def close(self) -> None:
        """Finish the fsyncs under way (blocking)."""
        self._syncer.close()

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

    def durable(self, run_id: str, organization: str) -> tuple[int, int]:
        """(chunks, bytes) of the organization's push that its record names durable; (0, 0) when none."""
        with self._lock:
            partial = self._partials.get((run_id, organization))
        return partial.durable if partial is not None else (0, 0)

    async def progress(self, organization: str, run_id: str, round_: int, digest: bytes, total_bytes: int,
                       wait: float) -> tuple[int, int]:
        """(chunks, bytes) held of the push of ``digest``, once no stream feeds it and what it holds is durable;
        (0, 0) when none is held."""
        self.sweep()
        if not digest:
            return 0, 0
        partial = await self._settled((run_id, organization), wait)
        if partial is None or not self._same(partial, round_, digest, total_bytes):
            return 0, 0
        return partial.held

    def finish(self, receiving: Receiving, accepted: bool) -> None:
        """A stream of a push ended: accepted (the file goes, its map stays), cut while it waited for a chunk
        (kept, when resumable, once it is durable), or refused (dropped)."""
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
            if partial.durable[1] == partial.held[1]:
                self._detach(partial)
            else:  # offered for resumption once durable
                self._sync(partial).add_done_callback(lambda _: self._detach(partial))
        else:
            self._drop(partial, "refused")
            self._release_waiters(partial)

    def _detach(self, partial: Partial) -> None:
        partial.attached = False
        partial.touched = time.monotonic()
        partial.detached.set()
        log.info("push of %s for run %s round %d cut after %d chunks (%d bytes; %d chunks durable): kept for "
                 "resumption", partial.organization, partial.run_id, partial.round, *partial.held, partial.durable[0])
        self.sweep()

    def _watch(self, partial: Partial) -> None:
        """Make ``partial`` durable as it grows: each ``sync_bytes`` received into its file."""
        def after_chunk() -> None:
            if partial.sink is not None and not partial.receiving.assembler.complete and not partial.gone \
                    and partial.held[1] - partial.synced_from >= self.sync_bytes:
                self._sync(partial)
        partial.receiving.after_chunk = after_chunk

    def _sync(self, partial: Partial) -> asyncio.Future[bool]:
        """Fsync what ``partial`` received into its file so far and write its record, in the spool's thread."""
        assert partial.sink is not None
        partial.synced_from = partial.held[1]
        return self._syncer.submit(partial, partial.record(), partial.sink.dup())

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
        path = self.directory / run_id / spool_record.part_name(organization, round_, tag)
        sink = FileSink(path) if total_bytes >= self.memory_below else None
        receiving = Receiving(chunks.Reassembler(self.max_update_bytes, sink))
        partial = Partial(run_id, organization, round_, digest, path, receiving, sink)
        receiving.owner = partial
        if digest:  # only a push named by its digest is resumed, so only such a push is made durable
            self._watch(partial)
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
            partial.sink.close()
            with partial.lock:
                partial.gone = True
                spool_record.remove(partial.path)

    def _drop(self, partial: Partial, reason: str) -> None:
        if self._forget(partial, idle_only=reason in ("expired", "round_closed", "over_size")):
            self._remove(partial)
            if partial.held[0] and reason != "refused":
                log.info("dropped the partial push of %s for run %s round %d (%s, %d bytes)",
                         partial.organization, partial.run_id, partial.round, reason, partial.held[1])
            self._dropped.labels(reason).inc()
