"""What keeping a push on disk costs a client (``hetfed.client.pending``): the update and the private state after
the round written and fsynced before the push leaves, and, after a restart, the kept push read back (the record
loaded, the update mapped and planned in chunks: its digest).

    python benchmarks/kept_push_cost.py [--sizes-mb 4,64,256] [--repeat 5] [--dir DIR]

The private state is as large as the update (a model every organization sends whole). Figures are wall
milliseconds, the median of ``--repeat`` runs after one warm-up, on the file system of ``--dir`` (default: a
temporary directory); the page cache is not dropped, so a read back after a real restart may take longer.

Then, for the largest size, the memory of the update's path alone (no private state): the growth of this
process's peak RSS (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) while the push is kept, and while
it is read back and every chunk's message is built as a stream sends it, with the anonymous memory (``RssAnon``:
not the mapped file's pages, which the kernel can drop) held at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfed.client.pending import PendingPushFile, RoundKey
from hetfed.wire.payloads import ModelWeights
from hetfed.wire.rpc import AggregatorClient, OutgoingPush

KEY = RoundKey(round=1, action="TRAIN", round_seed=1, after=0)


def wall_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="4,64,256", help="update sizes in MB (comma-separated)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, help="where to keep the pushes (default: a temporary directory)")
    args = ap.parse_args(argv)
    print(f"{'update':>8} {'keep (write+fsync)':>19} {'MB/s':>6} {'read back':>10}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kept-push-") as tmp:
        store = PendingPushFile(tmp, "r", {"run": "r"})
        client = AggregatorClient("127.0.0.1:1", None, "a", "r")  # never connects: it plans the chunks only
        for mb in [float(x) for x in args.sizes_mb.split(",") if x]:
            n = int(mb * 1e6) // 4
            weights = np.random.default_rng(0).standard_normal(n).astype(np.float32)
            outgoing = client.prepare_push(1, [ModelWeights({"w": weights}, 1)])
            state: dict[str, Any] = {"model": {"w": torch.from_numpy(weights)}}

            def keep(outgoing: OutgoingPush = outgoing, state: dict[str, Any] = state) -> None:
                store.save(KEY, outgoing.data, outgoing.digest, state, [], {})

            def read_back() -> None:
                kept = store.take(KEY)
                assert kept is not None
                assert client.reopen_push(1, kept.data).digest == kept.digest

            keep_ms = wall_ms(keep, args.repeat)
            read_ms = wall_ms(read_back, args.repeat)
            print(f"{mb:>6g}MB {keep_ms:>16.1f} ms {2 * mb / keep_ms * 1e3:>6.0f} {read_ms:>7.1f} ms", flush=True)
            store.remove()
        print(memory(store, client, outgoing, mb))
        client.close()
    return 0


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def memory(store: PendingPushFile, client: AggregatorClient, outgoing: OutgoingPush, mb: float) -> str:
    """The update's path alone: peak RSS growth keeping it, and reading it back and framing every chunk."""
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    store.save(KEY, outgoing.data, outgoing.digest, {}, [], {})
    kept_peak = status_kb("VmHWM") - base
    Path("/proc/self/clear_refs").write_text("5")
    base, anon = status_kb("VmRSS"), status_kb("RssAnon")
    kept = store.take(KEY)
    assert kept is not None
    again = client.reopen_push(1, kept.data)
    sent = sum(len(m) for m in again.requests)
    read_peak, anon_held = status_kb("VmHWM") - base, status_kb("RssAnon") - anon
    assert sent >= again.size
    store.remove()
    return (f"{mb:g} MB update alone: keeping it raised peak RSS by {kept_peak / 1024:.1f} MB; reading it back and "
            f"framing every chunk by {read_peak / 1024:.1f} MB (the mapped file's pages), "
            f"{anon_held / 1024:.1f} MB of it anonymous at the end")


if __name__ == "__main__":
    raise SystemExit(main())
