"""What ``server.stream_window_bytes`` costs a push on a long link: upload throughput against round-trip time.

    python benchmarks/window_throughput.py
    python benchmarks/window_throughput.py --rtt-ms 0,20,100 --windows 262144,1048576,0 --mb 32

A gRPC server built by the aggregator's own ``make_server`` (the same options, the window under test) sinks
one client-streaming call of ``--mb`` MB in 1 MiB messages, sent through ``make_channel``'s channel, through a
relay on loopback that holds every byte for half the round-trip time in each direction (propagation delay,
no bandwidth limit). It prints the measured MB/s next to the flow-control bound window / RTT. Window 0 is
gRPC's adaptive windows (BDP probing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from hetfed.wire.transport import make_channel, make_server

METHOD = "/hetfed.bench.Sink/Push"
MESSAGE = 1 << 20


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each piece ``delay`` seconds after it arrived, in order."""
    queue: deque[tuple[float, bytes]] = deque()
    arrived = asyncio.Event()
    done = False

    async def read() -> None:
        nonlocal done
        while data := await reader.read(1 << 16):
            queue.append((time.monotonic() + delay, data))
            arrived.set()
        done = True
        arrived.set()

    task = asyncio.ensure_future(read())
    try:
        while True:
            while not queue:
                if done:
                    return
                arrived.clear()
                await arrived.wait()
            due, data = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        task.cancel()
        writer.close()


class Relay:
    """A loopback TCP relay adding ``rtt / 2`` of delay in each direction."""

    def __init__(self, target_port: int, rtt: float) -> None:
        self.target_port, self.rtt = target_port, rtt
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.port = 0

        async def start() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        ready.wait(10)

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection("127.0.0.1", self.target_port)
        for s in (w, tw):
            s.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(asyncio.CancelledError):  # close() cancels the pipes: not an error to print
            await asyncio.gather(_pipe(r, tw, self.rtt / 2), _pipe(tr, w, self.rtt / 2))

    def close(self) -> None:
        """Stop relaying (the loop's thread is a daemon: connections end with the process)."""
        self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(self.loop)])


class Sink:
    """A gRPC server with the aggregator's options and window, sinking client streams."""

    def __init__(self, window: int) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.port = 0

        async def push(requests: Any, context: Any) -> bytes:
            n = 0
            async for m in requests:
                n += len(m)
            return n.to_bytes(8, "little")

        async def start() -> None:
            self.server, self.port = make_server("127.0.0.1:0", None, window)
            self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "hetfed.bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})])
            await self.server.start()
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        ready.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)


def measure(window: int, rtt: float, megabytes: int) -> dict[str, Any]:
    """Seconds and MB/s of one ``megabytes`` upload (after a 1 MB warm-up call on the same channel)."""
    sink = Sink(window)
    relay = Relay(sink.port, rtt)
    payload = b"\x5a" * MESSAGE
    try:
        with make_channel(f"127.0.0.1:{relay.port}", None) as channel:
            call = channel.stream_unary(METHOD)

            def messages(n: int) -> Iterator[bytes]:
                for _ in range(n):
                    yield payload

            call(messages(1), timeout=120)
            start = time.perf_counter()
            got = int.from_bytes(call(messages(megabytes), timeout=600), "little")
            seconds = time.perf_counter() - start
    finally:
        relay.close()
        sink.close()
    assert got == megabytes * MESSAGE, got
    mb = megabytes * MESSAGE / 1e6
    return {"window_bytes": window, "rtt_ms": rtt * 1e3, "megabytes": mb, "seconds": seconds,
            "mb_per_s": mb / seconds, "bound_mb_per_s": (window / rtt / 1e6) if window and rtt else None}


def main(argv: list[str] | None = None) -> int:
    """Every window at every round-trip time, one row each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="262144,1048576,4194304,0", help="stream_window_bytes values; 0: adaptive")
    ap.add_argument("--rtt-ms", default="0,20,100", help="round-trip times the relay adds")
    ap.add_argument("--mb", type=int, default=32, help="MiB uploaded per measurement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/window_throughput.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{'window':>10} {'RTT ms':>7} {'seconds':>8} {'MB/s':>8} {'bound MB/s':>11}", flush=True)
    rows = []
    for rtt in [float(x) / 1e3 for x in args.rtt_ms.split(",")]:
        for window in [int(x) for x in args.windows.split(",")]:
            r = measure(window, rtt, args.mb)
            rows.append(r)
            bound = f"{r['bound_mb_per_s']:.1f}" if r["bound_mb_per_s"] else "-"
            label = "adaptive" if window == 0 else f"{window >> 10} KiB"
            print(f"{label:>10} {r['rtt_ms']:7.0f} {r['seconds']:8.2f} {r['mb_per_s']:8.1f} {bound:>11}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
