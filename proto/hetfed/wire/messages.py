"""Typed messages of the Aggregator service and pure conversions to and from hetfed.v1 Protobuf.

The round engine and the client runtime work with these dataclasses only; this module (with ``rpc``) is the
boundary where Protobuf is built and parsed. Updates and instructions travel as serialized bytes split into
chunks; ``ParsedUpdate`` and ``encode_instructions`` / ``decode_instructions`` convert them. What a received
message must satisfy (envelope, payload kinds, schema, finite values) is checked in ``contract``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import codec, contract, framing
from hetfed.wire.chunks import Bytes
from hetfed.wire.config import ConfigError, to_mapping
from hetfed.wire.errors import MAX_LEAVE_REASON_CHARS, WireError
from hetfed.wire.payloads import EvalMetrics, Payload, PayloadKind, Received
from hetfed.wire.phases import Action, Phase
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.serialize import Placed, Scattered, layout, serialize, serialize_scattered
from hetfed.wire.specs import AlgorithmSpec, TrainConfig, get_spec
from hetfed.wire.traffic import Direction, KindCount, TrafficBreakdown, field_sizes, payload_breakdown

_Lifted = TypeVar("_Lifted", apb.Update, apb.Instructions)
_TENSOR_DATA = tpb.Tensor.DESCRIPTOR.fields_by_name["data"].number


def _parse_lifted(cls: type[_Lifted], data: Bytes, what: str) -> tuple[_Lifted, list[memoryview]]:
    """``data`` parsed as ``cls`` with every tensor's data lifted out as views of ``data`` (``framing.lift``):
    protobuf copies the message's small fields, not its tensors."""
    view = memoryview(data).toreadonly().cast("B")
    try:
        small, lifted = framing.lift(view, cls.DESCRIPTOR, tpb.Tensor.DESCRIPTOR, _TENSOR_DATA)
        return cls.FromString(small), lifted
    except (ValueError, DecodeError) as exc:
        raise WireError("malformed", f"{what} not a valid {cls.DESCRIPTOR.full_name}: {exc}") from None


# ---------------------------------------------------------------------------------------------- Join


@dataclass(frozen=True)
class Fingerprint:
    """Identifies a data set both sides hold (a shared seed set): its id and SHA-256."""

    id: str
    sha256: str


@dataclass(frozen=True)
class JoinRequest:
    """An organization asks to take part in a run (and, when the run shares a schema, declares its tensors)."""

    run_id: str
    organization: str = ""
    declared: tuple[contract.DeclaredTensor, ...] = ()
    seed_set: Fingerprint | None = None
    num_train_examples: int = 0
    # The label count and the shape of one input its model and data are built for (0 / (): not declared).
    num_classes: int = 0
    input_shape: tuple[int, ...] = ()


def encode_config(config: TrainConfig) -> str:
    """The run's algorithm config as a Join reply carries it: every field of the spec's typed config as JSON.

    JSON, not a Protobuf message per algorithm: the config dataclass is the schema, each algorithm's in one place,
    and its loader checks names, types (an int stays an int) and ranges exactly as it checks a file."""
    return json.dumps(to_mapping(config), sort_keys=True)


def decode_config(algorithm: str, config_json: str, where: str) -> TrainConfig:
    """The typed config ``encode_config`` wrote, parsed by ``algorithm``'s spec: the client's one parse of it.

    Raises ConfigError, naming ``where`` (an algorithm this client does not know, a field it does not know)."""
    try:
        spec = get_spec(algorithm)
        data = json.loads(config_json)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise ConfigError(f"{where}: {exc}") from None
    return spec.parse(data, where)


