"""Tests for hetfed.wire.transport: every channel is a connection of its own, as each organization is."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from hetfed.wire.transport import make_channel, make_server


async def _peer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
    return context.peer().encode()


@pytest.fixture
def echo_peer() -> Iterator[str]:
    """The address of a server (the aggregator's make_server) that answers each call with the caller's peer."""
    ready, stop, box = threading.Event(), threading.Event(), []

    async def serve() -> None:
        server, port = make_server("127.0.0.1:0", None, stream_window_bytes=256 << 10)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.Echo", {"Peer": grpc.unary_unary_rpc_method_handler(_peer)}),))
        await server.start()
        box.append(port)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"127.0.0.1:{box[0]}"
    stop.set()
    thread.join(10)


def test_each_channel_is_its_own_connection(echo_peer: str) -> None:
    # gRPC would otherwise put every channel of a process with the same target on one TCP connection: a
    # process running many organizations (benchmarks, tests) would measure one connection, not many.
    channels = [make_channel(echo_peer, None) for _ in range(3)]
    try:
        peers = [ch.unary_unary("/t.Echo/Peer")(b"", timeout=10) for ch in channels]
        again = channels[0].unary_unary("/t.Echo/Peer")(b"", timeout=10)
    finally:
        for ch in channels:
            ch.close()
    assert len(set(peers)) == 3
    assert again == peers[0]  # one channel keeps its connection
