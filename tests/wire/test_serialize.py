"""Tests for hetfed.wire.serialize and the encoders that use it: protobuf's own bytes for every payload kind, each
tensor copied once, fields past protobuf's 2 GiB, and a push that frames one chunk message at a time."""

from __future__ import annotations

import inspect
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, codec, framing, messages, serialize
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import (
    EvalMetrics,
    FactorizedLayer,
    FactorizedWeights,
    ModelWeights,
    Payload,
    PayloadKind,
)
from hetfed.wire.phases import Action, Phase
from hetfed.wire.rpc import AggregatorClient
from hetfed.wire.specs import get_spec
from tests.conftest import run_config
from tests.wire.test_codec import PAYLOADS, assert_same

WIRE_DTYPES = [None, "float16", "bfloat16"]


def protobuf_update(payloads: list[Payload], wire_dtype: str | None, leave: str = "") -> bytes:
    """What encode_update produced before the serializer: the message filled in place, then protobuf's bytes."""
    msg = apb.Update(envelope=apb.Envelope(run_id="run", round=7, organization_id="org-é"), leave_reason=leave)
    for p in payloads:
        codec.fill_payload(msg.payloads.add(), p, wire_dtype)
        msg.envelope.payload_kinds.append(p.kind.proto_enum)  # type: ignore[arg-type]
    return msg.SerializeToString()


def protobuf_instructions(ins: messages.Instructions, wire_dtype: str | None) -> bytes:
    msg = apb.Instructions(envelope=apb.Envelope(run_id=ins.run_id, round=ins.round, organization_id=ins.organization),
                           action=apb.ACTION_TRAIN, round_seed=ins.round_seed, total_rounds=ins.total_rounds)
    for p in ins.payloads:
        codec.fill_payload(msg.payloads.add(), p, wire_dtype)
        msg.envelope.payload_kinds.append(p.kind.proto_enum)  # type: ignore[arg-type]
    return msg.SerializeToString()


@pytest.mark.parametrize("kind", list(PayloadKind), ids=lambda k: k.value)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_serializer_writes_protobufs_bytes_for_every_payload_kind(kind: PayloadKind, data: st.DataObject) -> None:
    payloads = [data.draw(PAYLOADS[kind]) for _ in range(data.draw(st.integers(1, 2)))]
    wire_dtype = data.draw(st.sampled_from(WIRE_DTYPES))
    encoded = messages.encode_update(messages.Update("run", 7, "org-é", payloads), wire_dtype)
    assert isinstance(encoded.data, memoryview) and encoded.data.readonly
    assert bytes(encoded.data) == protobuf_update(payloads, wire_dtype)
    ins = messages.Instructions("run", 3, Action.TRAIN, 9, round_seed=2**40 + 3, organization="o", payloads=payloads)
    assert bytes(messages.encode_instructions(ins, wire_dtype).data) == protobuf_instructions(ins, wire_dtype)


@pytest.mark.parametrize("wire_dtype", WIRE_DTYPES)
def test_awkward_arrays_serialize_as_protobuf_does(wire_dtype: str | None) -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 5))
    tensors: dict[str, np.ndarray] = {
        "float64": x,  # travels as float32 (or narrower)
        "fortran": np.asfortranarray(x.astype(np.float32)),
        "strided": x.astype(np.float32)[::2, 1::2],
        "big-endian": x.astype(">f4"),
        "big-endian-int": np.arange(7, dtype=">i8"),
        "scalar": np.array(np.float32(-0.0)),
        "empty": np.zeros((3, 0), np.float32),
        "empty-0": np.zeros((0,), np.int32),
        "bool": np.array([True, False, True]),
        "nan-inf": np.array([np.nan, np.inf, -np.inf, 7e38, -7e38, 65520.0]),  # overflows float16 and bfloat16
        "uint8": np.arange(200, dtype=np.uint8),
    }
    layer = FactorizedLayer("f", x[:2, :3], x[:3, :2], np.array([1, 4, 5]), np.array([0.5, -1.0, 2.0]), (2, 3))
    payloads: list[Payload] = [ModelWeights(tensors, 12), FactorizedWeights((layer,), 3),
                               EvalMetrics(0.25, 9, 0.5, 1.5, 4, {"b": 2.0, "a": 1.0}, ("test_loss",))]
    encoded = messages.encode_update(messages.Update("run", 7, "org-é", payloads), wire_dtype)
    assert bytes(encoded.data) == protobuf_update(payloads, wire_dtype)
    if wire_dtype is None:
        got = codec.payload_from_proto(apb.Update.FromString(bytes(encoded.data)).payloads[0])
        with np.errstate(over="ignore"):
            sent = {k: np.asarray(v, dtype=np.float32 if v.dtype == np.float64 else None) for k, v in tensors.items()}
        assert_same(ModelWeights(sent, 12), got)
    # A leave notice (no payloads) too.
    notice = messages.encode_update(messages.Update("run", 7, "org-é", [], leave_reason="diverged"))
    assert bytes(notice.data) == protobuf_update([], None, "diverged")