@dataclass(frozen=True)
class JoinReply:
    """The run's algorithm, configuration, current round, seed and participants."""

    run_id: str
    algorithm: str
    # The algorithm's config as ``encode_config`` writes it; ``config`` is its typed form.
    config_json: str
    current_round: int
    total_rounds: int
    seed: int
    organizations: tuple[str, ...]
    # The run still needs this organization's tensor declaration: join again with ``declared``.
    declare_required: bool = False
    # The aggregator answers a push's headers once it is admitted (``rpc.PUSH_ADMITTED_METADATA_KEY``).
    push_admission_headers: bool = False
    # The run sums its uploads under secure aggregation (its rounds use the SecureStage RPC).
    secure_aggregation: bool = False

    @functools.cached_property
    def config(self) -> TrainConfig:
        """The run's typed algorithm config, decoded on first use and kept (a reply's config is parsed once;
        a reply read only for its other fields, as a second Join's, is not parsed at all)."""
        return decode_config(self.algorithm, self.config_json, f"runs[{self.run_id}].algorithm_config")


def join_request_to_proto(req: JoinRequest) -> apb.JoinRequest:
    """Encode a JoinRequest."""
    msg = apb.JoinRequest(run_id=req.run_id, organization_id=req.organization,
                          num_train_examples=req.num_train_examples, num_classes=req.num_classes,
                          input_shape=req.input_shape)
    if req.seed_set is not None:
        msg.seed_set.id, msg.seed_set.sha256 = req.seed_set.id, req.seed_set.sha256
    for d in req.declared:
        msg.declared_tensors.add(payload_kind=d.kind.proto_enum,  # type: ignore[arg-type]
                                 name=d.name, dtype=codec.dtype_enum(d.decl.dtype),  # type: ignore[arg-type]
                                 shape=d.decl.shape)
    return msg


def join_request_from_proto(msg: apb.JoinRequest) -> JoinRequest:
    """Decode a JoinRequest; an unknown payload kind or dtype in a declaration is malformed."""
    declared = []
    for d in msg.declared_tensors:
        try:
            kind = PayloadKind.from_proto_enum(d.payload_kind)
        except ValueError:
            raise WireError("malformed", f"declared tensor {d.name[:64]!r} has an unknown payload kind") from None
        declared.append(contract.DeclaredTensor(
            kind, d.name, contract.TensorDecl(codec.dtype_name(d.dtype), tuple(int(s) for s in d.shape))))
    seed_set = Fingerprint(msg.seed_set.id, msg.seed_set.sha256) if msg.HasField("seed_set") else None
    return JoinRequest(msg.run_id, msg.organization_id, tuple(declared), seed_set, int(msg.num_train_examples),
                       int(msg.num_classes), tuple(int(s) for s in msg.input_shape))


def join_reply_to_proto(reply: JoinReply) -> apb.JoinResponse:
    """Encode a JoinReply."""
    return apb.JoinResponse(
        run_id=reply.run_id, algorithm=reply.algorithm, algorithm_config_json=reply.config_json,
        current_round=reply.current_round, total_rounds=reply.total_rounds, seed=reply.seed,
        organizations=list(reply.organizations), declare_required=reply.declare_required,
        push_admission_headers=reply.push_admission_headers, secure_aggregation=reply.secure_aggregation,
    )


def join_reply_from_proto(msg: apb.JoinResponse) -> JoinReply:
    """Decode a JoinResponse."""
    return JoinReply(msg.run_id, msg.algorithm, msg.algorithm_config_json, int(msg.current_round),
                     int(msg.total_rounds), int(msg.seed), tuple(msg.organizations), bool(msg.declare_required),
                     bool(msg.push_admission_headers), bool(msg.secure_aggregation))


# ---------------------------------------------------------------------------------------------- Pull


@dataclass(frozen=True)
class PullRequest:
    """A long-poll for an organization's next instructions."""

    run_id: str
    organization: str
    # The last round this organization completed (pushed); -1 before its first.
    completed_round: int
    wait_seconds: float


def pull_request_to_proto(req: PullRequest) -> apb.PullInstructionsRequest:
    """Encode a PullRequest."""
    return apb.PullInstructionsRequest(run_id=req.run_id, organization_id=req.organization,
                                       completed_round=req.completed_round, wait_seconds=req.wait_seconds)


