"""Pure conversions between numpy/dataclass payloads and hetfed.v1 Protobuf messages.

Tensors travel as raw little-endian bytes and no function loops over elements. Encoding a message to
send (``fill_payload_placed``, then ``serialize.serialize``) copies no tensor here: each tensor's ``data``
holds a placeholder, and the serializer converts the array once, into its place in the message. Encoding
into a message protobuf serializes (``fill_payload``) copies a tensor twice (array -> ``bytes`` -> the
message; Protobuf's bytes setter accepts nothing else). Both fill every payload message in place, never
through a constructor or ``add(tensor=...)`` that would copy the finished sub-message once more. Decoding reads each ``data`` field once (every read
of a bytes field is a fresh copy) and returns a read-only ``np.frombuffer`` view of that copy.

Each payload kind has one flat pair, ``x_to_proto`` (fills the kind's field of a Payload in place) and
``x_from_proto``, named after the kind's value; two tables derived from ``payloads.Payload`` pick them, by
payload type when encoding and by the oneof field when decoding.
"""

from __future__ import annotations

import contextvars
import math
import typing
from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError, EncodeError

from hetfed import secagg
from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import framing, serialize
from hetfed.wire.errors import WireError, from_secagg
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
    SecAggKeyAdvert,
    SecAggMaskedInput,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggSharedKeys,
    SecAggUnmask,
    SeedPosteriors,
    named_tensors,
)
from hetfed.wire.serialize import Placed

# Wire dtype name -> (enum, little-endian numpy dtype of the raw bytes).
# bfloat16 has no numpy dtype: its bytes are the upper halves of float32 words, decoded to float32.
_WIRE: dict[str, tuple[int, np.dtype]] = {
    "float32": (tpb.DTYPE_FLOAT32, np.dtype("<f4")),
    "float16": (tpb.DTYPE_FLOAT16, np.dtype("<f2")),
    "bfloat16": (tpb.DTYPE_BFLOAT16, np.dtype("<u2")),
    "int64": (tpb.DTYPE_INT64, np.dtype("<i8")),
    "int32": (tpb.DTYPE_INT32, np.dtype("<i4")),
    "uint8": (tpb.DTYPE_UINT8, np.dtype("u1")),
    "bool": (tpb.DTYPE_BOOL, np.dtype("?")),
    "uint16": (tpb.DTYPE_UINT16, np.dtype("<u2")),
    "uint32": (tpb.DTYPE_UINT32, np.dtype("<u4")),
}
_BY_ENUM = {enum: (name, dt) for name, (enum, dt) in _WIRE.items()}
WIRE_DTYPES = tuple(_WIRE)
FLOAT_WIRE_DTYPES = ("float32", "float16", "bfloat16")
# Protobuf (upb) cannot serialize a length-delimited field (bytes or sub-message) of 2 GiB or more.
# So one tensor's bytes, and one whole Payload message (it is a field of Update / Instructions), must
# stay below 2 GiB; only the top-level message may be larger.
MAX_TENSOR_BYTES = (1 << 31) - 1
MAX_PAYLOAD_BYTES = (1 << 31) - 1


def wire_dtype_of(array: np.ndarray) -> str:
    """The wire dtype name an array is sent as by default (float64 travels as float32)."""
    kind = array.dtype
    native = kind.newbyteorder("=")  # byte order does not matter: the wire is always little-endian
    if native == np.float64 or native == np.float32:
        return "float32"
    for name, (_, dt) in _WIRE.items():
        if name != "bfloat16" and native == dt.newbyteorder("="):
            return name
    raise WireError("unsupported_dtype", f"arrays of dtype {kind} cannot be sent")


def dtype_enum(name: str) -> int:
    """The hetfed.v1.Dtype enum value of a wire dtype name."""
    if name not in _WIRE:
        raise WireError("unsupported_dtype", f"unknown wire dtype {name!r}; expected one of {WIRE_DTYPES}")
    return _WIRE[name][0]


def dtype_name(enum_value: int) -> str:
    """The wire dtype name of a hetfed.v1.Dtype enum value."""
    if enum_value not in _BY_ENUM:
        raise WireError("malformed", f"unknown tensor dtype enum {enum_value}")
    return _BY_ENUM[enum_value][0]


def _placed(array: np.ndarray, wire_dtype: str | None) -> tuple[int, Placed]:
    """(dtype enum, what to write) of ``array`` sent as ``wire_dtype``; nothing is converted yet."""
    array = np.asarray(array)
    name = wire_dtype or wire_dtype_of(array)
    if name not in _WIRE:
        raise WireError("unsupported_dtype", f"unknown wire dtype {name!r}; expected one of {WIRE_DTYPES}")
    enum, raw = _WIRE[name]
    return enum, Placed(array, raw, name == "bfloat16")


