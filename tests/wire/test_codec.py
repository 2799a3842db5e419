"""Tests for hetfed.wire.codec: exact Tensor bytes per dtype, bfloat16 rounding, malformed tensors, payload round trips."""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import codec
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    CriteriaEmbeddings,
    EvalMetrics,
    FactorizedLayer,
    FactorizedWeights,
    HeadWeights,
    ModelWeights,
    Payload,
    PayloadKind,
    PeerWeights,
    SecAggMaskedInput,
    SeedPosteriors,
    named_tensors,
)
from tests.wire.secagg_strategies import SECAGG_PAYLOADS

# wire name -> (enum, little-endian numpy dtype the bytes are read as)
EXPECTED_ENUMS = {
    "float32": (tpb.DTYPE_FLOAT32, "<f4"),
    "float16": (tpb.DTYPE_FLOAT16, "<f2"),
    "bfloat16": (tpb.DTYPE_BFLOAT16, "<u2"),
    "int64": (tpb.DTYPE_INT64, "<i8"),
    "int32": (tpb.DTYPE_INT32, "<i4"),
    "uint8": (tpb.DTYPE_UINT8, "u1"),
    "bool": (tpb.DTYPE_BOOL, "?"),
    "uint16": (tpb.DTYPE_UINT16, "<u2"),
    "uint32": (tpb.DTYPE_UINT32, "<u4"),
}

SAMPLES: dict[str, np.ndarray] = {
    "float32": np.array([[0.0, -0.0, 1.5, -2.25], [np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                                                    np.inf, -np.inf]], dtype=np.float32),
    "float16": np.array([0.0, 1.0, -65504.0, 6.1e-05, np.inf], dtype=np.float16),
    "int64": np.array([0, -1, 2**63 - 1, -(2**63), 123456789012], dtype=np.int64),
    "int32": np.array([[0, -1], [2**31 - 1, -(2**31)]], dtype=np.int32),
    "uint8": np.array([0, 1, 127, 128, 255], dtype=np.uint8),
    "bool": np.array([[True, False, True]], dtype=np.bool_),
    "uint16": np.array([0, 1, 255, 256, 65535], dtype=np.uint16),
    "uint32": np.array([[0, 65536], [2**31, 2**32 - 1]], dtype=np.uint32),
}


def bits_of(array: np.ndarray) -> np.ndarray:
    """float32 values as their uint32 bit patterns."""
    return np.asarray(array, dtype=np.float32).view(np.uint32)


def f32(bits: int) -> np.float32:
    """The float32 with bit pattern ``bits``."""
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


# ---------------------------------------------------------------- dtypes, byte order, shapes


def test_every_wire_dtype_is_known_with_its_enum() -> None:
    assert tuple(EXPECTED_ENUMS) == codec.WIRE_DTYPES
    for name, (enum, _) in EXPECTED_ENUMS.items():
        assert codec.dtype_name(enum) == name


@pytest.mark.parametrize("name", list(SAMPLES))
def test_dtype_round_trips_with_exact_little_endian_bytes(name: str) -> None:
    arr = SAMPLES[name]
    enum, raw = EXPECTED_ENUMS[name]
    t = codec.tensor_to_proto(arr)
    assert t.dtype == enum
    assert list(t.shape) == list(arr.shape)
    assert t.data == arr.astype(raw).tobytes()
    assert len(t.data) == arr.size * np.dtype(raw).itemsize
    back = codec.tensor_from_proto(tpb.Tensor.FromString(t.SerializeToString()))
    assert back.dtype == np.dtype(raw).newbyteorder("=")
    assert back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()  # bit-exact, -0.0 and inf included