def pull_request_from_proto(msg: apb.PullInstructionsRequest) -> PullRequest:
    """Decode a PullInstructionsRequest; a wait that is not a finite number >= 0 is malformed."""
    wait = float(msg.wait_seconds)
    if not math.isfinite(wait) or wait < 0:
        raise WireError("malformed", f"wait_seconds must be a finite number >= 0, got {wait}")
    return PullRequest(msg.run_id, msg.organization_id, int(msg.completed_round), wait)


@dataclass
class Instructions:
    """What an organization must do next, with the payloads of its round."""

    run_id: str
    round: int
    action: Action
    total_rounds: int
    round_seed: int = 0
    # Empty when the same instructions go to every organization (broadcast).
    organization: str = ""
    payloads: Sequence[Payload] = ()


# Field numbers of the payloads in the two messages that carry them, for ``field_sizes``.
_INSTRUCTIONS_PAYLOADS = apb.Instructions.DESCRIPTOR.fields_by_name["payloads"].number
_UPDATE_PAYLOADS = apb.Update.DESCRIPTOR.fields_by_name["payloads"].number


def _payload_sizes(data: Bytes, number: int) -> list[int]:
    """Each payload's serialized length in a received message that protobuf parsed already."""
    try:
        return field_sizes(data, number)
    except ValueError as exc:  # protobuf accepted it: not reached unless the two readers disagree
        raise WireError("malformed", f"the message's fields cannot be measured: {exc}") from None


_ACTION_TO_PROTO = {Action.WAIT: apb.ACTION_WAIT, Action.SETUP: apb.ACTION_SETUP, Action.TRAIN: apb.ACTION_TRAIN,
                    Action.EVALUATE: apb.ACTION_EVALUATE, Action.FINISH: apb.ACTION_FINISH}
_ACTION_FROM_PROTO = {v: k for k, v in _ACTION_TO_PROTO.items()}


@dataclass(frozen=True)
class Encoded:
    """A serialized message and the traffic of the payloads it carries (the envelope not included).

    ``data`` is a read-only view of the one buffer ``serialize`` wrote (``bytes(data)`` copies it), or the
    message in pieces (``serialize.Scattered``: instructions that view the global model's arrays)."""

    data: Bytes | Scattered
    payloads: TrafficBreakdown = field(default_factory=TrafficBreakdown)


@dataclass(frozen=True)
class Pulled:
    """Instructions to send and the round they belong to; ``encoded`` may be shared by every organization."""

    encoded: Encoded
    round: int
    # A WAIT answered to a long-poll that expired: how often that happens depends on timing alone, so its bytes
    # are counted in the metrics but not in the round's record (a run's table repeats with its seed).
    waiting: bool = False


def encode_instructions(ins: Instructions, wire_dtype: str | None = None, scattered: bool = False) -> Encoded:
    """Serialize instructions as ``encode_update`` does an update: one buffer, each tensor copied once into it
    (``wire_dtype`` narrows floats). ``scattered``: kept in pieces instead (``serialize.Scattered``), each
    tensor that goes on the wire as its array is viewed, not copied; only a narrowed one is converted."""
    msg = apb.Instructions(
        envelope=apb.Envelope(run_id=ins.run_id, round=ins.round, organization_id=ins.organization),
        action=_ACTION_TO_PROTO[ins.action],  # type: ignore[arg-type]
        round_seed=ins.round_seed,
        total_rounds=ins.total_rounds,
    )
    sources: list[Placed] = []
    for p in ins.payloads:
        codec.fill_payload_placed(msg.payloads.add(), p, sources, wire_dtype)  # placeholders: no tensor copied
        msg.envelope.payload_kinds.append(p.kind.proto_enum)  # type: ignore[arg-type]
    if scattered:
        sizes = [s.nbytes for s in sources]
        pieces = serialize_scattered(msg, sources)
        return Encoded(pieces, payload_breakdown(msg.payloads, [
            layout(p.SerializeToString(), pb.Payload.DESCRIPTOR, sizes)[1] for p in msg.payloads])
            if ins.payloads else TrafficBreakdown())
    data = serialize(msg, sources)  # each tensor copied once, into its place
    return Encoded(data, payload_breakdown(msg.payloads, field_sizes(data, _INSTRUCTIONS_PAYLOADS))
                   if ins.payloads else TrafficBreakdown())