def _encode(array: np.ndarray, wire_dtype: str | None) -> tuple[int, tuple[int, ...], bytes]:
    """(dtype enum, shape, little-endian C-order bytes) of ``array`` sent as ``wire_dtype``."""
    enum, placed = _placed(array, wire_dtype)
    if placed.nbytes > MAX_TENSOR_BYTES:
        raise WireError(
            "oversized",
            f"a tensor of shape {list(placed.array.shape)} takes {placed.nbytes} bytes; one tensor may take at most "
            f"{MAX_TENSOR_BYTES} bytes in a message protobuf serializes (Protobuf's limit on one bytes field): "
            "send it with messages.encode_update / encode_instructions, which have no such limit",
        )
    out = np.empty(placed.nbytes, np.uint8)
    placed.write(out)
    return enum, placed.array.shape, out.tobytes()


# While a payload is filled for ``serialize``: the sources its tensors' placeholders stand for.
_SOURCES: contextvars.ContextVar[list[Placed] | None] = contextvars.ContextVar("hetfed_wire_sources", default=None)


def _fill(target: tpb.Tensor, array: np.ndarray, wire_dtype: str | None = None) -> None:
    """Encode ``array`` into an existing (empty) Tensor field in place (a placeholder of its bytes when
    filling for ``serialize``: ``fill_payload_placed``)."""
    sources = _SOURCES.get()
    if sources is None:
        enum, shape, data = _encode(array, wire_dtype)
    else:
        enum, placed = _placed(array, wire_dtype)
        shape, data = placed.array.shape, b""
        if placed.nbytes:  # proto3 omits empty bytes: an empty tensor has no data field, so no placeholder
            data = serialize.placeholder(len(sources))
            sources.append(placed)
    target.dtype = enum  # type: ignore[assignment]
    target.shape.extend(shape)
    target.data = data


def tensor_to_proto(array: np.ndarray, wire_dtype: str | None = None) -> tpb.Tensor:
    """Encode a numpy array as a Tensor; floats may be narrowed to float16 or bfloat16 for transport."""
    enum, shape, data = _encode(array, wire_dtype)
    return tpb.Tensor(dtype=enum, shape=shape, data=data)  # type: ignore[arg-type]


def tensor_from_proto(tensor: tpb.Tensor, lifted: list[memoryview] | None = None) -> np.ndarray:
    """Decode a Tensor into a read-only numpy view of its bytes (bfloat16 widens to float32).

    ``lifted``: the tensor comes from a message parsed with its tensors' data lifted out
    (``framing.lift``); its ``data`` holds the index of its bytes among ``lifted``, which the array views.
    """
    name = dtype_name(tensor.dtype)
    raw = _BY_ENUM[tensor.dtype][1]
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError("malformed", f"tensor shape {shape} has a negative dimension")
    count = math.prod(shape)  # exact: numpy's int64 product could wrap around for absurd shapes
    field = tensor.data  # read once: every read of a bytes field copies it
    data = field if lifted is None else framing.lifted_value(field, lifted)
    if len(data) != count * raw.itemsize:
        raise WireError(
            "malformed",
            f"tensor of shape {shape} and dtype {name} needs {count * raw.itemsize} bytes, got {len(data)}",
        )
    array = np.frombuffer(data, dtype=raw).reshape(shape)  # read-only: bytes, or a view of read-only bytes
    if name == "bfloat16":
        array = (array.astype("<u4") << 16).view("<f4")
    return array


def _fill_t(target: tpb.Tensor, array: np.ndarray, wire_dtype: str | None) -> None:
    """Encode in place with the transport dtype applied to floating arrays only."""
    if wire_dtype is not None and np.asarray(array).dtype.kind == "f":
        _fill(target, array, wire_dtype)
    else:
        _fill(target, array)


def payload_to_proto(payload: Payload, wire_dtype: str | None = None) -> pb.Payload:
    """Encode a typed payload; ``wire_dtype`` narrows floating tensors for transport."""
    return fill_payload(pb.Payload(), payload, wire_dtype)


def _min_encoded_bytes(payload: Payload, wire_dtype: str | None) -> int:
    """A lower bound of the tensor bytes ``payload`` encodes to (narrowing applied to every float)."""
    narrow = wire_dtype in ("float16", "bfloat16")
    total = 0
    for name, a in named_tensors(payload):
        if isinstance(payload, FactorizedWeights) and name.endswith(".mask_indices"):
            continue  # positions may travel as a bitmap or one-byte gaps: the values alone bound a mask
        a = np.asarray(a)
        item = 2 if narrow and a.dtype.kind == "f" else min(a.dtype.itemsize, 4 if a.dtype.kind == "f" else 8)
        total += a.size * item
    return total


def _oversized_payload(payload: Payload, size: str) -> WireError:
    return WireError(
        "oversized",
        f"a {payload.kind.value} payload of {size} bytes: one payload may take at most {MAX_PAYLOAD_BYTES} "
        "bytes serialized (Protobuf's limit on one message field)",
    )