def test_exact_bytes_for_known_values() -> None:
    assert codec.tensor_to_proto(np.array([1.0], np.float32)).data == b"\x00\x00\x80\x3f"
    assert codec.tensor_to_proto(np.array([1.0], np.float16)).data == b"\x00\x3c"
    assert codec.tensor_to_proto(np.array([1, -2], np.int64)).data == (
        b"\x01\x00\x00\x00\x00\x00\x00\x00" + b"\xfe\xff\xff\xff\xff\xff\xff\xff"
    )
    assert codec.tensor_to_proto(np.array([258], np.int32)).data == b"\x02\x01\x00\x00"
    assert codec.tensor_to_proto(np.array([True, False])).data == b"\x01\x00"


@pytest.mark.parametrize(("big", "name"), [(">f4", "float32"), (">f2", "float16"), (">i8", "int64"),
                                            (">i4", "int32"), (">f8", "float32")])
def test_big_endian_input_travels_little_endian(big: str, name: str) -> None:
    values = np.array([[1, -2, 3], [300, 0, -7]])
    arr = values.astype(big)
    assert arr.dtype.byteorder == ">"
    t = codec.tensor_to_proto(arr)
    assert codec.dtype_name(t.dtype) == name
    assert t.data == values.astype(EXPECTED_ENUMS[name][1]).tobytes()
    np.testing.assert_array_equal(codec.tensor_from_proto(t), values)


def test_float64_travels_as_float32_rounded() -> None:
    arr = np.array([0.1, 1 / 3, 1e300], dtype=np.float64)
    t = codec.tensor_to_proto(arr)
    assert t.dtype == tpb.DTYPE_FLOAT32
    with np.errstate(over="ignore"):
        assert t.data == arr.astype("<f4").tobytes()
    back = codec.tensor_from_proto(t)
    assert back.dtype == np.float32
    assert back[2] == np.inf


def test_non_contiguous_and_fortran_arrays_encode_in_c_order() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    for arr in (base[:, ::2], base.T, np.asfortranarray(base)):
        t = codec.tensor_to_proto(arr)
        assert t.data == np.ascontiguousarray(arr).astype("<i4").tobytes()
        np.testing.assert_array_equal(codec.tensor_from_proto(t), arr)


@pytest.mark.parametrize("name", list(SAMPLES))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 5), ()])
def test_zero_size_and_zero_dim_tensors(name: str, shape: tuple[int, ...]) -> None:
    raw = np.dtype(EXPECTED_ENUMS[name][1])
    arr = np.zeros(shape, dtype=raw) if shape != () else np.array(SAMPLES[name].flat[1], dtype=raw)
    t = codec.tensor_to_proto(arr)
    assert list(t.shape) == list(shape)
    assert len(t.data) == (1 if shape == () else 0) * raw.itemsize
    back = codec.tensor_from_proto(tpb.Tensor.FromString(t.SerializeToString()))
    assert back.shape == shape
    assert back.dtype == raw.newbyteorder("=")
    assert back.tobytes() == arr.tobytes()


def test_decoded_tensor_is_a_read_only_view() -> None:
    back = codec.tensor_from_proto(codec.tensor_to_proto(np.arange(4, dtype=np.float32)))
    assert not back.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        back[0] = 1.0


def test_explicit_narrowing_and_unsupported_dtypes() -> None:
    arr = np.array([1.0, 65520.0, 1e-8], dtype=np.float32)
    t = codec.tensor_to_proto(arr, "float16")
    assert t.dtype == tpb.DTYPE_FLOAT16
    with np.errstate(over="ignore"):
        assert t.data == arr.astype("<f2").tobytes()
    for bad in (np.array([1 + 2j]), np.array([1], np.int16), np.array([1], np.uint64), np.array(["a"])):
        with pytest.raises(WireError) as err:
            codec.tensor_to_proto(bad)
        assert err.value.reason == "unsupported_dtype"
    with pytest.raises(WireError) as err:
        codec.tensor_to_proto(arr, "float8")
    assert err.value.reason == "unsupported_dtype"


