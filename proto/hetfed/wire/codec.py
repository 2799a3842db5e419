"""Pure conversions between numpy/dataclass payloads and hetfed.v1 Protobuf messages.

Tensors travel as raw little-endian bytes; encoding is one contiguous copy and decoding is a
zero-copy ``np.frombuffer`` view, so neither loops over elements.
"""

from __future__ import annotations

import numpy as np

from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
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


def wire_dtype_of(array: np.ndarray) -> str:
    """The wire dtype name an array is sent as by default (float64 travels as float32)."""
    kind = array.dtype
    if kind == np.float64 or kind == np.float32:
        return "float32"
    for name, (_, dt) in _WIRE.items():
        if name != "bfloat16" and kind == dt.newbyteorder("="):
            return name
    raise WireError("unsupported_dtype", f"arrays of dtype {kind} cannot be sent")


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


def tensor_to_proto(array: np.ndarray, wire_dtype: str | None = None) -> tpb.Tensor:
    """Encode a numpy array as a Tensor; floats may be narrowed to float16 or bfloat16 for transport."""
    array = np.asarray(array)
    name = wire_dtype or wire_dtype_of(array)
    if name not in _WIRE:
        raise WireError("unsupported_dtype", f"unknown wire dtype {name!r}; expected one of {WIRE_DTYPES}")
    enum, raw = _WIRE[name]
    if name == "bfloat16":
        data = _to_bfloat16_bits(array).tobytes()
    else:
        data = np.ascontiguousarray(array, dtype=raw).tobytes()
    return tpb.Tensor(dtype=enum, shape=array.shape, data=data)  # type: ignore[arg-type]


def tensor_from_proto(tensor: tpb.Tensor) -> np.ndarray:
    """Decode a Tensor into a read-only numpy view of its bytes (bfloat16 widens to float32)."""
    name = dtype_name(tensor.dtype)
    raw = _BY_ENUM[tensor.dtype][1]
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError("malformed", f"tensor shape {shape} has a negative dimension")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(tensor.data) != count * raw.itemsize:
        raise WireError(
            "malformed",
            f"tensor of shape {shape} and dtype {name} needs {count * raw.itemsize} bytes, got {len(tensor.data)}",
        )
    array = np.frombuffer(tensor.data, dtype=raw).reshape(shape)
    if name == "bfloat16":
        array = (array.astype("<u4") << 16).view("<f4")
    return array


def _t(array: np.ndarray, wire_dtype: str | None, *, floats: bool = True) -> tpb.Tensor:
    """Encode with the transport dtype applied to floating arrays only."""
    if wire_dtype is not None and floats and np.asarray(array).dtype.kind == "f":
        return tensor_to_proto(array, wire_dtype)
    return tensor_to_proto(array)


