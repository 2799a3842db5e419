"""Pure conversions between numpy/dataclass payloads and hetfed.v1 Protobuf messages.

Tensors travel as raw little-endian bytes and no function loops over elements. Encoding copies a
tensor twice (array -> ``bytes`` -> the message; Protobuf's bytes setter accepts nothing else) and
fills every payload message in place, never through a constructor or ``add(tensor=...)`` that
would copy the finished sub-message once more. Decoding reads each ``data`` field once (every read
of a bytes field is a fresh copy) and returns a read-only ``np.frombuffer`` view of that copy.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from google.protobuf.message import EncodeError

from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import framing
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
    SeedPosteriors,
    named_tensors,
)

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


def _to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even) and return the 16-bit patterns."""
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
    rounding = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding) >> 16).astype("<u2")
    nan = np.isnan(array)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _encode(array: np.ndarray, wire_dtype: str | None) -> tuple[int, tuple[int, ...], bytes]:
    """(dtype enum, shape, little-endian C-order bytes) of ``array`` sent as ``wire_dtype``."""
    array = np.asarray(array)
    name = wire_dtype or wire_dtype_of(array)
    if name not in _WIRE:
        raise WireError("unsupported_dtype", f"unknown wire dtype {name!r}; expected one of {WIRE_DTYPES}")
    enum, raw = _WIRE[name]
    n_bytes = array.size * raw.itemsize
    if n_bytes > MAX_TENSOR_BYTES:
        raise WireError(
            "oversized",
            f"a tensor of shape {list(array.shape)} takes {n_bytes} bytes as {name}; one tensor may take at most "
            f"{MAX_TENSOR_BYTES} bytes (Protobuf's limit on one bytes field): split it into smaller tensors",
        )
    # Narrowing may overflow to +-inf by design (IEEE rounding); the receiver's finiteness check decides.
    with np.errstate(over="ignore"):
        if name == "bfloat16":
            data = _to_bfloat16_bits(array).tobytes()
        else:
            data = np.ascontiguousarray(array, dtype=raw).tobytes()
    return enum, array.shape, data


def _fill(target: tpb.Tensor, array: np.ndarray, wire_dtype: str | None = None) -> None:
    """Encode ``array`` into an existing (empty) Tensor field in place."""
    enum, shape, data = _encode(array, wire_dtype)
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
    for _, a in named_tensors(payload):
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


def _fill_payload(out: pb.Payload, payload: Payload, wire_dtype: str | None) -> pb.Payload:
    if isinstance(payload, ModelWeights):
        mw = out.model_weights
        mw.SetInParent()
        mw.num_examples = payload.num_examples
        for name, arr in payload.tensors.items():
            nt = mw.tensors.add()
            nt.name = name
            nt.tensor.SetInParent()
            _fill_t(nt.tensor, arr, wire_dtype)
        return out
    if isinstance(payload, HeadWeights):
        hw = out.head_weights
        hw.SetInParent()
        _fill_t(hw.weight, payload.weight, wire_dtype)
        _fill_t(hw.bias, payload.bias, wire_dtype)
        hw.num_examples = payload.num_examples
        return out
    if isinstance(payload, ClassCounts):
        out.class_counts.SetInParent()
        _fill(out.class_counts.counts, payload.counts)
        return out
    if isinstance(payload, ClassMeanEmbeddings):
        ce = out.class_mean_embeddings
        ce.SetInParent()
        _fill(ce.labels, payload.labels)
        _fill_t(ce.means, payload.means, wire_dtype)
        _fill(ce.counts, payload.counts)
        _fill(ce.presence, payload.presence)
        return out
    if isinstance(payload, SeedPosteriors):
        sp = out.seed_posteriors
        sp.SetInParent()
        sp.seed_set_id = payload.seed_set_id
        _fill(sp.indices, payload.indices)
        _fill_t(sp.probabilities, payload.probabilities, wire_dtype)
        sp.teaching_confidence = payload.teaching_confidence
        sp.source_organization = payload.source_organization
        return out
    if isinstance(payload, FactorizedWeights):
        fw = out.factorized_weights
        fw.SetInParent()
        fw.num_examples = payload.num_examples
        for layer in payload.layers:
            fl = fw.layers.add()
            fl.name = layer.name
            _fill_t(fl.u, layer.u, wire_dtype)
            _fill_t(fl.v, layer.v, wire_dtype)
            _fill(fl.mask_indices, layer.mask_indices)
            _fill_t(fl.mask_values, layer.mask_values, wire_dtype)
            fl.mask_shape.extend(layer.mask_shape)
        return out
    if isinstance(payload, CriteriaEmbeddings):
        cr = out.criteria_embeddings
        cr.SetInParent()
        cr.criteria_set_id = payload.criteria_set_id
        _fill_t(cr.embeddings, payload.embeddings, wire_dtype)
        return out
    if isinstance(payload, EvalMetrics):
        out.eval_metrics.SetInParent()
        out.eval_metrics.CopyFrom(
            pb.EvalMetrics(
                train_loss=payload.train_loss,
                num_train_examples=payload.num_train_examples,
                test_accuracy=payload.test_accuracy,
                test_loss=payload.test_loss,
                num_test_examples=payload.num_test_examples,
                extra=payload.extra,
            )
        )
        return out
    raise TypeError(f"not a payload: {type(payload).__name__}")


