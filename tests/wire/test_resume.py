"""Pushes that resume: a push cut mid-stream continues from the chunks the aggregator holds in its spool.

A relay (a TCP forwarder in the test) cuts a real push after a share of its bytes; partial pushes made by a stream
that ends early test the refusals and the bounds without a relay.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.cli.certs import make_federation_certs
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, codec, messages
from hetfed.wire import digest as content
from hetfed.wire.config import ConfigError, to_mapping
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind
from hetfed.wire.rpc import SERVICE_NAME, AggregatorClient, RemoteError
from hetfed.wire.traffic import TrafficMetrics
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, TlsConfig, make_channel
from tests.conftest import RawClient, run_config, wait_until

Start = Callable[..., RunningAggregator]
N = 2_000_000  # float32 elements: an update of about 8 MB, 8 chunks of 1 MiB after its 16 KiB first chunk
W = np.arange(N, dtype=np.float32) / N


def payloads(scale: float = 1.0) -> list[Payload]:
    return [ModelWeights({"w": W * scale}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)]


def encoded(org: str, round_: int = 1, scale: float = 1.0) -> bytes:
    """The serialized Update the typed client sends for ``payloads(scale)``."""
    update = messages.Update("r", round_, org, payloads(scale), None, "")
    return bytes(messages.encode_update(update, None).data)


class Relay:
    """A TCP forwarder that counts the bytes it carries from the client, and cuts its first connection (both
    sides closed) once that has carried ``cut_after`` bytes; later connections pass."""

    def __init__(self, target: int, cut_after: int) -> None:
        self.target = target
        self.cut_after = cut_after
        self.carried: list[int] = []  # client-to-server bytes of each connection
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            index = len(self.carried)
            self.carried.append(0)
            limit = self.cut_after if index == 0 else None
            threading.Thread(target=self._pipe, args=(client, server, index, limit), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, None, None), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, index: int | None, limit: int | None) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if index is not None:
                    if limit is not None and self.carried[index] + len(data) >= limit:
                        data = data[: limit - self.carried[index]]
                        dst.sendall(data)
                        self.carried[index] += len(data)
                        break  # the cut: both sides of the connection closed
                    self.carried[index] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()


def retried(attempts: int = 5) -> Callable[[str, Callable[[], Any]], Any]:
    """A retry policy like the runtime's: a retryable RemoteError is tried again, at most ``attempts`` times."""
    def retry(what: str, call: Callable[[], Any]) -> Any:
        for attempt in range(attempts):
            try:
                return call()
            except RemoteError as err:
                if not err.retryable or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")
    return retry


def counted(registry: CollectorRegistry, side: str, org: str, direction: str) -> int:
    total = 0.0
    for metric in registry.collect():
        for s in metric.samples:
            if (s.name == f"hetfed_{side}_bytes_total" and s.labels["organization"] == org
                    and s.labels["direction"] == direction):
                total += s.value
    return int(total)


def dropped(agg: RunningAggregator, reason: str) -> float:
    value = agg.service.metrics.registry.get_sample_value("hetfed_partial_pushes_dropped_total", {"reason": reason})
    return value or 0.0


def logged(agg: RunningAggregator, round_: int = 1) -> list[tuple[str, bytes]]:
    return agg.service.runs["r"].journal.store.updates(round_)


@pytest.fixture
def joined(aggregator: Start, raw_client: Callable[..., RawClient]) -> Callable[..., RunningAggregator]:
    def start(**server: Any) -> RunningAggregator:
        run = server.pop("run", run_config())
        agg = aggregator(run, **server)
        for org in run["organizations"]:
            raw_client(agg.port, org).join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
        return agg
    return start