def test_a_tensor_beyond_protobufs_bytes_field_limit_is_refused_before_copying() -> None:
    assert codec.MAX_TENSOR_BYTES == 2**31 - 1
    huge = np.broadcast_to(np.float32(0), (1 << 29,))  # 2 GiB as float32, no memory behind the view
    with pytest.raises(WireError) as err:
        codec.tensor_to_proto(huge)
    assert err.value.reason == "oversized"
    assert "2147483648 bytes" in err.value.message
    with pytest.raises(WireError, match="oversized"):
        codec.payload_to_proto(ModelWeights({"huge": huge}))


def test_a_payload_beyond_protobufs_message_field_limit_is_refused_before_copying() -> None:
    assert codec.MAX_PAYLOAD_BYTES == 2**31 - 1
    gib = np.broadcast_to(np.float32(0), (1 << 28,))  # 1 GiB each as float32, no memory behind the views
    weights = ModelWeights({"a": gib, "b": gib, "c": gib})
    with pytest.raises(WireError) as err:
        codec.payload_to_proto(weights)
    assert err.value.reason == "oversized"
    assert "at least 3221225472 bytes" in err.value.message
    with pytest.raises(WireError, match="oversized"):
        codec.payload_to_proto(HeadWeights(np.broadcast_to(np.float64(0), (1 << 29, 1)), np.zeros(1)))


# ---------------------------------------------------------------- bfloat16


# (float32 bits, expected bfloat16 bits), worked out by hand: keep the upper 16 bits, add one when
# the lower 16 bits exceed 0x8000, or equal it (a tie) and the kept value is odd; NaN -> 0x7FC0.
BF16_CASES = [
    (0x3F800000, 0x3F80),  # 1.0 exactly
    (0x3F807FFF, 0x3F80),  # just below the half-way point: down
    (0x3F808000, 0x3F80),  # tie, kept value even: stays
    (0x3F808001, 0x3F81),  # just above the half-way point: up
    (0x3F818000, 0x3F82),  # tie, kept value odd: up to even
    (0x3F81FFFF, 0x3F82),  # carries into the next value
    (0x3FFF8000, 0x4000),  # tie that carries into the exponent: 1.99609375... -> 2.0
    (0xBF818000, 0xBF82),  # negative tie rounds the magnitude to even
    (0xBF808000, 0xBF80),
    (0x80000000, 0x8000),  # -0.0 keeps its sign
    (0x00000001, 0x0000),  # smallest subnormal rounds to zero
    (0x00018000, 0x0002),  # subnormal tie to even
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x7F7F7FFF, 0x7F7F),  # stays the largest finite bfloat16
    (0x7F7F8000, 0x7F80),  # tie above the largest finite value: even is +inf
    (0x7F7FFFFF, 0x7F80),  # float32 max overflows to +inf
    (0xFF7FFFFF, 0xFF80),  # and -max to -inf
    (0x7FC00000, 0x7FC0),  # quiet NaN
    (0x7F800001, 0x7FC0),  # signalling NaN whose truncation would read as +inf
    (0xFFFFFFFF, 0x7FC0),  # NaN with every bit set (would wrap around if rounded naively)
]


def test_bfloat16_rounds_to_nearest_even_against_hand_computed_bits() -> None:
    src = np.array([c[0] for c in BF16_CASES], dtype=np.uint32).view(np.float32)
    expected = np.array([c[1] for c in BF16_CASES], dtype="<u2")
    t = codec.tensor_to_proto(src, "bfloat16")
    assert t.dtype == tpb.DTYPE_BFLOAT16
    assert list(t.shape) == [len(BF16_CASES)]
    assert t.data == expected.tobytes()
    back = codec.tensor_from_proto(t)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(bits_of(back), expected.astype(np.uint32) << 16)
    assert np.isnan(back[-3:]).all()
    assert back[0] == 1.0


