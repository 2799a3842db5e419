"""What the wire's digest costs: CPU per message for SHA-256 (the digest BLAKE3 replaced) and BLAKE3
(``hetfed.wire.digest``), and the chunked framing and reassembly that hash every byte once on each side.

    python benchmarks/digest_cost.py [--size-mb 4] [--repeat 30]

Every figure is CPU time of this thread (``time.thread_time``), the median of ``--repeat`` runs after one
warm-up: it does not count the time the thread waits for a core, so it holds on a busy machine where wall
time would not. A 4 MB message is a 1M-parameter float32 model, workload A's update and broadcast.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import time
from collections.abc import Callable

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks
from hetfed.wire import digest as content


def cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median thread CPU milliseconds of ``fn`` over ``repeat`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    """Time each digest and the framing around it, and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    data = os.urandom(int(args.size_mb * 1e6))
    envelope = apb.PushUpdateRequest(run_id="r", round=1, organization_id="org-0").SerializeToString()
    framed = chunks.framed(envelope, chunks.PUSH_CHUNK_FIELD, data, first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES)

    def reassemble() -> None:
        asm = chunks.Reassembler(len(data) + 1)
        for raw in framed:
            small, piece = chunks.unframed(raw, chunks.PUSH_CHUNK_FIELD)
            asm.add(apb.PushUpdateRequest.FromString(small).chunk, piece)
        asm.take()

    rows = [
        ("SHA-256 (hashlib), the digest before", cpu_ms(lambda: hashlib.sha256(data).digest(), args.repeat)),
        (f"{content.NAME} (hetfed.wire.digest)", cpu_ms(lambda: content.digest(data), args.repeat)),
        ("memory copy (bytearray), for scale", cpu_ms(lambda: bytearray(data), args.repeat)),
        ("chunks.framed: a push's messages", cpu_ms(lambda: chunks.framed(
            envelope, chunks.PUSH_CHUNK_FIELD, data, first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES), args.repeat)),
        ("unframed + Reassembler: the push read back", cpu_ms(reassemble, args.repeat)),
    ]
    print(f"$ python benchmarks/digest_cost.py --size-mb {args.size_mb:g} --repeat {args.repeat}")
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
          f"{len(data) / 1e6:.1f} MB message, {len(framed)} chunks")
    print(f"| what | CPU ms per {len(data) / 1e6:g} MB message | GB/s |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {len(data) / ms / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