def test_a_placeholder_that_is_not_one_is_refused() -> None:
    msg = apb.Update()
    msg.payloads.add().model_weights.tensors.add(name="w").tensor.data = b"12345"
    with pytest.raises(ValueError, match="not a placeholder"):
        serialize.serialize(msg, [])


def test_encoding_an_update_copies_each_tensor_once() -> None:
    w = np.random.default_rng(1).random((2048, 1024), dtype=np.float32)  # 8 MiB
    update = messages.Update("run", 1, "org", [ModelWeights({"w": w, "b": w[0]}, 5)])
    messages.encode_update(update)  # warm up: imports, descriptors
    tracemalloc.start()
    try:
        encoded = messages.encode_update(update)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(encoded.data) > w.nbytes + w[0].nbytes
    # The message's buffer and small change: no bytes copy of a tensor, no second copy of the message.
    assert len(encoded.data) <= peak < len(encoded.data) + (256 << 10)


# ---------------------------------------------------------------- past protobuf's 2 GiB

BIG = (1 << 31) + 5  # bytes of one uint8 tensor: past the limit of one bytes field and of one sub-message


def zero_backed(pieces: list[serialize.Piece], size: int) -> np.ndarray:
    """The serialized message with every source's bytes left as zero pages: memory only for the small pieces."""
    out = np.zeros(size, np.uint8)  # calloc: pages that are never written take no memory
    pos = 0
    for piece in pieces:
        n = [BIG][piece] if isinstance(piece, int) else len(piece)
        if not isinstance(piece, int):
            out[pos:pos + n] = np.frombuffer(piece, np.uint8)
        pos += n
    assert pos == size
    return out


def test_a_tensor_and_a_payload_past_2_gib_are_laid_out_and_decoded_as_views() -> None:
    msg = apb.Update(envelope=apb.Envelope(run_id="run", round=1, organization_id="org"))
    msg.envelope.payload_kinds.extend([PayloadKind.MODEL_WEIGHTS.proto_enum,  # type: ignore[list-item]
                                       PayloadKind.EVAL_METRICS.proto_enum])  # type: ignore[list-item]
    sources: list[serialize.Placed] = []
    huge = np.broadcast_to(np.uint8(0), (BIG,))  # no memory behind it: only its size is laid out
    codec.fill_payload_placed(msg.payloads.add(), ModelWeights({"huge": huge}, 3), sources)
    codec.fill_payload_placed(msg.payloads.add(), EvalMetrics(0.5, 3), sources)
    assert [s.nbytes for s in sources] == [BIG]
    pieces, size = serialize.layout(msg.SerializeToString(), apb.Update.DESCRIPTOR, [BIG])
    # Lengths worked out by hand: Tensor = dtype (2) + shape (1 + 1 + 5) + data (1 + 5 + BIG); NamedTensor = name
    # (1 + 1 + 4) + tensor (1 + 5 + Tensor); ModelWeights = tensors (1 + 5 + NamedTensor) + num_examples (2).
    tensor = 2 + 7 + 6 + BIG
    named = 6 + 6 + tensor
    weights = 6 + named + 2
    payload_tag = framing.tag(apb.Update.DESCRIPTOR.fields_by_name["payloads"].number, framing.WIRE_LEN)
    metrics = msg.payloads[1].SerializeToString()
    assert [p for p in pieces if isinstance(p, bytes)] == [
        payload_tag + framing.write_varint(6 + weights), b"\x0a" + framing.write_varint(weights),
        b"\x0a" + framing.write_varint(named), b"\x12" + framing.write_varint(tensor),
        b"\x1a" + framing.write_varint(BIG), payload_tag + framing.write_varint(len(metrics))]
    assert size == len(msg.SerializeToString()) - framing.INDEX_BYTES + BIG + 5 * 4  # 5 lengths grew by 4 bytes
    data = zero_backed(pieces, size)
    update = messages.ParsedUpdate(data.data.toreadonly())
    assert update.payload_traffic.kinds["model_weights"].bytes == 6 + 6 + weights  # its field in the Update
    got = update.check(get_spec("fedavg"), Phase.TRAIN, {}, 1 << 40, "run", 1, "org")
    arr = got.get(ModelWeights).tensors["huge"]
    assert arr.shape == (BIG,) and arr.dtype == np.uint8 and not arr.flags.writeable
    assert np.shares_memory(arr, data)  # a view of the received bytes, not a copy
    assert got.get(EvalMetrics) == EvalMetrics(0.5, 3)


