"""Tests for hetfed.wire.transport: every channel is a connection of its own, as each organization is; the
server's bounded windows and reads still carry messages far larger than either; a push the server does not
read for many keepalive periods keeps its connection."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from hetfed.wire.transport import (
    KEEPALIVE_MS,
    READ_CAP_BYTES,
    make_channel,
    make_server,
    ping_policy_options,
    stream_window_options,
)


async def _peer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
    return context.peer().encode()


async def _digest(requests: object, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
    h = hashlib.sha256()
    async for message in requests:  # type: ignore[attr-defined]
        h.update(message)
    return h.digest()


@contextlib.contextmanager
def served(service: str, handlers: dict[str, grpc.RpcMethodHandler], **options: int) -> Iterator[str]:
    """The address of ``make_server(**options)`` serving ``handlers`` as ``service``, run in a thread of its own
    until the block ends."""
    ready, stop, box = threading.Event(), threading.Event(), []

    async def serve() -> None:
        server, port = make_server("127.0.0.1:0", None, **options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        await server.start()
        box.append(port)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"127.0.0.1:{box[0]}"
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture(params=[256 << 10])
def echo_peer(request: pytest.FixtureRequest) -> Iterator[str]:
    """The address of a server (the aggregator's make_server) that answers each call with the caller's peer,
    and each client stream with the SHA-256 of its messages."""
    with served("t.Echo", {"Peer": grpc.unary_unary_rpc_method_handler(_peer),
                           "Digest": grpc.stream_unary_rpc_method_handler(_digest)},
                stream_window_bytes=request.param) as address:
        yield address


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


def test_every_connections_reads_are_capped_whatever_its_window() -> None:
    # Read by the EventEngine endpoint of grpcio 1.85; without it a connection keeps a read buffer as large as
    # its largest read (docs/benchmarks.md).
    adaptive = dict(stream_window_options(0))
    assert "grpc.http2.bdp_probe" not in adaptive  # gRPC's adaptive windows
    assert adaptive["grpc.experimental.tcp_max_read_buffer_size"] == READ_CAP_BYTES == 64 << 10
    options = dict(stream_window_options(32 << 20))
    assert options["grpc.http2.bdp_probe"] == 0
    assert options["grpc.http2.lookahead_bytes"] == 32 << 20
    assert options["grpc.experimental.tcp_max_read_buffer_size"] == 64 << 10


@pytest.mark.parametrize("echo_peer", [64 << 10, 0], indirect=True)
def test_messages_far_larger_than_the_window_and_the_read_cap_arrive_whole(echo_peer: str) -> None:
    data = os.urandom(4 << 20)
    messages = [data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)] + [data[:100]]
    with make_channel(echo_peer, None) as channel:
        digests = {channel.stream_unary("/t.Echo/Digest")(iter(messages), timeout=30) for _ in range(3)}
    assert digests == {hashlib.sha256(data + data[:100]).digest()}


# The clients' keepalive interval, shortened so that a test spans many of them.
SHORT_KEEPALIVE_MS = 300


@pytest.fixture
def holding_server() -> Iterator[tuple[str, threading.Event]]:
    """The address of a server (make_server, keepalive SHORT_KEEPALIVE_MS) whose Hold reads a client stream's
    first message, then nothing until the event is set, then the rest: a push waiting for admission."""
    release = threading.Event()

    async def hold(requests: object, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        it = requests.__aiter__()  # type: ignore[attr-defined]
        count = len(await it.__anext__())
        while not release.is_set():
            await asyncio.sleep(0.02)
        async for message in it:
            count += len(message)
        return count.to_bytes(8, "little")

    with served("t.Hold", {"Hold": grpc.stream_unary_rpc_method_handler(hold)},
                keepalive_ms=SHORT_KEEPALIVE_MS) as address:
        try:
            yield address, release
        finally:
            release.set()


def test_the_server_accepts_the_clients_keepalive_pings() -> None:
    # The channel argument gRPC reads (an unknown name is ignored, leaving its 5-minute minimum).
    assert ping_policy_options(KEEPALIVE_MS) == [("grpc.http2.min_ping_interval_without_data_ms", 20_000)]


def test_a_push_the_server_does_not_read_for_many_keepalive_periods_keeps_its_connection(
        holding_server: tuple[str, threading.Event]) -> None:
    # While the server reads nothing it sends nothing, and the client pings every keepalive period. With the
    # server's default minimum between pings (5 minutes) the third ping too soon closed the connection with
    # GOAWAY "too_many_pings" (UNAVAILABLE) after about four periods: the 3.2 GB x 8 clients benchmark's push.
    address, release = holding_server
    sizes = [1 << 20] * 4
    with make_channel(address, None, keepalive_ms=SHORT_KEEPALIVE_MS) as channel:
        future = channel.stream_unary("/t.Hold/Hold").future(iter(b"\x01" * n for n in sizes), timeout=60)
        held_s = 15 * SHORT_KEEPALIVE_MS / 1000
        deadline = time.monotonic() + held_s
        while time.monotonic() < deadline and not future.done():
            time.sleep(0.05)
        assert not future.done(), future.exception()
        release.set()
        assert int.from_bytes(future.result(30), "little") == sum(sizes)
