"""The gRPC boundary: rejections carry their reason as a rich status, clients retry by reason, typed payload
access."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.wire import chunks, messages
from hetfed.wire.errors import REASONS, WireError, clip
from hetfed.wire.payloads import ClassCounts, EvalMetrics, ModelWeights, Received, SeedPosteriors
from hetfed.wire.rpc import AggregatorClient, RemoteError
from tests.conftest import RawClient, run_config


def test_every_rejection_reason_has_one_status_and_a_retry_decision() -> None:
    for reason, r in REASONS.items():
        assert hasattr(grpc.StatusCode, r.status), reason
        assert WireError(reason, "x").retryable == r.retryable
    assert {k for k, r in REASONS.items() if r.retryable} == {
        "rate_limited", "checksum_mismatch", "too_many_streams", "buffer_full", "busy", "not_resumable", "stalled",
        "incomplete", "storage_unavailable", "internal"}
    with pytest.raises(ValueError, match="unknown rejection reason"):
        WireError("nope", "x")


def test_a_rejection_reaches_the_typed_client_with_its_reason(aggregator: Callable[..., Any]) -> None:
    agg = aggregator(run_config(organizations=["a", "b"]))
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "mallory", "r") as client, \
            pytest.raises(RemoteError) as err:
        client.join()
    e = err.value
    assert (e.code, e.reason, e.retryable) == (grpc.StatusCode.PERMISSION_DENIED, "unknown_organization", False)
    assert e.details.startswith("unknown_organization: organization 'mallory'")
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "nope") as client, \
            pytest.raises(RemoteError) as err:
        client.join()
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.NOT_FOUND, "unknown_run")


def test_join_says_when_a_declaration_is_needed_and_pull_waits_for_it(aggregator: Callable[..., Any],
                                                                      raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config())
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        reply = client.join()
        assert reply.algorithm == "fedavg" and reply.declare_required
        with pytest.raises(RemoteError) as err:
            client.pull(-1, 0.1, None)
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "not_declared")
        from hetfed.wire.contract import DeclaredTensor
        from hetfed.wire.payloads import PayloadKind

        w = np.zeros(3, np.float32)
        again = client.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w)])
        assert not again.declare_required
        ins = client.pull(-1, 5.0, None)
        assert ins.round == 1 and ins.action.value == "train"


def test_a_transport_failure_without_reason_is_retryable() -> None:
    with AggregatorClient("127.0.0.1:1", None, "a", "r", call_timeout=2) as client, \
            pytest.raises(RemoteError) as err:
        client.status()
    assert err.value.reason == "" and err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.retryable


def test_received_gives_typed_access_and_refuses_duplicates() -> None:
    counts = ClassCounts(np.array([1, 2]))
    got = Received([counts, EvalMetrics()])
    assert got.get(ClassCounts) is counts and got.maybe(ModelWeights) is None
    assert got.all(SeedPosteriors) == () and len(got) == 2
    with pytest.raises(WireError, match="no model_weights payload") as err:
        got.get(ModelWeights)
    assert err.value.reason == "missing_payload"
    with pytest.raises(WireError, match="two eval_metrics payloads"):
        Received([EvalMetrics(), EvalMetrics()])
    sp = SeedPosteriors("s", np.arange(2), np.full((2, 2), 0.5, np.float32), 1.0)
    from hetfed.wire.payloads import PayloadKind

    relayed = Received([sp, sp], repeated=frozenset({PayloadKind.SEED_POSTERIORS}))
    assert relayed.all(SeedPosteriors) == (sp, sp)


def test_messages_round_trip_through_protobuf() -> None:
    from hetfed.wire.contract import DeclaredTensor
    from hetfed.wire.payloads import PayloadKind

    req = messages.JoinRequest("r", "a", (DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", np.zeros((2, 3), np.float32),
                                                          "bfloat16"),), messages.Fingerprint("s", "ab" * 32), 7,
                               10, (1, 28, 28))
    assert messages.join_request_from_proto(messages.join_request_to_proto(req)) == req
    old = messages.join_request_from_proto(messages.join_request_to_proto(messages.JoinRequest("r", "a")))
    assert (old.num_classes, old.input_shape) == (0, ())  # an older client declares neither
    reply = messages.JoinReply("r", "fedavg", "{}", 3, 10, 5, ("a", "b"), True)
    assert messages.join_reply_from_proto(messages.join_reply_to_proto(reply)) == reply
    pull = messages.PullRequest("r", "a", 4, 2.5)
    assert messages.pull_request_from_proto(messages.pull_request_to_proto(pull)) == pull
    bad = messages.pull_request_to_proto(messages.PullRequest("r", "a", 4, float("nan")))
    with pytest.raises(WireError, match="wait_seconds must be a finite number"):
        messages.pull_request_from_proto(bad)


def test_clip_bounds_what_is_echoed() -> None:
    assert clip("short") == "short"
    long = clip("x" * 10_000)
    assert len(long) <= 520 and long.endswith("chars)")


def test_concurrent_pulls_of_one_message_share_one_build_that_lives_as_long_as_the_message() -> None:
    import asyncio
    import gc
    import threading

    from hetfed.v1 import aggregator_pb2 as apb
    from hetfed.wire.rpc import _ChunkCache

    cache = _ChunkCache()
    builds: list[int] = []
    release = threading.Event()

    async def blocking(fn: Callable[[], Any]) -> Any:
        builds.append(1)
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 5.0)
        return fn()

    async def main() -> None:
        encoded = messages.Encoded(bytes(range(256)) * 40)  # 10,240 bytes: 3 chunks of 4,096
        waiters = [asyncio.ensure_future(cache.responses(encoded, 4096, blocking)) for _ in range(32)]
        await asyncio.sleep(0)
        waiters[0].cancel()  # a pull that goes away does not cancel the build the others wait on
        release.set()
        results = await asyncio.gather(*waiters[1:])
        assert builds == [1] and len(cache) == 1
        assert all(r is results[0] for r in results)
        responses = list(results[0])
        assert responses == list(chunks.framed(b"", chunks.PULL_CHUNK_FIELD, encoded.data, 4096))
        parsed = [apb.PullInstructionsResponse.FromString(r).chunk for r in responses]
        assert [c.index for c in parsed] == [0, 1, 2] and b"".join(c.data for c in parsed) == encoded.data
        assert results[0].total_bytes == sum(len(r) for r in responses) and len(results[0]) == 3
        assert await cache.responses(encoded, 4096, blocking) is results[0] and builds == [1]
        del encoded, waiters, results
        gc.collect()
        assert len(cache) == 0  # the engine dropped the message: its chunks go with it

        async def failing(fn: Callable[[], Any]) -> Any:
            raise OSError("no worker")

        other = messages.Encoded(b"x")
        with pytest.raises(OSError, match="no worker"):
            await cache.responses(other, 4096, failing)
        assert len(cache) == 0  # a failed build is not kept: the next pull builds again
        assert (await cache.responses(other, 4096, blocking)).total_bytes > 0

    asyncio.run(main())