@pytest.mark.parametrize("received_in", ["memory", "file"])
@pytest.mark.parametrize("share", [0.5, 0.99])
def test_a_push_cut_by_the_link_resumes_from_the_chunks_the_aggregator_holds(
        joined: Callable[..., RunningAggregator], share: float, received_in: str) -> None:
    # What gRPC had received past the chunk in flight at the cut is sent again: up to about a stream window
    # (2.9 MB more at a 50 % cut with the 4 MiB default). A 64 KiB window keeps that under a chunk, so that the
    # bound below shows the resume itself sends only what the aggregator did not hold.
    agg = joined(stream_window_bytes=64 << 10)
    if received_in == "file":  # the path of pushes from MEMORY_BELOW_BYTES on
        agg.service.spool.memory_below = 0
    data = encoded("a")
    relay = Relay(agg.port, int(share * len(data)))
    joined_bytes = counted(agg.service.metrics.registry, "aggregator", "a", "up")  # its Join, by another client
    registry = CollectorRegistry()
    traffic = TrafficMetrics(registry, "client")
    try:
        with AggregatorClient(f"127.0.0.1:{relay.port}", None, "a", "r", traffic=traffic, retry=retried()) as client:
            reply = client.push(1, payloads())
    finally:
        relay.close()
    assert (reply.accepted, reply.duplicate) == (True, False)
    assert len(relay.carried) == 2  # the cut connection, and the one that resumed
    # Acknowledged once: one logged update, bit for bit what the client encoded; no duplicate.
    assert logged(agg) == [("a", data)]
    assert agg.service.metrics.registry.get_sample_value("hetfed_duplicate_pushes_total", {"run": "r"}) in (None, 0.0)
    # The resumed stream carried the rest: what the cut left, the chunk in flight at the cut again (with what
    # gRPC had read of the next), a new connection's handshakes and the PushProgress call: never the whole.
    cut, rest = relay.carried
    remainder = len(data) - cut
    assert remainder <= rest <= remainder + 2 * chunks.DEFAULT_CHUNK_BYTES < len(data)
    assert len(agg.service.spool) == 0 and not list((Path(agg.service.config.server.state_dir) / ".spool").rglob("*.part"))
    # Traffic: both sides count every chunk once, one digest field per stream that carried kept chunks, and the
    # PushProgress call: the same bytes.
    server = counted(agg.service.metrics.registry, "aggregator", "a", "up") - joined_bytes
    assert server == counted(registry, "client", "a", "up")
    framed = chunks.framed(b"", chunks.PUSH_CHUNK_FIELD, data, first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES)
    envelope = len(apb.PushUpdateRequest(run_id="r", round=1, organization_id="a").SerializeToString())
    assert server > sum(len(m) for m in framed) + envelope * len(framed)


# ------------------------------------------------------------------------------------------ partial pushes


def messages_of(org: str, data: bytes, round_: int = 1, digest: bytes | None = None) -> list[bytes]:
    """The push messages of ``data`` as the typed client frames them; each stream's first gets the digest."""
    envelope = apb.PushUpdateRequest(run_id="r", round=round_, organization_id=org).SerializeToString()
    return chunks.framed(envelope, chunks.PUSH_CHUNK_FIELD, data, first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES)


def named(message: bytes, digest: bytes) -> bytes:
    return message + apb.PushUpdateRequest(update_blake3=digest).SerializeToString()


def send(channel: grpc.Channel, stream: list[bytes], metadata: tuple[tuple[str, str], ...] = ()) -> grpc.RpcError | bytes:
    call = channel.stream_unary(f"/{SERVICE_NAME}/PushUpdate")
    try:
        return call(iter(stream), metadata=metadata, timeout=30)  # type: ignore[no-any-return]
    except grpc.RpcError as err:
        return err


def progress(channel: grpc.Channel, org: str, digest: bytes, total: int, round_: int = 1,
             metadata: tuple[tuple[str, str], ...] = ()) -> tuple[int, int]:
    call = channel.unary_unary(f"/{SERVICE_NAME}/PushProgress")
    req = apb.PushProgressRequest(run_id="r", round=round_, organization_id=org, update_blake3=digest,
                                  total_bytes=total)
    resp = apb.PushProgressResponse.FromString(call(req.SerializeToString(), metadata=metadata, timeout=30))
    return resp.chunks_held, resp.bytes_held