def reference_bfloat16(x: float) -> int:
    """bfloat16 bits of float32 ``x`` by exact rational comparison (independent of the bit trick)."""
    bits = int(bits_of(np.array([x]))[0])
    if np.isnan(x):
        return 0x7FC0
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    lo = mag >> 16
    if mag == lo << 16:
        return (sign >> 16) | lo

    def value(b16: int) -> Fraction:
        if b16 == 0x7F80:  # rounding treats +inf as the next value after the largest finite: 2^128
            return Fraction(2) ** 128
        return Fraction(float(f32(b16 << 16)))

    exact = Fraction(float(f32(mag)))
    below, above = exact - value(lo), value(lo + 1) - exact
    up = above < below or (above == below and lo & 1)
    return (sign >> 16) | (lo + 1 if up else lo)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_bfloat16_matches_exact_reference(bits: int) -> None:
    x = f32(bits)
    t = codec.tensor_to_proto(np.array([x], dtype=np.float32), "bfloat16")
    assert struct.unpack("<H", t.data)[0] == reference_bfloat16(float(x))


def test_bfloat16_of_float64_goes_through_float32() -> None:
    x = np.array([1.0 + 2**-8 + 2**-40], dtype=np.float64)  # float32 rounds to the tie 1 + 2^-8
    assert codec.tensor_to_proto(x, "bfloat16").data == struct.pack("<H", 0x3F80)


# ---------------------------------------------------------------- malformed tensors


def _malformed(t: tpb.Tensor) -> WireError:
    with pytest.raises(WireError) as err:
        codec.tensor_from_proto(tpb.Tensor.FromString(t.SerializeToString()))
    assert err.value.reason == "malformed"
    assert err.value.status == "INVALID_ARGUMENT"
    return err.value


@pytest.mark.parametrize(("dtype", "shape", "n_bytes"), [
    (tpb.DTYPE_FLOAT32, [3], 11),
    (tpb.DTYPE_FLOAT32, [3], 13),
    (tpb.DTYPE_FLOAT32, [2, 2], 0),
    (tpb.DTYPE_INT64, [], 4),
    (tpb.DTYPE_BFLOAT16, [5], 5),
    (tpb.DTYPE_BOOL, [0], 1),
    (tpb.DTYPE_UINT8, [2**32, 2**32], 0),  # 2^64 elements: would wrap to 0 in int64 arithmetic
    (tpb.DTYPE_INT32, [2**62, 4], 0),
])
def test_wrong_byte_length_is_malformed(dtype: int, shape: list[int], n_bytes: int) -> None:
    err = _malformed(tpb.Tensor(dtype=dtype, shape=shape, data=b"\x00" * n_bytes))  # type: ignore[arg-type]
    assert "bytes" in err.message


def test_negative_dimension_is_malformed() -> None:
    err = _malformed(tpb.Tensor(dtype=tpb.DTYPE_FLOAT32, shape=[-1, 2], data=b""))
    assert "negative" in err.message
    _malformed(tpb.Tensor(dtype=tpb.DTYPE_FLOAT32, shape=[-2, -2], data=b"\x00" * 16))


@pytest.mark.parametrize("enum", [tpb.DTYPE_UNSPECIFIED, 10, 99, 2**31 - 1])
def test_unknown_dtype_enum_is_malformed(enum: int) -> None:
    t = tpb.Tensor(shape=[1], data=b"\x00" * 4)
    t.dtype = enum  # type: ignore[assignment]  # open enums keep unknown numbers
    err = _malformed(t)
    assert "dtype" in err.message
    with pytest.raises(WireError) as e2:
        codec.dtype_name(enum)
    assert e2.value.reason == "malformed"


def test_payload_with_empty_oneof_is_malformed() -> None:
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(pb.Payload())
    assert err.value.reason == "malformed"
    assert codec.tensor_elements(pb.Payload()) == 0


