"""What a link carries for hetfed against TCP alone: one push and one pull through a LinkRelay, per round trip
and bandwidth, with the aggregator's stream window.

    python benchmarks/window_throughput.py
    python benchmarks/window_throughput.py --rtt-ms 20,100 --mbit 0,100,1000 --windows 0,65536,33554432 --mb 64

For each round-trip time, bandwidth cap and window, three transfers of ``--mb`` MiB cross the same
``LinkRelay`` (benchmarks/linkrelay.py), each after a 1 MiB warm-up on its connection:

- **raw TCP**: a plain socket sender to a plain socket sink: the link's floor;
- **push**: one client stream of 1 MiB messages into a server built by the aggregator's ``make_server`` (its
  options, the window under test), sent through ``make_channel``;
- **pull**: one server stream of 1 MiB messages from that server, read through ``make_channel`` (its own
  window: the product's default).

Each figure is the best of ``--repeats`` (the machine is shared), and the push and pull are printed as a
fraction of the raw floor measured just before them. ``held`` is what one push that the server does not read
gets into the server before flow control stops it (the relay's count of bytes it delivered): the bound on what
the aggregator buffers for a push waiting for admission. Window 0 is gRPC's adaptive windows (BDP probing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from linkrelay import LinkRelay

from hetfed.aggregator.config import ServerConfig
from hetfed.wire.transport import make_channel, make_server

MESSAGE = 1 << 20
PUSH, PULL, HOLD = "/hetfed.bench.Sink/Push", "/hetfed.bench.Sink/Pull", "/hetfed.bench.Sink/Hold"


def raw_tcp(rtt_ms: float, mbit: float, nbytes: int) -> float:
    """MB/s of ``nbytes`` sent over one plain TCP connection through a relay, until the sink's reply."""
    listener = socket.create_server(("127.0.0.1", 0))

    def sink() -> None:
        conn, _ = listener.accept()
        with conn:
            got = 0
            while got < nbytes and (data := conn.recv(1 << 20)):
                got += len(data)
            conn.sendall(got.to_bytes(8, "little"))

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    relay = LinkRelay(listener.getsockname()[:2], rtt_ms, mbit)
    port = relay.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            block = b"\x5a" * MESSAGE
            start = time.perf_counter()
            for offset in range(0, nbytes, MESSAGE):
                s.sendall(block[:min(MESSAGE, nbytes - offset)])
            got = int.from_bytes(s.recv(8), "little")
            seconds = time.perf_counter() - start
    finally:
        relay.stop()
        listener.close()
        thread.join(10)
    assert got == nbytes, got
    return nbytes / seconds / 1e6