def payload_to_proto(payload: Payload, wire_dtype: str | None = None) -> pb.Payload:
    """Encode a typed payload; ``wire_dtype`` narrows floating tensors for transport."""
    if isinstance(payload, ModelWeights):
        msg = pb.ModelWeights(num_examples=payload.num_examples)
        for name, arr in payload.tensors.items():
            msg.tensors.add(name=name, tensor=_t(arr, wire_dtype))
        return pb.Payload(model_weights=msg)
    if isinstance(payload, HeadWeights):
        return pb.Payload(
            head_weights=pb.HeadWeights(
                weight=_t(payload.weight, wire_dtype),
                bias=_t(payload.bias, wire_dtype),
                num_examples=payload.num_examples,
            )
        )
    if isinstance(payload, ClassCounts):
        return pb.Payload(class_counts=pb.ClassCounts(counts=tensor_to_proto(payload.counts)))
    if isinstance(payload, ClassMeanEmbeddings):
        return pb.Payload(
            class_mean_embeddings=pb.ClassMeanEmbeddings(
                labels=tensor_to_proto(payload.labels),
                means=_t(payload.means, wire_dtype),
                counts=tensor_to_proto(payload.counts),
                presence=tensor_to_proto(payload.presence),
            )
        )
    if isinstance(payload, SeedPosteriors):
        return pb.Payload(
            seed_posteriors=pb.SeedPosteriors(
                seed_set_id=payload.seed_set_id,
                indices=tensor_to_proto(payload.indices),
                probabilities=_t(payload.probabilities, wire_dtype),
                teaching_confidence=payload.teaching_confidence,
                source_organization=payload.source_organization,
            )
        )
    if isinstance(payload, FactorizedWeights):
        fmsg = pb.FactorizedWeights(num_examples=payload.num_examples)
        for layer in payload.layers:
            fmsg.layers.add(
                name=layer.name,
                u=_t(layer.u, wire_dtype),
                v=_t(layer.v, wire_dtype),
                mask_indices=tensor_to_proto(layer.mask_indices),
                mask_values=_t(layer.mask_values, wire_dtype),
                mask_shape=list(layer.mask_shape),
            )
        return pb.Payload(factorized_weights=fmsg)
    if isinstance(payload, CriteriaEmbeddings):
        return pb.Payload(
            criteria_embeddings=pb.CriteriaEmbeddings(
                criteria_set_id=payload.criteria_set_id, embeddings=_t(payload.embeddings, wire_dtype)
            )
        )
    if isinstance(payload, EvalMetrics):
        return pb.Payload(
            eval_metrics=pb.EvalMetrics(
                train_loss=payload.train_loss,
                num_train_examples=payload.num_train_examples,
                test_accuracy=payload.test_accuracy,
                test_loss=payload.test_loss,
                num_test_examples=payload.num_test_examples,
                extra=payload.extra,
            )
        )
    raise TypeError(f"not a payload: {type(payload).__name__}")


def payload_kind_of(message: pb.Payload) -> PayloadKind:
    """The kind of a Payload message; an empty oneof is malformed."""
    which = message.WhichOneof("kind")
    if which is None:
        raise WireError("malformed", "a payload carries no kind (empty oneof)")
    return PayloadKind(which)


def payload_from_proto(message: pb.Payload) -> Payload:
    """Decode a Payload message into its typed, numpy-backed dataclass."""
    kind = payload_kind_of(message)
    if kind is PayloadKind.MODEL_WEIGHTS:
        m = message.model_weights
        names = [t.name for t in m.tensors]
        if len(set(names)) != len(names):
            raise WireError("malformed", "model weights name a tensor twice")
        return ModelWeights({t.name: tensor_from_proto(t.tensor) for t in m.tensors}, int(m.num_examples))
    if kind is PayloadKind.HEAD_WEIGHTS:
        h = message.head_weights
        return HeadWeights(tensor_from_proto(h.weight), tensor_from_proto(h.bias), int(h.num_examples))
    if kind is PayloadKind.CLASS_COUNTS:
        return ClassCounts(tensor_from_proto(message.class_counts.counts))
    if kind is PayloadKind.CLASS_MEAN_EMBEDDINGS:
        c = message.class_mean_embeddings
        return ClassMeanEmbeddings(
            tensor_from_proto(c.labels),
            tensor_from_proto(c.means),
            tensor_from_proto(c.counts),
            tensor_from_proto(c.presence),
        )
    if kind is PayloadKind.SEED_POSTERIORS:
        s = message.seed_posteriors
        return SeedPosteriors(
            s.seed_set_id,
            tensor_from_proto(s.indices),
            tensor_from_proto(s.probabilities),
            float(s.teaching_confidence),
            s.source_organization,
        )
    if kind is PayloadKind.FACTORIZED_WEIGHTS:
        f = message.factorized_weights
        layers = tuple(
            FactorizedLayer(
                layer.name,
                tensor_from_proto(layer.u),
                tensor_from_proto(layer.v),
                tensor_from_proto(layer.mask_indices),
                tensor_from_proto(layer.mask_values),
                tuple(int(d) for d in layer.mask_shape),
            )
            for layer in f.layers
        )
        return FactorizedWeights(layers, int(f.num_examples))
    if kind is PayloadKind.CRITERIA_EMBEDDINGS:
        e = message.criteria_embeddings
        return CriteriaEmbeddings(e.criteria_set_id, tensor_from_proto(e.embeddings))
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
                    total += int(np.prod(v.shape, dtype=np.int64)) if len(v.shape) else 1
                else:
                    stack.append(v)
    return total
