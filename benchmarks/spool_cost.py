"""What receiving a push into a spool file costs against receiving it in memory: CPU per push, the chunks
reassembled, the update read back once (its digest) and the file removed.

    python benchmarks/spool_cost.py [--sizes-mb 4,64] [--repeat 20]
    python benchmarks/spool_cost.py --durable [--sizes-mb 64,256,1024] [--repeat 3] [--dir DIR]

Every figure is CPU time of this thread (``time.thread_time``), the median of ``--repeat`` runs after one
warm-up. It sets ``hetfed.aggregator.serving.spool.MEMORY_BELOW_BYTES``: the aggregator receives smaller pushes
in memory.

``--durable`` measures what makes a partial push survive a restart, in files under ``--dir`` (the disk the
state directory would be on): a push received into its file and cut before its last chunk, without fsyncs and
with the spool's (each ``SYNC_BYTES`` and at the cut, each followed by its record), wall and CPU time; and a
restart's load of such a partial push (its record read, the file cut to its durable prefix and hashed again,
its pages dropped from the page cache first, so it is read from the disk), wall and CPU time and the memory
it allocates at its peak (``tracemalloc``). The fsyncs are timed inline here; the aggregator runs them in a
thread of their own while the push goes on.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from digest_cost import cpu_ms

from hetfed.aggregator.serving import spool_record
from hetfed.aggregator.serving.spool import SYNC_BYTES, FileSink
from hetfed.aggregator.serving.spool_record import Record
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks
from hetfed.wire import digest as content


def receive(parts: list[apb.Chunk], sink: FileSink | None) -> None:
    """One push received into ``sink`` (memory when None), read back once, its file removed."""
    asm = chunks.Reassembler(1 << 40, sink)
    for part in parts:
        asm.add(part)
    content.digest(asm.take())
    if sink is not None:
        sink.remove()


def durable(parts: list[apb.Chunk], path: Path, sync_bytes: int | None) -> None:
    """One push received into its file and cut before its last chunk; with ``sync_bytes``, made durable as the
    spool makes it (an fsync and a record each ``sync_bytes`` received, and at the cut). The files stay."""
    sink = FileSink(path)
    asm = chunks.Reassembler(1 << 40, sink)
    synced = 0
    last = parts[-1]

    def sync() -> None:
        fd = sink.dup()
        try:
            spool_record.sync_data(fd)
        finally:
            os.close(fd)
        spool_record.write_record(path, Record("r", "a", 1, last.blake3, last.count, last.total_bytes, asm.next_index,
                                               asm.received, asm.prefix_digest()))

    for part in parts[:-1]:
        asm.add(part)
        if sync_bytes is not None and asm.received - synced >= sync_bytes:
            synced = asm.received
            sync()
    if sync_bytes is not None:
        sync()
    sink.close()


def timed(fn: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """Median (wall ms, thread CPU ms) of ``fn`` over ``repeat`` runs, ``before`` untimed ahead of each."""
    walls, cpus = [], []
    for _ in range(repeat):
        before()
        wall, cpu = time.perf_counter(), time.thread_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    return statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3


def dropped_from_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (they are written back first), so the next read is the disk's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main_durable(sizes: list[float], repeat: int, directory: str | None) -> None:
    """The fsyncs' cost on a push, and a restart's load of a partial push."""
    print(f"| push cut before its last chunk | no fsync, wall ms | spool's fsyncs (each {SYNC_BYTES >> 20} MiB and "
          "at the cut), wall ms | CPU ms, without / with | fsyncs |")
    print("|---|---|---|---|---|")
    loads = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for mb in sizes:
            data = os.urandom(int(mb * 1e6))
            parts = list(chunks.split(data, chunks.DEFAULT_CHUNK_BYTES, chunks.FIRST_PUSH_CHUNK_BYTES))
            path = Path(tmp) / spool_record.part_name("a", 1, content.digest(data)[:8].hex())
            del data

            def clean(path: Path = path) -> None:
                """The last run's file written back and deleted: each run starts with no dirty pages."""
                if path.exists():
                    dropped_from_cache(path)
                    spool_record.remove(path)

            plain = timed(functools.partial(durable, parts, path, None), repeat, clean)
            synced = timed(functools.partial(durable, parts, path, SYNC_BYTES), repeat, clean)
            fsyncs = 1 + sum(1 for i in range(1, len(parts)) if i * chunks.DEFAULT_CHUNK_BYTES // SYNC_BYTES
                             > (i - 1) * chunks.DEFAULT_CHUNK_BYTES // SYNC_BYTES)
            print(f"| {mb:g} MB | {plain[0]:.0f} | {synced[0]:.0f} | {plain[1]:.0f} / {synced[1]:.0f} | {fsyncs} |",
                  flush=True)
            record = spool_record.read_record(path)
            del parts

            def load(path: Path = path) -> None:
                os.close(spool_record.load(path, "r", 1 << 40, lambda *_: True).fd)

            wall, cpu = timed(load, repeat, functools.partial(dropped_from_cache, path))
            tracemalloc.start()
            load()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            loads.append((mb, record.held_bytes, wall, cpu, peak))
    print()
    print("| partial push loaded at start-up (read from the disk) | held | wall ms | CPU ms | memory allocated at the "
          "peak (tracemalloc) |")
    print("|---|---|---|---|---|")
    for mb, held, wall, cpu, peak in loads:
        print(f"| {mb:g} MB | {held / 1e6:.0f} MB | {wall:.0f} | {cpu:.0f} | {peak / (1 << 20):.1f} MiB |")


def main(argv: list[str] | None = None) -> int:
    """Time each size in memory and in a file, and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="4,64")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--durable", action="store_true", help="the fsyncs' cost and a restart's load instead")
    ap.add_argument("--dir", default=None, help="where --durable writes its files (default: the temporary folder)")
    args = ap.parse_args(argv)
    if args.durable:
        print(f"$ python benchmarks/spool_cost.py --durable --sizes-mb {args.sizes_mb} --repeat {args.repeat}")
        main_durable([float(s) for s in args.sizes_mb.split(",")], args.repeat, args.dir)
        return 0
    print(f"$ python benchmarks/spool_cost.py --sizes-mb {args.sizes_mb} --repeat {args.repeat}")
    print("| update | memory, CPU ms | spool file, CPU ms |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "push.part"
        for mb in (float(s) for s in args.sizes_mb.split(",")):
            data = os.urandom(int(mb * 1e6))
            parts = list(chunks.split(data, chunks.DEFAULT_CHUNK_BYTES, chunks.FIRST_PUSH_CHUNK_BYTES))
            memory = cpu_ms(functools.partial(receive, parts, None), args.repeat)
            spooled = cpu_ms(lambda: receive(parts, FileSink(path)), args.repeat)  # noqa: B023 (called at once)
            print(f"| {mb:g} MB | {memory:.2f} | {spooled:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
