"""What each stage of SecAgg+ costs in process (``hetfed.secagg``): client and server CPU, and the bytes each
client sends and receives, at n organizations and d parameters.

    python benchmarks/secagg_core.py --clients 4 8 16 --params 1000000
    python benchmarks/secagg_core.py --clients 32 --params 10000000 --dropouts 1

Every cell runs one round over the complete graph (k = n - 1, the default) with the default threshold
floor(k/2) + 1 and 16-bit values in a 32-bit ring; ``--dropouts`` clients leave after sharing their keys, so
the server also rebuilds their mask keys and removes their pairwise masks. CPU is this thread's
(``time.thread_time``), so waiting for a core on a busy machine is not counted. "client" is the median over the
clients of one stage; "server" is the whole stage (every receive and the close). Bytes are the messages'
payload (keys, ciphertexts, shares, vectors, names), without Protobuf or gRPC framing; "receives" is the
server's message that opens the stage. The PRG line times
``prg.expand`` alone. The randomness is seeded (``SeededEntropy``): the cost is the same as os.urandom's.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from hetfed.secagg import (
    ClientSession,
    Encoding,
    Field,
    RoundConfig,
    SeededEntropy,
    ServerSession,
    default_degree,
    default_threshold,
    prg,
)

T = TypeVar("T")
STAGES = ("advertise", "share_keys", "mask", "unmask")


def payload_bytes(value: object) -> int:
    """The bytes a message's fields carry: bytes, strings, arrays, 8 per integer."""
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, int):
        return 8
    if isinstance(value, (tuple, list)):
        return sum(payload_bytes(v) for v in value)
    if dataclasses.is_dataclass(value):
        return sum(payload_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    raise TypeError(type(value))


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.thread_time()
    out = fn()
    return out, time.thread_time() - start


class Cell:
    """One round of n clients and d parameters, stage by stage, with its CPU and bytes."""

    def __init__(self, n: int, d: int, dropouts: int) -> None:
        k = default_degree(n)
        enc = Encoding.for_inputs((Field("w", (d,), 1.0),), n, 16)
        self.config = RoundConfig("bench", 1, tuple(f"org-{i:02d}" for i in range(n)), k, default_threshold(k),
                                  hashlib.sha256(b"bench").digest(), enc)
        self.server = ServerSession(self.config)
        self.clients: dict[str, ClientSession] = {}
        self.gone = set(self.config.roster[:dropouts])
        self.values = {"w": np.random.default_rng(0).uniform(-1, 1, d)}
        self.client_cpu: dict[str, list[float]] = {s: [] for s in STAGES}
        self.server_cpu: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.sent: dict[str, list[int]] = {s: [] for s in STAGES}
        self.received: dict[str, list[int]] = {s: [] for s in STAGES}

    def _client(self, stage: str, u: str, fn: Callable[[], T]) -> T:
        out, cpu = timed(fn)
        self.client_cpu[stage].append(cpu)
        self.sent[stage].append(payload_bytes(out))
        return out

    def _start(self, u: str) -> ClientSession:
        self.clients[u] = ClientSession(self.config, u, SeededEntropy(u))
        return self.clients[u]

    def _server(self, stage: str, fn: Callable[[], T]) -> T:
        out, cpu = timed(fn)
        self.server_cpu[stage] += cpu
        return out

    def run(self) -> None:
        s, c = self.server, self.clients
        for u in self.config.roster:
            # the session makes its key pairs when it starts: counted in this stage
            advert = self._client("advertise", u, lambda u=u: self._start(u).advertise())
            self._server("advertise", lambda a=advert: s.receive_advert(a))
        peer_keys = self._server("advertise", s.close_advertising)
        for u, msg in peer_keys.items():
            self.received["share_keys"].append(payload_bytes(msg))
            shared = self._client("share_keys", u, lambda u=u, m=msg: c[u].share_keys(m))
            self._server("share_keys", lambda m=shared: s.receive_shared_keys(m))
        peer_shares = self._server("share_keys", s.close_sharing)
        rng = np.random.default_rng(1)
        for u, msg in peer_shares.items():
            self.received["mask"].append(payload_bytes(msg))
            if u in self.gone:
                continue
            masked = self._client("mask", u, lambda u=u, m=msg: c[u].mask(m, self.values, rng))
            self._server("mask", lambda m=masked: s.receive_masked(m))
            del masked
        requests = self._server("mask", s.close_masking)
        for u, msg in requests.items():
            self.received["unmask"].append(payload_bytes(msg))
            reply = self._client("unmask", u, lambda u=u, m=msg: c[u].unmask(m))
            self._server("unmask", lambda m=reply: s.receive_unmask(m))
        self._server("unmask", s.finish)

    def rows(self) -> list[str]:
        out = []
        for stage in STAGES:
            med = statistics.median(self.client_cpu[stage]) * 1e3
            up = statistics.median(self.sent[stage])
            down = statistics.median(self.received[stage]) if self.received[stage] else 0
            out.append(f"| {stage} | {med:,.1f} | {self.server_cpu[stage] * 1e3:,.1f} | {up:,.0f} | {down:,.0f} |")
        return out


def prg_rate(d: int) -> float:
    """MB/s of ``prg.expand`` into 32-bit elements, median of 5."""
    seed = bytes(32)
    prg.expand(seed, d, 32)
    times = [timed(lambda: prg.expand(seed, d, 32))[1] for _ in range(5)]
    return 4 * d / statistics.median(times) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--params", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--dropouts", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"PRG (AES-256-CTR into uint32): {prg_rate(max(args.params)):,.0f} MB/s of thread CPU")
    for d in args.params:
        for n in args.clients:
            cell = Cell(n, d, args.dropouts)
            wall = time.perf_counter()
            cell.run()
            wall = time.perf_counter() - wall
            print(f"\nn = {n}, d = {d:,}, k = {cell.config.degree}, t = {cell.config.threshold}, "
                  f"{args.dropouts} dropped after sharing; {wall:.1f} s wall for the round")
            print("| stage | client CPU ms (median) | server CPU ms | client sends (bytes) | client receives (bytes) |")
            print("|---|---:|---:|---:|---:|")
            print("\n".join(cell.rows()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