@pytest.mark.slow
def test_a_2_gib_model_crosses_encode_chunks_reassembly_and_decode() -> None:
    """About 4.5 GB: the encoded update and the reassembled one (the source array is a broadcast view)."""
    n = (1 << 29) + 1024  # float32: 2 GiB + 4 KiB in one tensor
    source = np.broadcast_to(np.float32(1.5), (n,))
    edge = np.arange(6, dtype=np.float32)
    update = messages.Update("run", 1, "org", [ModelWeights({"big": source, "edge": edge}, 1), EvalMetrics(0.5, 1)])
    encoded = messages.encode_update(update)
    assert encoded.payloads.kinds["model_weights"].bytes > 4 * n
    asm = chunks.Reassembler(1 << 40)
    for raw in chunks.framed(b"", chunks.PUSH_CHUNK_FIELD, encoded.data, 64 << 20):
        msg = apb.PushUpdateRequest.FromString(raw)
        asm.add(msg.chunk)
    del encoded
    parsed = messages.ParsedUpdate(asm.take())
    got = parsed.check(get_spec("fedavg"), Phase.TRAIN, {}, 1 << 40, "run", 1, "org").get(ModelWeights)
    assert got.tensors["big"].shape == (n,) and bool((got.tensors["big"] == 1.5).all())
    assert got.tensors["edge"].tolist() == edge.tolist()


# ---------------------------------------------------------------- a push frames one message at a time


def test_framing_builds_one_message_when_asked() -> None:
    data = np.random.default_rng(2).integers(0, 256, 16 << 20, dtype=np.uint8)
    tracemalloc.start()
    try:
        framed = chunks.framed(b"envelope", chunks.PUSH_CHUNK_FIELD, data.data, 1 << 20, 1000)
        built = tracemalloc.get_traced_memory()[1]
        sizes = [len(m) for m in framed]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(framed) == 17 and framed.total_bytes == sum(sizes)
    assert built < 64 << 10  # headers only
    assert peak < 2 * (1 << 20) + (64 << 10)  # the message being built and the one before it, at most


def test_a_push_holds_at_most_two_framed_messages(aggregator: Callable[..., Any], monkeypatch: Any) -> None:
    agg = aggregator(run_config(organizations=["a"], rounds=1))
    source = inspect.getsource(chunks.Framed.__getitem__).splitlines()
    first = inspect.getsourcelines(chunks.Framed.__getitem__)[1]
    join_line = first + next(i for i, line in enumerate(source) if 'b"".join(' in line)
    framed_messages = tracemalloc.Filter(True, chunks.__file__, lineno=join_line)  # allocated there, still alive
    original = chunks.Framed.__getitem__
    alive_before_each: list[int] = []
    built: list[int] = []

    def counted(self: chunks.Framed, i: Any) -> Any:
        if not tracemalloc.is_tracing():  # the aggregator's pulls, before the push
            return original(self, i)
        snapshot = tracemalloc.take_snapshot().filter_traces([framed_messages])
        alive_before_each.append(sum(t.size for t in snapshot.traces))
        raw = original(self, i)
        built.append(len(raw))
        return raw

    monkeypatch.setattr(chunks.Framed, "__getitem__", counted)
    w = np.random.default_rng(3).random(1 << 20, dtype=np.float32)  # 4 MiB: 16 KiB, then 4 messages of 1 MiB
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        client.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w)])
        assert client.pull(-1, 5.0, None).action is Action.TRAIN
        tracemalloc.start()
        try:
            reply = client.push(1, [ModelWeights({"w": w}, 4), EvalMetrics(0.5, 4)])
        finally:
            tracemalloc.stop()
    assert reply.accepted and not reply.duplicate
    assert len(built) == 5 and sum(built) > w.nbytes
    # When a message is built, at most one earlier one (the one gRPC is sending) is still alive (and the
    # aggregator's cached round-1 instructions, a message of a few dozen bytes).
    assert alive_before_each[0] < 200
    assert max(alive_before_each) < max(built) + 200