def test_model_weights_naming_a_tensor_twice_is_malformed() -> None:
    msg = codec.payload_to_proto(ModelWeights({"w": np.zeros(2, np.float32)}))
    msg.model_weights.tensors.add().CopyFrom(msg.model_weights.tensors[0])
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(msg)
    assert err.value.reason == "malformed"


def test_malformed_tensor_inside_a_payload() -> None:
    msg = codec.payload_to_proto(HeadWeights(np.zeros((2, 3), np.float32), np.zeros(2, np.float32)))
    msg.head_weights.bias.data = b"\x00"
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(msg)
    assert err.value.reason == "malformed"


def test_encoding_a_non_payload_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a payload"):
        codec.payload_to_proto(np.zeros(3))  # type: ignore[arg-type]


def test_each_payload_kind_has_one_pair_under_its_oneof_field() -> None:
    fields = sorted(f.name for f in pb.Payload.DESCRIPTOR.oneofs_by_name["kind"].fields)
    assert fields == sorted(k.value for k in PayloadKind) == sorted(codec._FROM_PROTO)
    assert sorted((cls.kind.value, field) for cls, (field, _) in codec._TO_PROTO.items()) == [(f, f) for f in fields]


def test_an_empty_payload_still_sets_its_kind() -> None:
    for payload in (ModelWeights({}), FactorizedWeights(()), EvalMetrics()):
        msg = codec.payload_to_proto(payload)
        assert msg.WhichOneof("kind") == payload.kind.value and msg.ByteSize() == 2  # field tag, length 0
        assert codec.payload_from_proto(msg) == payload


# ---------------------------------------------------------------- payload round trips (Hypothesis)

NATIVE_DTYPES = ["<f4", "<f2", "<i8", "<i4", "u1", "?"]
names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
doubles = st.floats(allow_nan=False)  # NaN != NaN would defeat dataclass equality; arrays carry NaN below
ANY_NATIVE_DTYPE = st.sampled_from(NATIVE_DTYPES)


def arrays(dtype: str | st.SearchStrategy[str] = ANY_NATIVE_DTYPE, min_dims: int = 0,
           max_dims: int = 3) -> st.SearchStrategy[np.ndarray]:
    """Small arrays (zero-size and 0-d included) of the wire-native dtypes, NaN and inf included."""
    return hnp.arrays(dtype, hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=0, max_side=4))


def floats(min_dims: int = 0, max_dims: int = 3) -> st.SearchStrategy[np.ndarray]:
    return arrays(st.sampled_from(["<f4", "<f2"]), min_dims, max_dims)


def ints64(max_dims: int = 1) -> st.SearchStrategy[np.ndarray]:
    return arrays("<i8", 1, max_dims)


layers = st.builds(
    FactorizedLayer, names, floats(2, 2), floats(2, 2), ints64(), floats(1, 1),
    st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=3).map(tuple),
)

PAYLOADS: dict[PayloadKind, st.SearchStrategy[Any]] = {
    PayloadKind.MODEL_WEIGHTS: st.builds(ModelWeights, st.dictionaries(names, arrays(), max_size=5), int64s),
    PayloadKind.HEAD_WEIGHTS: st.builds(HeadWeights, floats(2, 2), floats(1, 1), int64s),
    PayloadKind.CLASS_COUNTS: st.builds(ClassCounts, ints64()),
    PayloadKind.CLASS_MEAN_EMBEDDINGS: st.builds(ClassMeanEmbeddings, ints64(), floats(2, 2), ints64(),
                                                 arrays("?", 1, 1)),
    PayloadKind.SEED_POSTERIORS: st.builds(SeedPosteriors, names, ints64(), floats(2, 2), doubles, names),
    PayloadKind.FACTORIZED_WEIGHTS: st.builds(FactorizedWeights, st.lists(layers, max_size=3).map(tuple), int64s),
    PayloadKind.CRITERIA_EMBEDDINGS: st.builds(CriteriaEmbeddings, names, floats(2, 2)),
    PayloadKind.EVAL_METRICS: st.builds(EvalMetrics, doubles, int64s, doubles, doubles, int64s,
                                        st.dictionaries(names, doubles, max_size=4)),
    PayloadKind.PEER_WEIGHTS: st.builds(PeerWeights, st.lists(names, max_size=4).map(tuple), floats(1, 1)),
}


