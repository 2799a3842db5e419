"""Contract checks: every message a run receives is checked against its algorithm's declared contract."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import codec
from hetfed.wire.errors import WireError
from hetfed.wire.pages import drop_pages
from hetfed.wire.payloads import EvalMetrics, Payload, PayloadKind, Received, SeedPosteriors, named_tensors
from hetfed.wire.phases import Phase
from hetfed.wire.specs import AlgorithmSpec


@dataclass(frozen=True)
class TensorDecl:
    """The declared wire dtype and shape of one tensor."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DeclaredTensor:
    """A tensor a client will upload in every round, declared when it joins."""

    kind: PayloadKind
    name: str
    decl: TensorDecl

    @classmethod
    def of(cls, kind: PayloadKind, name: str, array: np.ndarray, wire_dtype: str | None = None) -> DeclaredTensor:
        """The declaration of ``array`` as it will be sent (``wire_dtype`` narrows floating tensors)."""
        dtype = wire_dtype if (wire_dtype and array.dtype.kind == "f") else codec.wire_dtype_of(array)
        return cls(kind, name, TensorDecl(dtype, tuple(int(d) for d in array.shape)))


# payload kind -> tensor name -> declaration
Schema = dict[PayloadKind, dict[str, TensorDecl]]


def schema_from_declared(declared: Iterable[DeclaredTensor], spec: AlgorithmSpec) -> Schema:
    """The schema a joining client declares for the kinds the run shares; other kinds are ignored."""
    schema: Schema = {}
    for d in declared:
        if d.kind not in spec.shared_schema:
            continue
        if d.kind not in spec.upload:
            raise WireError("payload_kind_not_allowed", f"{spec.name} does not accept {d.kind.value} uploads")
        entry = schema.setdefault(d.kind, {})
        if d.name in entry:
            raise WireError("malformed", f"tensor {d.name!r} declared twice for {d.kind.value}")
        entry[d.name] = d.decl
    for kind in spec.shared_schema:
        if kind not in schema:
            raise WireError("missing_payload", f"{spec.name} needs the {kind.value} tensors declared at join")
    return schema


def schema_to_json(schema: Schema) -> dict[str, dict[str, list[Any]]]:
    """A JSON-ready form of a schema (for checkpoints)."""
    return {k.value: {n: [d.dtype, list(d.shape)] for n, d in t.items()} for k, t in schema.items()}


def schema_from_json(data: dict[str, dict[str, list[Any]]]) -> Schema:
    """Inverse of ``schema_to_json``."""
    return {PayloadKind(k): {n: TensorDecl(str(d[0]), tuple(int(x) for x in d[1])) for n, d in t.items()}
            for k, t in data.items()}


def check_same_schema(run_schema: Schema, declared: Schema) -> None:
    """A joining client's declaration must equal the run's schema, tensor by tensor."""
    for kind, tensors in run_schema.items():
        theirs = declared.get(kind, {})
        missing = sorted(set(tensors) - set(theirs))
        extra = sorted(set(theirs) - set(tensors))
        if missing or extra:
            raise WireError(
                "schema_mismatch",
                f"{kind.value}: tensors differ from the run's (missing {missing[:5]}, unexpected {extra[:5]})",
            )
        for name, decl in tensors.items():
            if theirs[name] != decl:
                raise WireError(
                    "schema_mismatch",
                    f"{kind.value}.{name}: declared {theirs[name].dtype}{list(theirs[name].shape)}, "
                    f"the run has {decl.dtype}{list(decl.shape)}",
                )


def _proto_tensors(message: pb.Payload) -> dict[str, tpb.Tensor]:
    kind = message.WhichOneof("kind")
    if kind == "model_weights":
        return {t.name: t.tensor for t in message.model_weights.tensors}
    if kind == "head_weights":
        return {"weight": message.head_weights.weight, "bias": message.head_weights.bias}
    return {}


def _check_schema(kind: PayloadKind, message: pb.Payload, schema: dict[str, TensorDecl]) -> None:
    tensors = _proto_tensors(message)
    missing = sorted(set(schema) - set(tensors))
    extra = sorted(set(tensors) - set(schema))
    if missing or extra:
        raise WireError(
            "shape_mismatch", f"{kind.value}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}"
        )
    for name, decl in schema.items():
        t = tensors[name]
        got = codec.dtype_name(t.dtype)
        if got != decl.dtype:
            raise WireError("dtype_mismatch", f"{kind.value}.{name}: dtype {got}, the run declared {decl.dtype}")
        shape = tuple(int(s) for s in t.shape)
        if shape != decl.shape:
            raise WireError(
                "shape_mismatch", f"{kind.value}.{name}: shape {list(shape)}, the run declared {list(decl.shape)}"
            )