def decode_instructions(data: Bytes, spec: AlgorithmSpec | None) -> tuple[Instructions, TrafficBreakdown]:
    """Parse instructions and check their payloads against ``spec``'s download contract (a client's view)."""
    msg, lifted = _parse_lifted(apb.Instructions, data, "instructions are")
    action = _ACTION_FROM_PROTO.get(msg.action)  # type: ignore[call-overload]
    if action is None:
        raise WireError("malformed", f"unknown action {msg.action} in instructions")
    payloads: Received | tuple[Payload, ...] = ()
    if msg.payloads:
        if spec is None:
            raise WireError("malformed", "instructions carry payloads before the algorithm is known")
        payloads = contract.check_download(spec, msg.payloads, lifted)
    env = msg.envelope
    ins = Instructions(env.run_id, int(env.round), action, int(msg.total_rounds), int(msg.round_seed),
                       env.organization_id, tuple(payloads))
    return ins, (payload_breakdown(msg.payloads, _payload_sizes(data, _INSTRUCTIONS_PAYLOADS)) if msg.payloads
                 else TrafficBreakdown())


# ---------------------------------------------------------------------------------------------- Push


@dataclass
class Update:
    """An organization's contribution to one round."""

    run_id: str
    round: int
    organization: str
    payloads: Sequence[Payload]
    # The differential privacy protecting the payloads (docs/privacy.md); None: the client declares none.
    privacy: PrivacyDeclaration | None = None
    # Set: a leave notice (no payloads). The organization leaves the run for this reason, such as its local
    # training having diverged; the aggregator refuses it ``organization_left`` and stops waiting for it.
    leave_reason: str = ""


def privacy_to_proto(d: PrivacyDeclaration, out: apb.PrivacyDeclaration | None = None) -> apb.PrivacyDeclaration:
    """Encode a PrivacyDeclaration (filled in place when ``out`` is given)."""
    msg = out if out is not None else apb.PrivacyDeclaration()
    msg.mechanism, msg.noise_multiplier, msg.clip_norm = d.mechanism, d.noise_multiplier, d.clip_norm
    msg.epsilon, msg.delta, msg.accountant = d.epsilon, d.delta, d.accountant
    msg.budget_spent, msg.ephemeral_ledger = d.budget_spent, d.ephemeral_ledger
    return msg


def privacy_from_proto(msg: apb.PrivacyDeclaration) -> PrivacyDeclaration:
    """Decode a PrivacyDeclaration as sent (``PrivacyDeclaration.check`` validates it)."""
    return PrivacyDeclaration(msg.mechanism, float(msg.noise_multiplier), float(msg.clip_norm), float(msg.epsilon),
                              float(msg.delta), msg.accountant, bool(msg.budget_spent), bool(msg.ephemeral_ledger))


def encode_update(update: Update, wire_dtype: str | None = None) -> Encoded:
    """Serialize an update into one buffer, each tensor copied once, straight into its place (``serialize``; no
    2 GiB limit on a tensor or payload; ``wire_dtype`` narrows floats). A privacy
    declaration out of its domain is WireError ``invalid_privacy`` before anything is sent. A leave notice (a
    declaration with ``budget_spent``, or a ``leave_reason``) has no payloads: ``ValueError`` when it has some, or
    when its reason is empty of text or longer than ``MAX_LEAVE_REASON_CHARS``."""
    msg = apb.Update(envelope=apb.Envelope(run_id=update.run_id, round=update.round,
                                           organization_id=update.organization))
    if update.leave_reason:
        if update.payloads:
            raise ValueError("a leave notice carries no payloads")
        if not update.leave_reason.strip() or len(update.leave_reason) > MAX_LEAVE_REASON_CHARS:
            raise ValueError(f"a leave reason must be 1 to {MAX_LEAVE_REASON_CHARS} characters of text")
        msg.leave_reason = update.leave_reason
    if update.privacy is not None:
        privacy_to_proto(update.privacy.check(), msg.privacy)
    sources: list[Placed] = []
    for p in update.payloads:
        codec.fill_payload_placed(msg.payloads.add(), p, sources, wire_dtype)
        msg.envelope.payload_kinds.append(p.kind.proto_enum)  # type: ignore[arg-type]
    data = serialize(msg, sources)
    return Encoded(data, payload_breakdown(msg.payloads, field_sizes(data, _UPDATE_PAYLOADS)))