class Sink:
    """A gRPC server built by ``make_server`` with the window under test: Push sinks a client stream, Pull sends
    N MiB, Hold reads one message and then nothing until ``release`` (a push waiting for admission)."""

    def __init__(self, window: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.released = threading.Event()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(window), self.loop).result(10)

    async def _start(self, window: int) -> int:
        async def push(requests: Any, context: Any) -> bytes:
            n = 0
            async for m in requests:
                n += len(m)
            return n.to_bytes(8, "little")

        async def pull(request: bytes, context: Any) -> Any:
            payload = b"\x5a" * MESSAGE
            for _ in range(int.from_bytes(request, "little")):
                yield payload

        async def hold(requests: Any, context: Any) -> bytes:
            await requests.__anext__()
            while not self.released.is_set():
                await asyncio.sleep(0.01)
            return b""

        self.server, port = make_server("127.0.0.1:0", None, window)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("hetfed.bench.Sink", {
            "Push": grpc.stream_unary_rpc_method_handler(push), "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "Hold": grpc.stream_unary_rpc_method_handler(hold)})])
        await self.server.start()
        return port

    def close(self) -> None:
        self.released.set()
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _messages(n: int) -> Iterator[bytes]:
    payload = b"\x5a" * MESSAGE
    for _ in range(n):
        yield payload


def grpc_rates(window: int, rtt_ms: float, mbit: float, megabytes: int) -> tuple[float, float]:
    """MB/s of one push and of one pull of ``megabytes`` MiB through a relay (after 1 MiB warm-ups)."""
    sink = Sink(window)
    relay = LinkRelay(("127.0.0.1", sink.port), rtt_ms, mbit)
    port = relay.start()
    try:
        with make_channel(f"127.0.0.1:{port}", None) as channel:
            push, pull = channel.stream_unary(PUSH), channel.unary_stream(PULL)
            push(_messages(1), timeout=120)
            start = time.perf_counter()
            pushed = int.from_bytes(push(_messages(megabytes), timeout=600), "little")
            push_s = time.perf_counter() - start
            sum(len(m) for m in pull((1).to_bytes(8, "little"), timeout=120))
            start = time.perf_counter()
            pulled = sum(len(m) for m in pull(megabytes.to_bytes(8, "little"), timeout=600))
            pull_s = time.perf_counter() - start
    finally:
        relay.stop()
        sink.close()
    assert pushed == pulled == megabytes * MESSAGE, (pushed, pulled)
    return megabytes * MESSAGE / push_s / 1e6, megabytes * MESSAGE / pull_s / 1e6


def held_bytes(window: int, megabytes: int = 96, settle_s: float = 1.0) -> int:
    """Bytes one push of ``megabytes`` MiB gets into a server that reads only its first message: the relay's
    count once it has stopped growing for ``settle_s``."""
    sink = Sink(window)
    relay = LinkRelay(("127.0.0.1", sink.port))
    port = relay.start()
    try:
        with make_channel(f"127.0.0.1:{port}", None) as channel:
            future = channel.stream_unary(HOLD).future(_messages(megabytes), timeout=120)
            last, deadline = -1, time.monotonic() + 60
            while relay.bytes_up != last and time.monotonic() < deadline:
                last = relay.bytes_up
                time.sleep(settle_s)
            held = relay.bytes_up
            sink.released.set()
            future.result(60)
    finally:
        relay.stop()
        sink.close()
    return held


def main(argv: list[str] | None = None) -> int:
    """One row per round trip, bandwidth and window."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default=str(ServerConfig().stream_window_bytes),
                    help="server.stream_window_bytes values (0: adaptive); default: the product's")
    ap.add_argument("--rtt-ms", default="0,20,100", help="round-trip times the relay adds")
    ap.add_argument("--mbit", default="0,100,1000", help="bandwidth caps of the relay, Mbit/s (0: none)")
    ap.add_argument("--mb", type=int, default=64, help="MiB moved per transfer")
    ap.add_argument("--repeats", type=int, default=2, help="transfers per figure; the best is printed")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/window_throughput.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    windows = [int(x) for x in args.windows.split(",")]
    held = {w: held_bytes(w) for w in windows}
    for w in windows:
        print(f"window {w >> 10} KiB: a push the server does not read holds {held[w] / 2**20:.1f} MiB there")
    print(f"{'RTT ms':>6} {'Mbit/s':>6} {'window':>10} {'raw MB/s':>9} {'push MB/s':>9} {'pull MB/s':>9} "
          f"{'push/raw':>8} {'pull/raw':>8}", flush=True)
    rows = []
    for rtt in (float(x) for x in args.rtt_ms.split(",")):
        for mbit in (float(x) for x in args.mbit.split(",")):
            for window in windows:
                raw = max(raw_tcp(rtt, mbit, args.mb * MESSAGE) for _ in range(args.repeats))
                rates = [grpc_rates(window, rtt, mbit, args.mb) for _ in range(args.repeats)]
                push, pull = max(r[0] for r in rates), max(r[1] for r in rates)
                rows.append({"rtt_ms": rtt, "mbit": mbit, "window_bytes": window, "raw_mb_per_s": raw,
                             "push_mb_per_s": push, "pull_mb_per_s": pull, "held_bytes": held[window]})
                label = "adaptive" if window == 0 else f"{window >> 10} KiB"
                print(f"{rtt:6.0f} {mbit or '-':>6} {label:>10} {raw:9.1f} {push:9.1f} {pull:9.1f} "
                      f"{push / raw:8.2f} {pull / raw:8.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"megabytes": args.mb, "repeats": args.repeats, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