def fill_payload(out: pb.Payload, payload: Payload, wire_dtype: str | None = None) -> pb.Payload:
    """Encode a typed payload into an empty Payload field in place (for example ``update.payloads.add()``).

    ``Update(payloads=[payload_to_proto(p)])`` deep-copies every tensor once more; filling the
    repeated field in place does not. A payload too large for Protobuf is refused with
    WireError("oversized"), before any copy when its tensors alone exceed the limit. Returns ``out``.
    """
    if isinstance(payload, EvalMetrics):
        return _fill_payload(out, payload, wire_dtype)
    at_least = _min_encoded_bytes(payload, wire_dtype)
    if at_least > MAX_PAYLOAD_BYTES:
        raise _oversized_payload(payload, f"at least {at_least}")
    _fill_payload(out, payload, wire_dtype)
    if at_least > MAX_PAYLOAD_BYTES - (64 << 20):  # names and headers may push it over: ask Protobuf
        try:
            size: int | None = out.ByteSize()
        except EncodeError:  # a sub-message of 2 GiB or more inside it
            size = None
        if size is None or size > MAX_PAYLOAD_BYTES:
            out.Clear()
            raise _oversized_payload(payload, f"more than {MAX_PAYLOAD_BYTES}" if size is None else str(size))
    return out


def fill_payload_placed(out: pb.Payload, payload: Payload, sources: list[Placed],
                        wire_dtype: str | None = None) -> pb.Payload:
    """Fill ``out`` as ``fill_payload`` does, but with each tensor's bytes left to ``serialize.serialize``: its
    ``data`` holds a placeholder and its array is appended to ``sources`` (nothing is copied). No size limit
    applies: the serializer writes fields of any size. Returns ``out``."""
    token = _SOURCES.set(sources)
    try:
        return _fill_payload(out, payload, wire_dtype)
    finally:
        _SOURCES.reset(token)


# ------------------------------------------------------------------------------------------ payload pairs
# One ``x_to_proto`` / ``x_from_proto`` pair per payload kind. ``x_to_proto`` fills the kind's (empty) field of a
# Payload in place; ``x_from_proto`` reads that field (``lifted``: see ``tensor_from_proto``).


def model_weights_to_proto(payload: ModelWeights, out: pb.ModelWeights, wire_dtype: str | None) -> None:
    """Fill a ModelWeights message: its named tensors in order and the example count."""
    out.num_examples = payload.num_examples
    for name, arr in payload.tensors.items():
        nt = out.tensors.add()
        nt.name = name
        nt.tensor.SetInParent()
        _fill_t(nt.tensor, arr, wire_dtype)


def model_weights_from_proto(m: pb.ModelWeights, lifted: list[memoryview] | None) -> ModelWeights:
    """Decode a ModelWeights message; a tensor named twice is malformed."""
    names = [t.name for t in m.tensors]
    if len(set(names)) != len(names):
        raise WireError("malformed", "model weights name a tensor twice")
    return ModelWeights({t.name: tensor_from_proto(t.tensor, lifted) for t in m.tensors}, int(m.num_examples))


def head_weights_to_proto(payload: HeadWeights, out: pb.HeadWeights, wire_dtype: str | None) -> None:
    """Fill a HeadWeights message."""
    _fill_t(out.weight, payload.weight, wire_dtype)
    _fill_t(out.bias, payload.bias, wire_dtype)
    out.num_examples = payload.num_examples


def head_weights_from_proto(h: pb.HeadWeights, lifted: list[memoryview] | None) -> HeadWeights:
    """Decode a HeadWeights message."""
    return HeadWeights(tensor_from_proto(h.weight, lifted), tensor_from_proto(h.bias, lifted), int(h.num_examples))


def class_counts_to_proto(payload: ClassCounts, out: pb.ClassCounts, wire_dtype: str | None) -> None:
    """Fill a ClassCounts message (integers: ``wire_dtype`` does not apply)."""
    _fill(out.counts, payload.counts)


def class_counts_from_proto(c: pb.ClassCounts, lifted: list[memoryview] | None) -> ClassCounts:
    """Decode a ClassCounts message."""
    return ClassCounts(tensor_from_proto(c.counts, lifted))


def class_mean_embeddings_to_proto(payload: ClassMeanEmbeddings, out: pb.ClassMeanEmbeddings,
                                   wire_dtype: str | None) -> None:
    """Fill a ClassMeanEmbeddings message (``wire_dtype`` narrows the means only)."""
    _fill(out.labels, payload.labels)
    _fill_t(out.means, payload.means, wire_dtype)
    _fill(out.counts, payload.counts)
    _fill(out.presence, payload.presence)


def class_mean_embeddings_from_proto(c: pb.ClassMeanEmbeddings,
                                     lifted: list[memoryview] | None) -> ClassMeanEmbeddings:
    """Decode a ClassMeanEmbeddings message."""
    return ClassMeanEmbeddings(tensor_from_proto(c.labels, lifted), tensor_from_proto(c.means, lifted),
                               tensor_from_proto(c.counts, lifted), tensor_from_proto(c.presence, lifted))


def seed_posteriors_to_proto(payload: SeedPosteriors, out: pb.SeedPosteriors, wire_dtype: str | None) -> None:
    """Fill a SeedPosteriors message (``wire_dtype`` narrows the probabilities only)."""
    out.seed_set_id = payload.seed_set_id
    _fill(out.indices, payload.indices)
    _fill_t(out.probabilities, payload.probabilities, wire_dtype)
    out.teaching_confidence = payload.teaching_confidence
    out.source_organization = payload.source_organization