class ParsedUpdate:
    """A received update, parsed but not yet checked against a run's contract (opaque to the engine).

    It holds one copy of the update, the received bytes: protobuf parses everything but the tensors' data
    (``framing.lift``), and ``check`` decodes each tensor as a read-only array viewing the received bytes. The
    bytes live as long as the decoded arrays, or until ``release`` (once they are logged) where none is kept.
    """

    def __init__(self, data: Bytes) -> None:
        msg, lifted = _parse_lifted(apb.Update, data, "the update is")
        self._msg: apb.Update | None = msg
        self._lifted = lifted
        self._data: Bytes | None = data
        self.payload_traffic = payload_breakdown(msg.payloads, _payload_sizes(data, _UPDATE_PAYLOADS))
        """Bytes, messages and elements per payload kind (the envelope not included)."""
        self.privacy = privacy_from_proto(msg.privacy) if msg.HasField("privacy") else None
        """The privacy the update declares (None: none); ``check`` validates it (``invalid_privacy``)."""
        self.leave_reason = " ".join(msg.leave_reason.split())[:MAX_LEAVE_REASON_CHARS]
        """Why its organization leaves the run, as one line ("" unless this is such a leave notice)."""

    @property
    def data(self) -> Bytes:
        """The received bytes, as logged."""
        if self._data is None:
            raise ValueError("the update's bytes were released")
        return self._data

    def release(self) -> None:
        """Drop the received bytes (they are in the log)."""
        self._data = None

    @property
    def leaving(self) -> bool:
        """Whether this is a leave notice: its declaration says the organization's privacy budget is spent, or it
        gives a reason to leave (``leave_reason``, sent non-empty)."""
        return bool(self.leave_reason) or (self.privacy is not None and self.privacy.budget_spent)

    def check_leave(self, run_id: str, round_: int, organization: str) -> None:
        """A leave notice's envelope and declaration (``check_envelope``), and that it carries no payload
        (``malformed``)."""
        self.check_envelope(run_id, round_, organization)
        assert self._msg is not None  # check_envelope refuses a checked update
        if self._msg.payloads:
            raise WireError("malformed", f"a leave notice carries no payload; this one carries {len(self._msg.payloads)}")

    def check_envelope(self, run_id: str, round_: int, organization: str) -> None:
        """The envelope against the stream's addressing and its payloads, the privacy declaration against its
        domain (``invalid_privacy``); the payloads are not decoded (``check`` does both)."""
        msg = self._msg
        if msg is None:
            raise ValueError("the update was checked already")
        contract.check_envelope(msg, run_id, round_, organization)
        if self.privacy is not None:
            self.privacy.check()

    def check(self, spec: AlgorithmSpec, phase: Phase, schema: contract.Schema, max_elements: int,
              run_id: str, round_: int, organization: str, scan: bool = True, secure: bool = False) -> Received:
        """The envelope against the stream's addressing, the privacy declaration against its domain
        (``invalid_privacy``), the payloads against the contract; decoded (``scan``, ``secure``: see
        ``contract.check_update``)."""
        self.check_envelope(run_id, round_, organization)
        msg = self._msg
        assert msg is not None
        received = contract.check_update(spec, phase, msg.payloads, schema, max_elements, self._lifted, scan,
                                           secure)
        self._msg, self._lifted = None, []  # the decoded arrays view the received bytes themselves
        return received