PAYLOADS.update(SECAGG_PAYLOADS)


def test_every_payload_kind_has_a_strategy() -> None:
    assert set(PAYLOADS) == set(PayloadKind)


def assert_same(a: Any, b: Any, where: str = "payload") -> None:
    """Deep equality: arrays by dtype, shape and exact bytes (NaN, -0.0 included); the rest by ==."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert b.dtype == a.dtype.newbyteorder("="), f"{where}: {b.dtype} != {a.dtype}"
        assert b.shape == a.shape, f"{where}: {b.shape} != {a.shape}"
        assert b.tobytes() == a.astype(a.dtype.newbyteorder("<")).tobytes(), where
    elif dataclasses.is_dataclass(a):
        assert type(b) is type(a), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict) and a and isinstance(next(iter(a.values())), np.ndarray):
        assert list(b) == list(a), f"{where}: names or order differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, tuple) and a and dataclasses.is_dataclass(a[0]):
        assert len(b) == len(a), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert b == a, f"{where}: {b!r} != {a!r}"
        assert type(b) is type(a), f"{where}: {type(b)} != {type(a)}"


def round_trip(payload: Payload, wire_dtype: str | None = None) -> Payload:
    wire = codec.payload_to_proto(payload, wire_dtype).SerializeToString()
    return codec.payload_from_proto(pb.Payload.FromString(wire))


@pytest.mark.parametrize("kind", list(PayloadKind), ids=lambda k: k.value)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_payload_kind_round_trips(kind: PayloadKind, data: st.DataObject) -> None:
    payload = data.draw(PAYLOADS[kind])
    msg = codec.payload_to_proto(payload)
    assert msg.WhichOneof("kind") == kind.value
    assert codec.payload_kind_of(msg) is kind
    back = round_trip(payload)
    assert back.kind is kind
    assert_same(payload, back)


@pytest.mark.parametrize("kind", list(PayloadKind), ids=lambda k: k.value)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tensor_elements_counts_exactly(kind: PayloadKind, data: st.DataObject) -> None:
    payload = data.draw(PAYLOADS[kind])
    msg = codec.payload_to_proto(payload)
    expected = sum(int(a.size) for name, a in named_tensors(payload) if not name.endswith(".mask_indices"))
    if isinstance(payload, FactorizedWeights):  # a mask's positions travel in its layer's form
        for layer, sent in zip(payload.layers, msg.factorized_weights.layers, strict=True):
            size, k = math.prod(layer.mask_shape), int(np.size(layer.mask_indices))
            expected += {pb.MASK_ENCODING_UNSPECIFIED: k, pb.MASK_ENCODING_GAPS: k,
                         pb.MASK_ENCODING_BITMAP: (size + 7) // 8, pb.MASK_ENCODING_DENSE: size - k}[sent.mask_encoding]
    if isinstance(payload, SecAggMaskedInput) and payload.message.vector.dtype == np.uint64:
        expected *= 2  # a 64-bit ring travels as two uint32 words per element
    assert codec.tensor_elements(msg) == expected


def test_tensor_elements_without_decoding_huge_declared_shapes() -> None:
    msg = pb.Payload()
    nt = msg.model_weights.tensors.add(name="huge")
    nt.tensor.shape.extend([2**40, 2**40])  # exact beyond int64: 2^80
    nt2 = msg.model_weights.tensors.add(name="scalar")
    nt2.tensor.dtype = tpb.DTYPE_FLOAT32
    msg.model_weights.tensors.add(name="empty").tensor.shape.extend([0, 7])
    assert codec.tensor_elements(msg) == 2**80 + 1
    layer = codec.payload_to_proto(FactorizedWeights((FactorizedLayer(
        "l", np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), np.arange(5), np.zeros(5, np.float32),
        (1000, 1000)),)))
    assert codec.tensor_elements(layer) == 6 + 12 + 5 + 5  # mask_shape is metadata, not elements
    assert codec.tensor_elements(codec.payload_to_proto(EvalMetrics(extra={"a": 1.0}))) == 0


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
@settings(max_examples=30, deadline=None)
@given(payload=PAYLOADS[PayloadKind.CLASS_MEAN_EMBEDDINGS])
def test_narrowed_transport_touches_floating_tensors_only(wire_dtype: str, payload: ClassMeanEmbeddings) -> None:
    back = round_trip(payload, wire_dtype)
    assert isinstance(back, ClassMeanEmbeddings)
    assert_same(payload.labels, back.labels)
    assert_same(payload.counts, back.counts)
    assert_same(payload.presence, back.presence)
    ref = codec.tensor_from_proto(codec.tensor_to_proto(payload.means, wire_dtype))
    assert back.means.dtype == (np.float16 if wire_dtype == "float16" else np.float32)
    assert back.means.tobytes() == ref.tobytes()


def test_payloads_with_big_endian_tensors_arrive_little_endian() -> None:
    w = np.array([[1.5, -2.0]], dtype=">f4")
    i = np.array([7, -9], dtype=">i8")
    msg = codec.payload_to_proto(ModelWeights({"w": w, "i": i}, num_examples=3))
    assert msg.model_weights.tensors[0].tensor.data == b"\x00\x00\xc0\x3f\x00\x00\x00\xc0"
    back = round_trip(ModelWeights({"w": w, "i": i}, num_examples=3))
    assert_same(ModelWeights({"w": w.astype("<f4"), "i": i.astype("<i8")}, 3), back)


def test_fill_payload_builds_in_place_inside_a_parent() -> None:
    from hetfed.v1 import aggregator_pb2 as apb

    payloads: list[Payload] = [ModelWeights({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, 4),
                               EvalMetrics(train_loss=0.5, extra={"x": 1.0})]
    update = apb.Update()
    for p in payloads:
        codec.fill_payload(update.payloads.add(), p)
    expected = apb.Update(payloads=[codec.payload_to_proto(p) for p in payloads])
    assert update.SerializeToString() == expected.SerializeToString()


def test_the_codec_tables_follow_the_payload_declarations() -> None:
    """One declaration per kind: each member of ``Payload`` and its kind's pair, nothing written twice."""
    declared = set(typing.get_args(Payload))
    assert set(codec._TO_PROTO) == declared
    assert {field for field, _ in codec._TO_PROTO.values()} == set(codec._FROM_PROTO) == {k.value for k in PayloadKind}
    assert codec._TO_PROTO[HeadWeights] == ("head_weights", codec.head_weights_to_proto)
    assert codec._FROM_PROTO["head_weights"] is codec.head_weights_from_proto


def test_a_payload_kind_without_its_pair_fails_the_import(monkeypatch: pytest.MonkeyPatch) -> None:
    new = type("NewKind", (), {"kind": types.SimpleNamespace(value="new_kind")})
    monkeypatch.setattr(codec, "Payload", HeadWeights | new)
    with pytest.raises(RuntimeError, match=r"^payload NewKind: needs field 'new_kind' in the Payload oneof of "
                                           r"payloads.proto and new_kind_to_proto and new_kind_from_proto in "
                                           r"hetfed.wire.codec$"):
        codec._tables()
    monkeypatch.setattr(codec, "Payload", HeadWeights)
    with pytest.raises(RuntimeError, match=r"without one class in payloads.Payload.*'class_counts'"):
        codec._tables()