def leave_partial(channel: grpc.Channel, org: str, data: bytes, k: int, round_: int = 1,
                  metadata: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    """Send the first ``k`` chunks of a push of ``data`` and end the stream: the aggregator keeps them."""
    msgs = messages_of(org, data, round_)
    err = send(channel, [named(msgs[0], content.digest(data)), *msgs[1:k]], metadata)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.ABORTED
    assert err.details().startswith(f"incomplete: the stream ended after {k} of {len(msgs)} chunks")
    return msgs


def held_bytes(msgs: list[bytes], k: int) -> int:
    return chunks.FIRST_PUSH_CHUNK_BYTES + (k - 1) * chunks.DEFAULT_CHUNK_BYTES


@pytest.fixture
def channel(joined: Callable[..., RunningAggregator]) -> Iterator[Callable[..., tuple[RunningAggregator, grpc.Channel]]]:
    opened: list[grpc.Channel] = []

    def start(**server: Any) -> tuple[RunningAggregator, grpc.Channel]:
        agg = joined(**server)
        opened.append(grpc.insecure_channel(f"127.0.0.1:{agg.port}"))
        return agg, opened[-1]
    yield start
    for ch in opened:
        ch.close()


def md(org: str) -> tuple[tuple[str, str], ...]:
    return ((ORGANIZATION_METADATA_KEY, org),)


def test_another_digest_or_size_is_not_the_push_held_and_cannot_resume_it(
        channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    agg, ch = channel()
    data = encoded("a")
    msgs = leave_partial(ch, "a", data, 3, metadata=md("a"))
    digest = content.digest(data)
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
    other = encoded("a", scale=2.0)
    assert len(other) == len(data)
    assert progress(ch, "a", content.digest(other), len(data), metadata=md("a")) == (0, 0)
    assert progress(ch, "a", digest, len(data) + 1, metadata=md("a")) == (0, 0)
    assert progress(ch, "a", digest, len(data), round_=2, metadata=md("a")) == (0, 0)
    # Resuming the held push with another digest, or at another chunk, is refused; the partial stays.
    for first in (named(messages_of("a", other)[3], content.digest(other)), named(msgs[2], digest)):
        err = send(ch, [first], md("a"))
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details().startswith("not_resumable: a push resuming at chunk")
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
    # The rest, named by the digest, completes it: the update logged is bit for bit the whole.
    reply = send(ch, [named(msgs[3], digest), *msgs[4:]], md("a"))
    assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    assert logged(agg) == [("a", data)]
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (0, 0)
    # A push from chunk 0 of another update replaces a held one.
    leave_partial(ch, "b", data, 2, metadata=md("b"))
    leave_partial(ch, "b", other, 4, metadata=md("b"))
    assert progress(ch, "b", digest, len(data), metadata=md("b")) == (0, 0)
    assert progress(ch, "b", content.digest(other), len(other), metadata=md("b"))[0] == 4
    assert dropped(agg, "replaced") == 1


def test_a_partial_push_past_its_size_bound_is_dropped(
        channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    agg, ch = channel(max_partial_push_bytes=2 << 20)
    data = encoded("a")
    digest = content.digest(data)
    leave_partial(ch, "a", data, 3, metadata=md("a"))  # 2 MiB + 16 KiB: over the bound
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (0, 0)
    assert dropped(agg, "over_size") == 1
    msgs = leave_partial(ch, "a", data, 2, metadata=md("a"))  # 1 MiB + 16 KiB: kept
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (2, held_bytes(msgs, 2))
    # Another organization's partial push takes the bound over: the oldest is dropped first.
    leave_partial(ch, "b", encoded("b"), 2, metadata=md("b"))
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (0, 0)
    assert progress(ch, "b", content.digest(encoded("b")), len(data), metadata=md("b"))[0] == 2
    assert dropped(agg, "over_size") == 2


def test_a_partial_push_past_its_time_is_dropped(channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    agg, ch = channel(partial_push_seconds=0.5)
    data = encoded("a")
    leave_partial(ch, "a", data, 3, metadata=md("a"))
    assert len(agg.service.spool) == 1
    wait_until(lambda: dropped(agg, "expired") == 1, timeout=20, what="the partial push expired")
    assert progress(ch, "a", content.digest(data), len(data), metadata=md("a")) == (0, 0)
    assert not list((Path(agg.service.config.server.state_dir) / ".spool").rglob("*.part"))


def test_a_partial_push_of_a_closed_round_is_dropped(
        channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    agg, ch = channel(run=run_config(min_clients=1, round_deadline_seconds=1.0))
    data = encoded("a")
    leave_partial(ch, "a", data, 3, metadata=md("a"))
    b = messages_of("b", encoded("b"))
    reply = send(ch, b, md("b"))
    assert isinstance(reply, bytes)
    # The round's deadline closes it with b's update; a's partial push of it goes.
    wait_until(lambda: dropped(agg, "round_closed") == 1, timeout=20, what="round 1 closed")
    assert agg.service.runs["r"].round == 2
    assert len(agg.service.spool) == 0


def test_under_mtls_only_the_same_organization_resumes_its_push(aggregator: Start, tmp_path: Path) -> None:
    certs = make_federation_certs(tmp_path / "certs", ["a", "b"])
    agg = aggregator(run_config(), tls=to_mapping(certs.aggregator_tls()))
    address = f"127.0.0.1:{agg.port}"

    def tls(org: str) -> TlsConfig:
        return certs.client_tls(org)

    with make_channel(address, tls("a")) as a, make_channel(address, tls("b")) as b:
        for org, ch in (("a", a), ("b", b)):
            join = apb.JoinRequest(run_id="r", organization_id=org)
            join.declared_tensors.add(payload_kind=PayloadKind.MODEL_WEIGHTS.proto_enum, name="w",
                                      dtype=codec._WIRE[codec.wire_dtype_of(W)][0], shape=[N])
            ch.unary_unary(f"/{SERVICE_NAME}/Join")(join.SerializeToString(), timeout=10)
        data = encoded("a")
        digest = content.digest(data)
        msgs = leave_partial(a, "a", data, 3)
        # b asks for a's push by its digest: b holds none. b's certificate cannot claim to be a.
        assert progress(b, "b", digest, len(data)) == (0, 0)
        with pytest.raises(grpc.RpcError) as claim:
            progress(b, "a", digest, len(data))
        assert claim.value.details().startswith("identity_mismatch")
        # b resumes a's push with a's very messages (they name a): refused by identity; naming itself: refused.
        err = send(b, [named(msgs[3], digest), *msgs[4:]])
        assert isinstance(err, grpc.RpcError) and err.details().startswith("identity_mismatch")
        as_b = messages_of("b", data)
        err = send(b, [named(as_b[3], digest), *as_b[4:]])
        assert isinstance(err, grpc.RpcError) and err.details().startswith("not_resumable")
        # a itself resumes it.
        assert progress(a, "a", digest, len(data)) == (3, held_bytes(msgs, 3))
        reply = send(a, [named(msgs[3], digest), *msgs[4:]])
        assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    assert logged(agg) == [("a", data)]


def test_a_push_whose_client_cancels_mid_stream_is_kept_for_resumption(
        channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    agg, ch = channel()
    data = encoded("a")
    digest = content.digest(data)
    msgs = messages_of("a", data)
    release = threading.Event()

    def stream() -> Iterator[bytes]:
        yield named(msgs[0], digest)
        yield from msgs[1:3]
        release.wait(30)  # the client goes away here, mid-push

    call = ch.stream_unary(f"/{SERVICE_NAME}/PushUpdate").future(stream(), metadata=md("a"), timeout=30)
    wait_until(lambda: agg.service.spool.held("r", "a") == (3, held_bytes(msgs, 3)), timeout=20,
               what="three chunks received")
    call.cancel()
    release.set()
    assert progress(ch, "a", digest, len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
    reply = send(ch, [named(msgs[3], digest), *msgs[4:]], md("a"))
    assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    assert logged(agg) == [("a", data)]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("partial_push_seconds", 0, "partial_push_seconds must be a positive number"),
    ("partial_push_seconds", float("inf"), "partial_push_seconds must be a positive number"),
    ("max_partial_push_bytes", -1, "max_partial_push_bytes must be >= 0"),
])
def test_the_partial_push_bounds_are_validated(field: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        aggregator_config_from_mapping({"server": {field: value}, "runs": [run_config()]})


# ------------------------------------------------------------------------------------------ another process


def test_a_push_reopened_by_another_client_resumes_where_the_first_left_it(
        channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    """A client process killed mid-push, restarted: a new AggregatorClient reopens the kept bytes and resumes from
    the chunks held (``send_push(resume=True)``). Logged once, bit for bit; both sides count the same bytes."""
    agg, ch = channel()
    data = encoded("a")
    before = counted(agg.service.metrics.registry, "aggregator", "a", "up")
    leave_partial(ch, "a", data, 5, metadata=md("a"))
    registry = CollectorRegistry()
    sent: list[int] = []
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r", traffic=TrafficMetrics(registry, "client"),
                          retry=retried()) as client:
        outgoing = client.reopen_push(1, memoryview(data))
        assert outgoing.digest == content.digest(data) and outgoing.size == len(data) and len(outgoing) == 9
        reply = client.send_push(outgoing, resume=True, sending=lambda i, n: sent.append(i))
    assert (reply.accepted, reply.duplicate) == (True, False)
    assert sent == [5, 6, 7, 8]  # chunks 0 to 4 were not sent again
    assert logged(agg) == [("a", data)]
    # The first stream (5 chunks, the digest on its first) and the resumed one: the aggregator counts both, and
    # the new client counts them too, every chunk once and one digest field per stream.
    assert counted(agg.service.metrics.registry, "aggregator", "a", "up") - before == counted(registry, "client",
                                                                                             "a", "up")


def test_reopened_bytes_that_are_not_this_organizations_update_of_the_round_are_refused(
        channel: Callable[..., tuple[RunningAggregator, grpc.Channel]]) -> None:
    agg, _ = channel()
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        for data, reason in ((encoded("a", round_=2), "envelope_mismatch"), (encoded("b"), "envelope_mismatch"),
                             (b"\xff" * 100, "malformed")):
            with pytest.raises(WireError) as err:
                client.reopen_push(1, data)
            assert err.value.reason == reason