@dataclass(frozen=True)
class PushReply:
    """The aggregator's answer to a push."""

    accepted: bool
    duplicate: bool
    round: int


def push_reply_to_proto(reply: PushReply) -> apb.PushUpdateResponse:
    """Encode a PushReply."""
    return apb.PushUpdateResponse(accepted=reply.accepted, duplicate=reply.duplicate, round=reply.round)


def push_reply_from_proto(msg: apb.PushUpdateResponse) -> PushReply:
    """Decode a PushUpdateResponse."""
    return PushReply(bool(msg.accepted), bool(msg.duplicate), int(msg.round))


def push_reply_size(reply: PushReply) -> int:
    """Serialized bytes of a PushReply (counted as the push's down traffic)."""
    return push_reply_to_proto(reply).ByteSize()


# ---------------------------------------------------------------------------------------------- Status


@dataclass(frozen=True)
class TrafficCount:
    """Bytes, messages and tensor elements of one direction and payload kind ("envelope" for the rest)."""

    direction: str
    payload_kind: str
    bytes: int
    messages: int
    elements: int


@dataclass(frozen=True)
class RoundSummary:
    """One round of a run: clients, duration, traffic and the metrics organizations reported."""

    round: int
    clients: int
    duration_seconds: float
    traffic: tuple[TrafficCount, ...] = ()
    reports: dict[str, EvalMetrics] = field(default_factory=dict)
    # Why the round's secure aggregate was abandoned ("" when it was not).
    secure_abandoned: str = ""

    def bytes(self, direction: Direction) -> dict[str, int]:
        """Bytes per payload kind in one direction."""
        out: dict[str, int] = {}
        for t in self.traffic:
            if t.direction == direction:
                out[t.payload_kind] = out.get(t.payload_kind, 0) + t.bytes
        return out


def summary_traffic(up: TrafficBreakdown, down: TrafficBreakdown) -> tuple[TrafficCount, ...]:
    """The traffic of a round's two directions as TrafficCounts (sorted by kind)."""
    return tuple(
        TrafficCount(direction.value, kind, c.bytes, c.messages, c.elements)
        for direction, tb in ((Direction.UP, up), (Direction.DOWN, down))
        for kind, c in sorted(tb.kinds.items())
    )


def breakdown_of(traffic: Iterable[TrafficCount], direction: Direction) -> TrafficBreakdown:
    """The TrafficBreakdown of one direction of a summary's counts."""
    return TrafficBreakdown({t.payload_kind: KindCount(t.bytes, t.messages, t.elements)
                             for t in traffic if t.direction == direction})


@dataclass(frozen=True)
class OrganizationStatus:
    """One organization in a run: whether it joined, the last round it pushed, the bytes it sent and got."""

    organization: str
    joined: bool
    last_round_pushed: int
    bytes_up: int
    bytes_down: int
    # Whether its last accepted update declared differential privacy, and the ε of its last declaration (0: none).
    privacy_declared: bool = False
    privacy_epsilon: float = 0.0


@dataclass(frozen=True)
class Refusal:
    """An organization refused for a reason no retry can fix (its latest such refusal)."""

    organization: str
    reason: str
    message: str


@dataclass(frozen=True)
class RunStatus:
    """A run's state and per-round history."""

    run_id: str
    algorithm: str
    phase: Phase
    round: int
    total_rounds: int
    organizations: tuple[str, ...]
    pushed_this_round: tuple[str, ...] = ()
    history: tuple[RoundSummary, ...] = ()
    organization_status: tuple[OrganizationStatus, ...] = ()
    refused: tuple[Refusal, ...] = ()
    # Non-empty when the aggregator does not host the run (its stored state conflicts with its config): why.
    refused_reason: str = ""

    @property
    def finished(self) -> bool:
        """Whether the run has ended."""
        return self.phase is Phase.FINISHED