def payload_kind_of(message: pb.Payload) -> PayloadKind:
    """The kind of a Payload message; an empty oneof is malformed."""
    which = message.WhichOneof("kind")
    if which is None:
        raise WireError("malformed", "a payload carries no kind (empty oneof)")
    return PayloadKind(which)


def payload_from_proto(message: pb.Payload, lifted: list[memoryview] | None = None) -> Payload:
    """Decode a Payload message into its typed, numpy-backed dataclass (``lifted``: see ``tensor_from_proto``)."""
    tensor = functools.partial(tensor_from_proto, lifted=lifted)
    kind = payload_kind_of(message)
    if kind is PayloadKind.MODEL_WEIGHTS:
        m = message.model_weights
        names = [t.name for t in m.tensors]
        if len(set(names)) != len(names):
            raise WireError("malformed", "model weights name a tensor twice")
        return ModelWeights({t.name: tensor(t.tensor) for t in m.tensors}, int(m.num_examples))
    if kind is PayloadKind.HEAD_WEIGHTS:
        h = message.head_weights
        return HeadWeights(tensor(h.weight), tensor(h.bias), int(h.num_examples))
    if kind is PayloadKind.CLASS_COUNTS:
        return ClassCounts(tensor(message.class_counts.counts))
    if kind is PayloadKind.CLASS_MEAN_EMBEDDINGS:
        c = message.class_mean_embeddings
        return ClassMeanEmbeddings(
            tensor(c.labels),
            tensor(c.means),
            tensor(c.counts),
            tensor(c.presence),
        )
    if kind is PayloadKind.SEED_POSTERIORS:
        s = message.seed_posteriors
        return SeedPosteriors(
            s.seed_set_id,
            tensor(s.indices),
            tensor(s.probabilities),
            float(s.teaching_confidence),
            s.source_organization,
        )
    if kind is PayloadKind.FACTORIZED_WEIGHTS:
        f = message.factorized_weights
        layers = tuple(
            FactorizedLayer(
                layer.name,
                tensor(layer.u),
                tensor(layer.v),
                tensor(layer.mask_indices),
                tensor(layer.mask_values),
                tuple(int(d) for d in layer.mask_shape),
            )
            for layer in f.layers
        )
        return FactorizedWeights(layers, int(f.num_examples))
    if kind is PayloadKind.CRITERIA_EMBEDDINGS:
        e = message.criteria_embeddings
        return CriteriaEmbeddings(e.criteria_set_id, tensor(e.embeddings))
    m2 = message.eval_metrics
    return EvalMetrics(
        float(m2.train_loss),
        int(m2.num_train_examples),
        float(m2.test_accuracy),
        float(m2.test_loss),
        int(m2.num_test_examples),
        dict(m2.extra),
    )


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
