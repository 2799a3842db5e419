"""A push waiting for a reassembly slot sends only its first chunk: the aggregator answers the call's headers
when it admits the push (it says so at Join), and the typed client sends its other chunks after them. So a
waiting push holds its first chunk in the aggregator, not a stream window of its chunks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import AggregatorClient
from tests.conftest import RawClient, load_benchmark, run_config, wait_until

linkrelay = load_benchmark("linkrelay")
W = np.arange(2_000_000, dtype=np.float32) / 2_000_000  # an update of about 8 MB: far less than the 16 MiB window
MIB = 1 << 20


@pytest.fixture
def joined(aggregator: Callable[..., RunningAggregator],
           raw_client: Callable[..., RawClient]) -> Callable[..., RunningAggregator]:
    def start(**server: Any) -> RunningAggregator:
        agg = aggregator(run_config(), **server)
        for org in ("a", "b"):
            raw_client(agg.port, org).join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
        return agg
    return start


def _holding_push(port: int, release: threading.Event) -> None:
    """Organization a's push of 40 chunks that sends two, then nothing until ``release``: it holds the slot."""
    def requests() -> Iterator[apb.PushUpdateRequest]:
        for i in range(2):
            yield apb.PushUpdateRequest(run_id="r", round=1, organization_id="a", chunk=apb.Chunk(
                index=i, count=40, total_bytes=40 * MIB, data=b"\x01" * MIB))
        release.wait(60)

    client = RawClient(port, "a")
    try:
        client.stub.PushUpdate(requests(), metadata=client.metadata, timeout=60)
    except grpc.RpcError:
        pass  # ended early: refused, its slot given back
    finally:
        client.close()


def test_a_push_waiting_for_a_slot_sends_only_its_first_chunk_until_admitted(
        joined: Callable[..., RunningAggregator]) -> None:
    agg = joined(max_concurrent_reassemblies=1, push_idle_seconds=30)
    release = threading.Event()
    holder = threading.Thread(target=_holding_push, args=(agg.port, release), daemon=True)
    holder.start()
    wait_until(agg.service.pushes.slots.locked, timeout=10, what="organization a's push to hold the slot")
    relay = linkrelay.LinkRelay(("127.0.0.1", agg.port))
    port = relay.start()
    try:
        with AggregatorClient(f"127.0.0.1:{port}", None, "b", "r") as client, ThreadPoolExecutor(1) as pool:
            assert client.join([DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", W)]).push_admission_headers
            before = relay.bytes_up
            pushed = pool.submit(client.push, 1, [ModelWeights({"w": W}, 1), EvalMetrics(num_test_examples=1)])
            wait_until(lambda: relay.bytes_up - before >= chunks.FIRST_PUSH_CHUNK_BYTES, timeout=10,
                       what="the first chunk")
            # Sent at once, the update would be through the relay within milliseconds: watch for a second.
            time.sleep(1.0)
            waiting = relay.bytes_up - before
            assert not pushed.done() and agg.service.pushes.slots.locked()
            release.set()
            reply = pushed.result(30)
    finally:
        release.set()
        relay.stop()
        holder.join(30)
    # The first chunk, the call's headers and its window updates' acknowledgements: no second chunk.
    assert chunks.FIRST_PUSH_CHUNK_BYTES <= waiting < chunks.FIRST_PUSH_CHUNK_BYTES + 16 * 1024, waiting
    assert reply.accepted
    assert relay.bytes_up - before > W.nbytes


class _Keeping(grpc.StreamUnaryClientInterceptor):
    """Reads every message of a client stream before the call starts, as a recording interceptor does."""

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(details, iter(list(request_iterator)))


def test_a_push_whose_messages_an_interceptor_reads_first_is_sent_whole(
        joined: Callable[..., RunningAggregator]) -> None:
    # The messages are then read in the caller's thread before the call exists: waiting there for its headers
    # would never end.
    agg = joined()
    client = AggregatorClient(f"127.0.0.1:{agg.port}", None, "b", "r")
    assert client.join([DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", W)]).push_admission_headers
    client._bind(grpc.intercept_channel(client._channel, _Keeping()))
    replies: list[Any] = []
    pushing = threading.Thread(target=lambda: replies.append(
        client.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(num_test_examples=1)])), daemon=True)
    pushing.start()
    pushing.join(30)  # a push that waits for headers of a call not yet made never ends: the thread is left
    assert replies and replies[0].accepted
    client.close()