_STATE_TO_PROTO = {Phase.SETUP: apb.RUN_STATE_SETUP, Phase.TRAIN: apb.RUN_STATE_RUNNING,
                   Phase.EVALUATE: apb.RUN_STATE_EVALUATING, Phase.FINISHED: apb.RUN_STATE_FINISHED}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}


def run_status_to_proto(status: RunStatus, summaries: Sequence[apb.RoundSummary] = ()) -> apb.RunStatus:
    """Encode a RunStatus; ``summaries``, when given, are already-encoded closed rounds used as they are."""
    out = apb.RunStatus(
        run_id=status.run_id, algorithm=status.algorithm,
        state=_STATE_TO_PROTO[status.phase],  # type: ignore[arg-type]
        round=status.round, total_rounds=status.total_rounds, organizations=list(status.organizations),
        pushed_this_round=list(status.pushed_this_round), refused_reason=status.refused_reason,
    )
    for r in status.refused:
        out.refused.add(organization_id=r.organization, reason=r.reason, message=r.message)
    out.history.extend(summaries)
    for s in status.history[len(summaries):]:
        encode_round_summary(s, out.history.add())
    for o in status.organization_status:
        out.organization_status.add(organization_id=o.organization, joined=o.joined,
                                    last_round_pushed=o.last_round_pushed, bytes_up=o.bytes_up,
                                    bytes_down=o.bytes_down, privacy_declared=o.privacy_declared,
                                    privacy_epsilon=o.privacy_epsilon)
    return out


def encode_round_summary(s: RoundSummary, out: apb.RoundSummary | None = None) -> apb.RoundSummary:
    """A RoundSummary message (filled in place when ``out`` is given); a summary is serialized once."""
    msg = out if out is not None else apb.RoundSummary()
    cached = s.__dict__.get("_serialized")
    if cached is not None:
        msg.MergeFromString(cached)
        return msg
    msg.round, msg.clients, msg.duration_seconds = s.round, s.clients, s.duration_seconds
    msg.secure_abandoned = s.secure_abandoned
    for t in s.traffic:
        msg.traffic.add(direction=t.direction, payload_kind=t.payload_kind, bytes=t.bytes,
                        messages=t.messages, elements=t.elements)
    for org, m in sorted(s.reports.items()):
        msg.reports.add(organization_id=org, metrics=codec.payload_to_proto(m).eval_metrics)
    object.__setattr__(s, "_serialized", msg.SerializeToString())  # summaries are immutable once built
    return msg


def run_status_from_proto(msg: apb.RunStatus) -> RunStatus:
    """Decode a RunStatus."""
    history = tuple(
        RoundSummary(
            int(h.round), int(h.clients), float(h.duration_seconds),
            tuple(TrafficCount(t.direction, t.payload_kind, int(t.bytes), int(t.messages), int(t.elements))
                  for t in h.traffic),
            {r.organization_id: _metrics_from_proto(r.metrics) for r in h.reports},
            h.secure_abandoned,
        )
        for h in msg.history
    )
    organizations = tuple(
        OrganizationStatus(o.organization_id, bool(o.joined), int(o.last_round_pushed), int(o.bytes_up),
                           int(o.bytes_down), bool(o.privacy_declared), float(o.privacy_epsilon))
        for o in msg.organization_status
    )
    return RunStatus(msg.run_id, msg.algorithm, _STATE_FROM_PROTO.get(msg.state, Phase.TRAIN),  # type: ignore[call-overload]
                     int(msg.round), int(msg.total_rounds), tuple(msg.organizations),
                     tuple(msg.pushed_this_round), history, organizations,
                     tuple(Refusal(r.organization_id, r.reason, r.message) for r in msg.refused), msg.refused_reason)


def _metrics_from_proto(m: object) -> EvalMetrics:
    from hetfed.v1 import payloads_pb2 as pb

    payload = pb.Payload()
    payload.eval_metrics.CopyFrom(m)  # type: ignore[arg-type]
    decoded = codec.payload_from_proto(payload)
    assert isinstance(decoded, EvalMetrics)
    return decoded