def check_envelope(update: apb.Update, run_id: str, round_: int, organization: str) -> None:
    """An update's envelope against the stream's addressing and against the payload kinds the update carries."""
    env = update.envelope
    if env.run_id != run_id or env.round != round_ or env.organization_id != organization:
        raise WireError(
            "envelope_mismatch",
            f"envelope says run {env.run_id[:64]!r} round {env.round} organization {env.organization_id[:64]!r}; "
            f"the stream is for run {run_id!r} round {round_} organization {organization!r}",
        )
    try:
        declared = [PayloadKind.from_proto_enum(k).value for k in env.payload_kinds]
    except ValueError as exc:
        raise WireError("malformed", f"the envelope lists an unknown payload kind: {exc}") from None
    actual = [codec.payload_kind_of(p).value for p in update.payloads]
    if declared != actual:
        raise WireError("envelope_mismatch", f"envelope lists {declared[:8]}, the update carries {actual[:8]}")


# Elements of a tensor the finiteness check takes at a time: its mask stays 1 MiB whatever the tensor's size.
FINITE_BLOCK = 1 << 20


def _all_finite(array: np.ndarray) -> bool:
    """Whether every value is finite, a block at a time (no mask the size of the tensor). A block that views a
    read-only file mapping (a push received into its spool file) gives its pages back once checked."""
    flat = array.reshape(-1)
    for lo in range(0, flat.size, FINITE_BLOCK):
        block = flat[lo:lo + FINITE_BLOCK]
        finite = bool(np.isfinite(block).all())
        drop_pages(block)
        if not finite:
            return False
    return True


def check_finite(kind: PayloadKind, payload: Payload) -> None:
    """Reject NaN or infinite values in any floating tensor or metric."""
    for name, array in named_tensors(payload):
        if array.dtype.kind == "f" and not _all_finite(array):
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise WireError("non_finite", f"{kind.value}.{name} holds {bad} NaN or infinite values")
    if isinstance(payload, EvalMetrics):
        values = {"train_loss": payload.train_loss, "test_accuracy": payload.test_accuracy,
                  "test_loss": payload.test_loss, **payload.extra}
        for name, v in values.items():
            if not math.isfinite(v):
                raise WireError("non_finite", f"eval_metrics.{name} is {v}")
    if isinstance(payload, SeedPosteriors) and not math.isfinite(payload.teaching_confidence):
        raise WireError("non_finite", f"seed_posteriors.teaching_confidence is {payload.teaching_confidence}")


def check_update(
    spec: AlgorithmSpec,
    phase: Phase,
    messages: Sequence[pb.Payload],
    schema: Schema,
    max_elements: int,
    lifted: list[memoryview] | None = None,
    scan: bool = True,
    secure: bool = False,
) -> Received:
    """Check an update's payloads against the contract and decode them; raises WireError. ``secure``: the run
    aggregates securely (``AlgorithmSpec.uploads``).

    ``lifted``: the update was parsed with its tensors' data lifted out (``codec.tensor_from_proto``).
    ``scan=False`` skips the one check that reads every value (finiteness): for bytes that passed it already,
    such as the logged copy of an accepted update, read again without paging all of it in."""
    allowed, required = spec.uploads(phase, secure)
    kinds: list[PayloadKind] = []
    for m in messages:
        kind = codec.payload_kind_of(m)
        if kind not in allowed:
            allowed_names = ", ".join(sorted(k.value for k in allowed)) or "nothing"
            raise WireError(
                "payload_kind_not_allowed",
                f"{spec.name} does not accept {kind.value} in its {phase.value} phase (allowed: {allowed_names})",
            )
        if kind in kinds:
            raise WireError("duplicate_payload", f"the update carries two {kind.value} payloads")
        kinds.append(kind)
    missing = sorted(k.value for k in required - set(kinds))
    if missing:
        raise WireError("missing_payload", f"{spec.name} {phase.value} updates must carry {', '.join(missing)}")
    elements = sum(codec.tensor_elements(m) for m in messages)
    if elements > max_elements:
        raise WireError("oversized", f"the update carries {elements} tensor elements, the limit is {max_elements}")
    decoded: list[Payload] = []
    for kind, m in zip(kinds, messages, strict=True):
        if kind in schema:
            _check_schema(kind, m, schema[kind])
        payload = codec.payload_from_proto(m, lifted)
        if scan:
            check_finite(kind, payload)
        decoded.append(payload)
    return Received(decoded)


def check_download(spec: AlgorithmSpec, messages: Sequence[pb.Payload],
                   lifted: list[memoryview] | None = None) -> Received:
    """A client's check of what the aggregator sends: only the spec's download kinds, finite values
    (``lifted``: as in ``check_update``)."""
    out = []
    for m in messages:
        kind = codec.payload_kind_of(m)
        if kind not in spec.download:
            raise WireError("payload_kind_not_allowed", f"{spec.name} never receives {kind.value}")
        payload = codec.payload_from_proto(m, lifted)
        check_finite(kind, payload)
        out.append(payload)
    return Received(out, repeated=spec.repeated_download)
