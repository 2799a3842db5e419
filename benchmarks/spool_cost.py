"""What receiving a push into a spool file costs against receiving it in memory: CPU per push, the chunks
reassembled, the update read back once (its digest) and the file removed.

    python benchmarks/spool_cost.py [--sizes-mb 4,64] [--repeat 20]

Every figure is CPU time of this thread (``time.thread_time``), the median of ``--repeat`` runs after one
warm-up. It sets ``hetfed.aggregator.serving.spool.MEMORY_BELOW_BYTES``: the aggregator receives smaller pushes
in memory.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from pathlib import Path

from digest_cost import cpu_ms

from hetfed.aggregator.serving.spool import FileSink
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


def main(argv: list[str] | None = None) -> int:
    """Time each size in memory and in a file, and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="4,64")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
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
