"""What gRPC itself costs the aggregator per push, before hetfed touches a byte: CPU and per-connection memory.

    python benchmarks/grpc_floor.py
    python benchmarks/grpc_floor.py --chunks 1048576,262144,65536 --connections 32 --pushes 40

A server built by the aggregator's own ``make_server`` (its options, the default stream window, its allocator
settings) runs in a child process with one client-streaming method that reads every message and drops it. A second process
sends 4 MiB pushes through ``make_channel`` channels (one TCP connection each), cut into messages of each
``--chunks`` size, and the server reports:

- **CPU per push**: the server process's CPU seconds over ``--pushes`` sequential pushes on one connection,
  divided by their number: gRPC's receive path (socket reads, HTTP/2 framing, flow control, the copy into
  Python bytes), with no hashing, parsing or copying of hetfed's;
- **memory per connection**: the server's RSS growth after one push on each of ``--connections``
  connections in turn, which then stay open and idle, divided by their number: what gRPC keeps per
  connection between pushes (its read buffer grows to the largest read and is kept, unless capped:
  ``make_server`` caps it at 64 KiB whatever the window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from hetfed.aggregator.config import ServerConfig
from hetfed.cli import allocator
from hetfed.wire.transport import make_channel, make_server

PUSH_BYTES = 4 << 20
METHOD = "/bench.Sink/Push"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def serve(window: int) -> None:
    """The server process: prints its port, then answers commands on stdin ("cpu", "rss", "quit")."""
    allocator.tune(arenas=allocator.AGGREGATOR_ARENAS)  # as ``hetfed aggregator`` does
    ready = threading.Event()
    port_box: list[int] = []
    stop = threading.Event()

    async def sink(requests: Any, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        async for _ in requests:
            pass
        return b""

    async def main() -> None:
        server, port = make_server("127.0.0.1:0", None, stream_window_bytes=window)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)}),))
        await server.start()
        port_box.append(port)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    ready.wait()
    print(port_box[0], flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "cpu":
            print(time.process_time(), flush=True)
        elif cmd == "rss":
            print(_rss_mb(), flush=True)
        elif cmd == "quit":
            break
    stop.set()
    thread.join(10)


class Server:
    """A handle on the server process."""

    def __init__(self, window: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(window)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.address = f"127.0.0.1:{int(self.proc.stdout.readline())}"

    def ask(self, cmd: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def messages(chunk: int) -> list[bytes]:
    """One 4 MiB push as messages of ``chunk`` bytes (random bytes, the same for every push)."""
    data = os.urandom(PUSH_BYTES)
    return [data[i:i + chunk] for i in range(0, PUSH_BYTES, chunk)]


def measure(chunk: int, connections: int, pushes: int, window: int) -> dict[str, Any]:
    """CPU per push on one connection, then RSS kept per connection after one push on each of many."""
    msgs = messages(chunk)
    server = Server(window)
    try:
        with make_channel(server.address, None) as channel:
            push = channel.stream_unary(METHOD)
            push(iter(msgs), timeout=60)  # warm: connection, buffers
            cpu0 = server.ask("cpu")
            t0 = time.perf_counter()
            for _ in range(pushes):
                push(iter(msgs), timeout=60)
            wall = time.perf_counter() - t0
            cpu = server.ask("cpu") - cpu0
        time.sleep(0.5)
        rss0 = server.ask("rss")
        channels = [make_channel(server.address, None) for _ in range(connections)]
        try:
            for ch in channels:  # one at a time, as admission control lets a few pushes in at once
                ch.stream_unary(METHOD)(iter(msgs), timeout=120)
            time.sleep(1.0)
            rss = server.ask("rss") - rss0
        finally:
            for ch in channels:
                ch.close()
    finally:
        server.close()
    return {"chunk_bytes": chunk, "messages_per_push": len(msgs), "server_cpu_ms_per_push": cpu / pushes * 1e3,
            "push_mb_per_s": pushes * PUSH_BYTES / wall / 1e6, "connections": connections,
            "server_rss_mb_kept": rss, "kept_mb_per_connection": rss / connections}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="1048576,262144,65536", help="message sizes of a push, bytes")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--pushes", type=int, default=40)
    ap.add_argument("--window", type=int, default=ServerConfig().stream_window_bytes,
                    help="stream_window_bytes of the server (default: the product's)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    print(f"$ python benchmarks/grpc_floor.py --chunks {args.chunks} --connections {args.connections} "
          f"--pushes {args.pushes} --window {args.window}")
    print(f"{'chunk':>9} {'msgs':>5} {'server CPU/push':>16} {'MB/s':>7} {'kept, N conns':>14} {'kept/conn':>10}")
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        r = measure(chunk, args.connections, args.pushes, args.window)
        rows.append(r)
        print(f"{chunk >> 10:>6} KiB {r['messages_per_push']:>5} {r['server_cpu_ms_per_push']:>13.2f} ms "
              f"{r['push_mb_per_s']:>7.0f} {r['server_rss_mb_kept']:>11.1f} MB {r['kept_mb_per_connection']:>7.2f} MB",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"cpus": os.cpu_count(), "grpcio": grpc.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