def seed_posteriors_from_proto(s: pb.SeedPosteriors, lifted: list[memoryview] | None) -> SeedPosteriors:
    """Decode a SeedPosteriors message."""
    return SeedPosteriors(s.seed_set_id, tensor_from_proto(s.indices, lifted),
                          tensor_from_proto(s.probabilities, lifted), float(s.teaching_confidence),
                          s.source_organization)


# The gap widths a MASK_ENCODING_GAPS mask may use, narrowest first.
_GAP_DTYPES = (np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4"))


def mask_encoding(indices: np.ndarray, values: np.ndarray, size: int, value_bytes: int) -> tuple[int, int]:
    """(MaskEncoding, bytes of its tensors) of the smallest form for a sparse mask: ``indices`` strictly increasing
    flat positions into ``size`` entries, ``values`` (``value_bytes`` each on the wire) the entries there.

    Forms and their bytes for k entries sent: positions 4k or 8k (int32 or int64) and gaps 1k, 2k or 4k (by
    the largest gap), each plus the values; a bitmap ceil(size / 8) plus the values; dense ``value_bytes`` ·
    size, only when no sent value is zero (a dense mask sends its non-zero entries). At equal size the first of
    gaps, bitmap, dense and positions is taken.
    """
    idx = np.asarray(indices)
    k = int(idx.size)
    values_bytes = value_bytes * k
    gap = int(np.max(np.diff(idx, prepend=-1) - 1)) if k else 0
    candidates = []
    width = next((dt.itemsize for dt in _GAP_DTYPES if gap <= np.iinfo(dt).max), None)
    if width is not None:
        candidates.append((width * k + values_bytes, 0, pb.MASK_ENCODING_GAPS))
    candidates.append(((size + 7) // 8 + values_bytes, 1, pb.MASK_ENCODING_BITMAP))
    if k == 0 or np.all(np.asarray(values) != 0):
        candidates.append((value_bytes * size, 2, pb.MASK_ENCODING_DENSE))
    candidates.append(((4 if size <= np.iinfo(np.int32).max + 1 else 8) * k + values_bytes, 3,
                       pb.MASK_ENCODING_UNSPECIFIED))
    nbytes, _, enum = min(candidates)
    return int(enum), int(nbytes)


def _fill_mask(fl: pb.FactorizedLayer, layer: FactorizedLayer, wire_dtype: str | None) -> None:
    """Write ``layer``'s mask into ``fl`` in its smallest form (``mask_encoding``)."""
    idx = np.asarray(layer.mask_indices)
    val = np.asarray(layer.mask_values)
    size = math.prod(layer.mask_shape)
    valid = idx.ndim == 1 and val.shape == idx.shape and idx.dtype.kind in "iu" and val.dtype.kind == "f"
    if valid and idx.size:
        wide = idx.astype(np.int64)
        valid = bool(wide[0] >= 0 and wide[-1] < size and np.all(np.diff(wide) > 0))
    if not valid:  # not a sparse mask: sent as given, for the receiver's checks to name what is wrong
        fl.mask_encoding = pb.MASK_ENCODING_UNSPECIFIED  # type: ignore[assignment]
        _fill(fl.mask_indices, idx)
        _fill_t(fl.mask_values, val, wire_dtype)
        return
    idx = idx.astype(np.int64)
    sent_as = wire_dtype if (wire_dtype is not None and val.dtype.kind == "f") else wire_dtype_of(val)
    enum, _ = mask_encoding(idx, val, size, _WIRE[sent_as][1].itemsize)
    fl.mask_encoding = enum  # type: ignore[assignment]
    if enum == pb.MASK_ENCODING_GAPS:
        gaps = np.diff(idx, prepend=-1) - 1
        width = next(dt for dt in _GAP_DTYPES if not gaps.size or gaps.max() <= np.iinfo(dt).max)
        _fill(fl.mask_indices, gaps.astype(width))
        _fill_t(fl.mask_values, val, wire_dtype)
    elif enum == pb.MASK_ENCODING_BITMAP:
        bits = np.zeros(size, dtype=bool)
        bits[idx] = True
        _fill(fl.mask_bitmap, np.packbits(bits))
        _fill_t(fl.mask_values, val, wire_dtype)
    elif enum == pb.MASK_ENCODING_DENSE:
        dense = np.zeros(size, dtype=val.dtype)
        dense[idx] = val
        _fill_t(fl.mask_values, dense, wire_dtype)
    else:
        _fill(fl.mask_indices, idx.astype(np.int32) if size <= np.iinfo(np.int32).max + 1 else idx)
        _fill_t(fl.mask_values, val, wire_dtype)


def _read_mask(layer: pb.FactorizedLayer, lifted: list[memoryview] | None) -> tuple[np.ndarray, np.ndarray]:
    """(int64 flat positions, values) of a layer's mask in any MaskEncoding form; a form that does not stand for
    strictly increasing positions inside the mask, or carries another form's fields, is malformed."""
    name = layer.name[:64]
    size = math.prod(int(d) for d in layer.mask_shape)
    enum = layer.mask_encoding
    if enum not in pb.MaskEncoding.values():
        raise WireError("malformed", f"layer {name!r}: unknown mask encoding {enum}")
    form = pb.MaskEncoding.Name(enum)
    if enum != pb.MASK_ENCODING_BITMAP and layer.HasField("mask_bitmap"):
        raise WireError("malformed", f"layer {name!r}: a mask bitmap is sent with MASK_ENCODING_BITMAP only, "
                                     f"not {form}")
    if enum in (pb.MASK_ENCODING_BITMAP, pb.MASK_ENCODING_DENSE) and layer.HasField("mask_indices"):
        raise WireError("malformed", f"layer {name!r}: mask indices are not sent with {form}")
    values = tensor_from_proto(layer.mask_values, lifted)
    if enum == pb.MASK_ENCODING_UNSPECIFIED:  # positions as sent; the receiver checks them
        raw = tensor_from_proto(layer.mask_indices, lifted)
        return (raw.astype(np.int64) if raw.dtype == np.int32 else raw), values
    if values.ndim != 1:
        raise WireError("malformed", f"layer {name!r}: mask values must be a vector, got {list(values.shape)}")
    if enum == pb.MASK_ENCODING_BITMAP:
        bitmap = tensor_from_proto(layer.mask_bitmap, lifted)
        if bitmap.dtype != np.uint8 or bitmap.shape != ((size + 7) // 8,):
            raise WireError("malformed", f"layer {name!r}: the bitmap of a mask of {size} entries is uint8 "
                                         f"[{(size + 7) // 8}], got {bitmap.dtype}{list(bitmap.shape)}")
        bits = np.unpackbits(bitmap)
        if bits[size:].any():
            raise WireError("malformed", f"layer {name!r}: the mask bitmap sets padding bits past entry {size}")
        idx = np.flatnonzero(bits).astype(np.int64)
        if idx.size != values.size:
            raise WireError("malformed", f"layer {name!r}: the mask bitmap sets {idx.size} bits but {values.size} "
                                         "values follow")
        return idx, values
    if enum == pb.MASK_ENCODING_DENSE:
        if values.size != size:
            raise WireError("malformed", f"layer {name!r}: a dense mask of shape {list(layer.mask_shape)} has "
                                         f"{size} values, got {values.size}")
        idx = np.flatnonzero(values).astype(np.int64)
        return idx, values[idx]
    raw = tensor_from_proto(layer.mask_indices, lifted)
    if raw.ndim != 1 or raw.size != values.size:
        raise WireError("malformed", f"layer {name!r}: mask gaps {list(raw.shape)} and values "
                                     f"{list(values.shape)} must be vectors of one length")
    if raw.dtype not in _GAP_DTYPES:
        raise WireError("malformed", f"layer {name!r}: mask gaps must be uint8, uint16 or uint32, got {raw.dtype}")
    if raw.size and int(raw.sum(dtype=np.uint64)) + raw.size > size:
        raise WireError("malformed", f"layer {name!r}: mask gaps run past the mask's {size} entries")
    return np.cumsum(raw.astype(np.int64) + 1) - 1, values


def factorized_weights_to_proto(payload: FactorizedWeights, out: pb.FactorizedWeights,
                                wire_dtype: str | None) -> None:
    """Fill a FactorizedWeights message, layer by layer (``wire_dtype`` narrows u, v and the mask values); each
    mask travels in its smallest form (``mask_encoding``)."""
    out.num_examples = payload.num_examples
    for layer in payload.layers:
        fl = out.layers.add()
        fl.name = layer.name
        _fill_t(fl.u, layer.u, wire_dtype)
        _fill_t(fl.v, layer.v, wire_dtype)
        fl.mask_shape.extend(layer.mask_shape)
        _fill_mask(fl, layer, wire_dtype)


def factorized_weights_from_proto(f: pb.FactorizedWeights, lifted: list[memoryview] | None) -> FactorizedWeights:
    """Decode a FactorizedWeights message; each mask comes back as int64 flat positions and values."""
    layers = []
    for layer in f.layers:
        idx, values = _read_mask(layer, lifted)
        layers.append(FactorizedLayer(layer.name, tensor_from_proto(layer.u, lifted),
                                      tensor_from_proto(layer.v, lifted), idx, values,
                                      tuple(int(d) for d in layer.mask_shape)))
    return FactorizedWeights(tuple(layers), int(f.num_examples))


def criteria_embeddings_to_proto(payload: CriteriaEmbeddings, out: pb.CriteriaEmbeddings,
                                 wire_dtype: str | None) -> None:
    """Fill a CriteriaEmbeddings message."""
    out.criteria_set_id = payload.criteria_set_id
    _fill_t(out.embeddings, payload.embeddings, wire_dtype)


def criteria_embeddings_from_proto(e: pb.CriteriaEmbeddings, lifted: list[memoryview] | None) -> CriteriaEmbeddings:
    """Decode a CriteriaEmbeddings message."""
    return CriteriaEmbeddings(e.criteria_set_id, tensor_from_proto(e.embeddings, lifted))


def eval_metrics_to_proto(payload: EvalMetrics, out: pb.EvalMetrics, wire_dtype: str | None) -> None:
    """Fill an EvalMetrics message (no tensors: ``wire_dtype`` does not apply)."""
    out.CopyFrom(
        pb.EvalMetrics(
            train_loss=payload.train_loss,
            num_train_examples=payload.num_train_examples,
            test_accuracy=payload.test_accuracy,
            test_loss=payload.test_loss,
            num_test_examples=payload.num_test_examples,
            extra=payload.extra,
            withheld=payload.withheld,
        )
    )


def eval_metrics_from_proto(m: pb.EvalMetrics, lifted: list[memoryview] | None) -> EvalMetrics:
    """Decode an EvalMetrics message."""
    return EvalMetrics(float(m.train_loss), int(m.num_train_examples), float(m.test_accuracy), float(m.test_loss),
                       int(m.num_test_examples), dict(m.extra), tuple(m.withheld))


def peer_weights_to_proto(payload: PeerWeights, out: pb.PeerWeights, wire_dtype: str | None) -> None:
    """Fill a PeerWeights message (a handful of weights: ``wire_dtype`` does not narrow them)."""
    out.organizations.extend(payload.organizations)
    _fill(out.weights, payload.weights)


def peer_weights_from_proto(w: pb.PeerWeights, lifted: list[memoryview] | None) -> PeerWeights:
    """Decode a PeerWeights message."""
    return PeerWeights(tuple(w.organizations), tensor_from_proto(w.weights, lifted))

# ------------------------------------------------------------------------------- secure aggregation's stages
# Each stage message maps field for field to its hetfed.secagg dataclass. A decoded message the core would refuse
# to build (a graph seed of the wrong size, parameters that could wrap) is malformed or invalid here.


def _secagg(build: Callable[[], Any]) -> Any:
    """``build()``, a SecAggError it raises becoming the matching WireError."""
    try:
        return build()
    except secagg.SecAggError as exc:
        raise from_secagg(exc) from None


def secagg_setup_to_proto(payload: SecAggSetup, out: pb.SecAggSetup, wire_dtype: str | None) -> None:
    """Fill a SecAggSetup message from its round configuration."""
    c, enc = payload.config, payload.config.encoding
    out.run_id, out.round, out.degree, out.threshold = c.run_id, c.round, c.degree, c.threshold
    out.roster.extend(c.roster)
    out.graph_seed = c.graph_seed
    for f in enc.fields:
        pf = out.fields.add()
        pf.name, pf.bound = f.name, f.bound
        pf.shape.extend(f.shape)
        if f.norm_bound is not None:
            pf.norm_bound = f.norm_bound
    out.value_bits, out.ring_bits, out.max_inputs = enc.value_bits, enc.ring_bits, enc.max_inputs
    out.stochastic, out.unit_weights = enc.stochastic, payload.unit_weights


def secagg_setup_from_proto(m: pb.SecAggSetup, lifted: list[memoryview] | None) -> SecAggSetup:
    """Decode a SecAggSetup message into a checked round configuration."""
    def build() -> secagg.RoundConfig:
        fields = tuple(secagg.Field(f.name, tuple(int(d) for d in f.shape), f.bound,
                                    f.norm_bound if f.HasField("norm_bound") else None) for f in m.fields)
        enc = secagg.Encoding(fields, int(m.value_bits), int(m.ring_bits), int(m.max_inputs), m.stochastic)
        return secagg.RoundConfig(m.run_id, int(m.round), tuple(m.roster), int(m.degree), int(m.threshold),
                                  bytes(m.graph_seed), enc)
    return SecAggSetup(_secagg(build), m.unit_weights)


def _advert_to_proto(a: secagg.KeyAdvert, out: pb.SecAggKeyAdvert) -> None:
    out.run_id, out.round, out.sender = a.run_id, a.round, a.sender
    out.share_public, out.mask_public = a.share_public, a.mask_public


def _advert_from_proto(m: pb.SecAggKeyAdvert) -> secagg.KeyAdvert:
    return secagg.KeyAdvert(m.run_id, int(m.round), m.sender, bytes(m.share_public), bytes(m.mask_public))


def secagg_key_advert_to_proto(payload: SecAggKeyAdvert, out: pb.SecAggKeyAdvert, wire_dtype: str | None) -> None:
    """Fill a SecAggKeyAdvert message."""
    _advert_to_proto(payload.message, out)


def secagg_key_advert_from_proto(m: pb.SecAggKeyAdvert, lifted: list[memoryview] | None) -> SecAggKeyAdvert:
    """Decode a SecAggKeyAdvert message."""
    return SecAggKeyAdvert(_advert_from_proto(m))


def secagg_peer_keys_to_proto(payload: SecAggPeerKeys, out: pb.SecAggPeerKeys, wire_dtype: str | None) -> None:
    """Fill a SecAggPeerKeys message."""
    k = payload.message
    out.run_id, out.round, out.receiver = k.run_id, k.round, k.receiver
    for a in k.peers:
        _advert_to_proto(a, out.peers.add())


def secagg_peer_keys_from_proto(m: pb.SecAggPeerKeys, lifted: list[memoryview] | None) -> SecAggPeerKeys:
    """Decode a SecAggPeerKeys message."""
    return SecAggPeerKeys(secagg.PeerKeys(m.run_id, int(m.round), m.receiver,
                                          tuple(_advert_from_proto(a) for a in m.peers)))


def _sealed_to_proto(shares: tuple[secagg.EncryptedShare, ...], out: Any) -> None:
    for e in shares:
        pe = out.add()
        pe.sender, pe.receiver, pe.ciphertext = e.sender, e.receiver, e.ciphertext


def _sealed_from_proto(shares: Any) -> tuple[secagg.EncryptedShare, ...]:
    return tuple(secagg.EncryptedShare(e.sender, e.receiver, bytes(e.ciphertext)) for e in shares)


def secagg_shared_keys_to_proto(payload: SecAggSharedKeys, out: pb.SecAggSharedKeys, wire_dtype: str | None) -> None:
    """Fill a SecAggSharedKeys message."""
    k = payload.message
    out.run_id, out.round, out.sender = k.run_id, k.round, k.sender
    _sealed_to_proto(k.shares, out.shares)


def secagg_shared_keys_from_proto(m: pb.SecAggSharedKeys, lifted: list[memoryview] | None) -> SecAggSharedKeys:
    """Decode a SecAggSharedKeys message."""
    return SecAggSharedKeys(secagg.SharedKeys(m.run_id, int(m.round), m.sender, _sealed_from_proto(m.shares)))


def secagg_peer_shares_to_proto(payload: SecAggPeerShares, out: pb.SecAggPeerShares, wire_dtype: str | None) -> None:
    """Fill a SecAggPeerShares message."""
    k = payload.message
    out.run_id, out.round, out.receiver = k.run_id, k.round, k.receiver
    _sealed_to_proto(k.shares, out.shares)


def secagg_peer_shares_from_proto(m: pb.SecAggPeerShares, lifted: list[memoryview] | None) -> SecAggPeerShares:
    """Decode a SecAggPeerShares message."""
    return SecAggPeerShares(secagg.PeerShares(m.run_id, int(m.round), m.receiver, _sealed_from_proto(m.shares)))


def secagg_masked_input_to_proto(payload: SecAggMaskedInput, out: pb.SecAggMaskedInput,
                                 wire_dtype: str | None) -> None:
    """Fill a SecAggMaskedInput message: a uint32 vector as it is, a uint64 one as its two little-endian
    uint32 words per element, [n, 2] (a view: nothing is copied here). ``wire_dtype`` does not apply."""
    k = payload.message
    out.run_id, out.round, out.sender = k.run_id, k.round, k.sender
    v = np.asarray(k.vector)
    if v.ndim != 1 or v.dtype not in (np.uint32, np.uint64):
        raise WireError("malformed", f"a masked input is a vector of uint32 or uint64, not {v.dtype}{list(v.shape)}")
    words = v if v.dtype == np.uint32 else np.ascontiguousarray(v, "<u8").view("<u4").reshape(v.size, 2)
    out.vector.SetInParent()
    _fill(out.vector, words)


def secagg_masked_input_from_proto(m: pb.SecAggMaskedInput, lifted: list[memoryview] | None) -> SecAggMaskedInput:
    """Decode a SecAggMaskedInput message (its vector a read-only view of the received bytes)."""
    words = tensor_from_proto(m.vector, lifted)
    if words.dtype != np.uint32 or not (words.ndim == 1 or (words.ndim == 2 and words.shape[1] == 2)):
        raise WireError("malformed", f"a masked input is uint32 [n] or [n, 2], not {words.dtype}{list(words.shape)}")
    vector = words if words.ndim == 1 else words.view("<u8").reshape(words.shape[0]).view(np.uint64)
    return SecAggMaskedInput(secagg.MaskedInput(m.run_id, int(m.round), m.sender, vector))


def secagg_unmask_to_proto(payload: SecAggUnmask, out: pb.SecAggUnmask, wire_dtype: str | None) -> None:
    """Fill a SecAggUnmask message: the request or the reply."""
    k = payload.message
    if isinstance(k, secagg.UnmaskRequest):
        req = out.request
        req.SetInParent()
        req.run_id, req.round, req.receiver = k.run_id, k.round, k.receiver
        req.survivors.extend(k.survivors)
        req.dropped.extend(k.dropped)
        return
    rep = out.reply
    rep.SetInParent()
    rep.run_id, rep.round, rep.sender = k.run_id, k.round, k.sender
    for target, shares in ((rep.seed_shares, k.seed_shares), (rep.key_shares, k.key_shares)):
        for s in shares:
            ps = target.add()
            ps.owner, ps.share = s.owner, s.share


def secagg_unmask_from_proto(m: pb.SecAggUnmask, lifted: list[memoryview] | None) -> SecAggUnmask:
    """Decode a SecAggUnmask message; one that is neither a request nor a reply is malformed."""
    which = m.WhichOneof("message")
    if which == "request":
        q = m.request
        return SecAggUnmask(secagg.UnmaskRequest(q.run_id, int(q.round), q.receiver, tuple(q.survivors),
                                                 tuple(q.dropped)))
    if which == "reply":
        r = m.reply
        seeds = tuple(secagg.RevealedShare(s.owner, bytes(s.share)) for s in r.seed_shares)
        keys = tuple(secagg.RevealedShare(s.owner, bytes(s.share)) for s in r.key_shares)
        return SecAggUnmask(secagg.UnmaskReply(r.run_id, int(r.round), r.sender, seeds, keys))
    raise WireError("malformed", "a secagg_unmask payload is neither a request nor a reply")


_ToProto = Callable[[Any, Any, str | None], None]
_FromProto = Callable[[Any, list[memoryview] | None], Payload]


def _tables() -> tuple[dict[type, tuple[str, _ToProto]], dict[str, _FromProto]]:
    """(payload type -> its field of the Payload oneof and its to_proto, field -> its from_proto), derived from
    the declarations: each member of ``payloads.Payload`` declares its ``kind``, whose value names its oneof
    field and its ``x_to_proto`` / ``x_from_proto`` pair above. A kind missing any of them fails the import."""
    oneof = {f.name for f in pb.Payload.DESCRIPTOR.oneofs_by_name["kind"].fields}
    types = typing.get_args(Payload)
    pairs = globals()
    to_proto: dict[type, tuple[str, _ToProto]] = {}
    from_proto: dict[str, _FromProto] = {}
    for cls in types:
        field = cls.kind.value
        missing = [name for name in (f"{field}_to_proto", f"{field}_from_proto") if name not in pairs]
        if field not in oneof or missing:
            raise RuntimeError(f"payload {cls.__name__}: needs field {field!r} in the Payload oneof of "
                               f"payloads.proto and {' and '.join(missing) or 'its pair'} in hetfed.wire.codec")
        to_proto[cls] = (field, pairs[f"{field}_to_proto"])
        from_proto[field] = pairs[f"{field}_from_proto"]
    undeclared = sorted({k.value for k in PayloadKind} ^ set(from_proto))
    if undeclared or set(from_proto) != oneof:
        raise RuntimeError(f"payload kinds without one class in payloads.Payload, or oneof fields without a kind: "
                           f"{undeclared or sorted(oneof ^ set(from_proto))}")
    return to_proto, from_proto


_TO_PROTO, _FROM_PROTO = _tables()


def _to_proto_of(payload: Payload) -> tuple[str, _ToProto]:
    """The oneof field and to_proto of a payload's type (or of the payload type it derives from)."""
    for cls in type(payload).__mro__:
        entry = _TO_PROTO.get(cls)
        if entry is not None:
            return entry
    raise TypeError(f"not a payload: {type(payload).__name__}")


def _fill_payload(out: pb.Payload, payload: Payload, wire_dtype: str | None) -> pb.Payload:
    field, to_proto = _to_proto_of(payload)
    target = getattr(out, field)
    target.SetInParent()  # the oneof is set even when the payload fills nothing (no tensor, zero counts)
    to_proto(payload, target, wire_dtype)
    return out


def payload_kind_of(message: pb.Payload) -> PayloadKind:
    """The kind of a Payload message; an empty oneof is malformed."""
    which = message.WhichOneof("kind")
    if which is None:
        raise WireError("malformed", "a payload carries no kind (empty oneof)")
    return PayloadKind(which)


def payload_from_proto(message: pb.Payload, lifted: list[memoryview] | None = None) -> Payload:
    """Decode a Payload message into its typed, numpy-backed dataclass (``lifted``: see ``tensor_from_proto``)."""
    field = payload_kind_of(message).value
    return _FROM_PROTO[field](getattr(message, field), lifted)


def payload_to_bytes(payload: Payload) -> bytes:
    """A payload as its serialized Payload message (what a journal keeps of a stage message)."""
    return payload_to_proto(payload).SerializeToString()


def payload_from_bytes(data: bytes) -> Payload:
    """A payload read back from its serialized Payload message (``payload_to_bytes``); ``malformed`` when the
    bytes are not one."""
    message = pb.Payload()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise WireError("malformed", f"not a serialized payload ({exc})") from None
    return payload_from_proto(message)


def tensor_elements(message: pb.Payload) -> int:
    """Number of tensor elements a Payload message carries (without decoding it)."""
    kind = message.WhichOneof("kind")
    if kind is None or kind == "eval_metrics":
        return 0
    total = 0
    stack = [getattr(message, kind)]
    while stack:
        msg = stack.pop()
        for fd, value in msg.ListFields():
            if fd.message_type is None:
                continue
            values = value if fd.is_repeated else [value]
            for v in values:
                if isinstance(v, tpb.Tensor):
                    total += math.prod(v.shape)  # exact Python ints; () -> 1
                else:
                    stack.append(v)
    return total
