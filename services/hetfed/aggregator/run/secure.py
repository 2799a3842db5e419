"""One round's secure aggregation on the aggregator: the SecAgg+ server session of ``hetfed.secagg`` behind
hetfed's payloads, bound to the callers' identities and to a server half's ``accumulate_sum``.

``SecureRound`` is algorithm-agnostic: the spec says which upload kinds are summed (``summed_upload``), the
server half whether it can take their sum (``secure_aggregation_refusal``) and with which weights
(``summed_unit_weights``); ``hetfed.wire.summation`` gives each kind's weighted form. The round's setup
(``setup``) carries the roster, the Harary graph's degree and seed (from the run seed and the round), the
threshold and the encoding: one field per summed array, each bounded by ``SecureParams``. Each stage message
is refused unless its sender is the caller's organization (``identity_mismatch``, before the core sees it); the
core's refusals become the wire's reasons (``hetfed.wire.errors.from_secagg``). ``finish`` unmasks, decodes and
checks the sum (every element within survivors × its bound, else ``implausible_update``) and hands it to the
half; below the threshold it abandons the round's aggregate, with nothing asked that would reveal an input,
and the half is not touched (``abandoned`` says why).

Distributed DP (``distributed``, ``hetfed.wire.distributed``): one summed kind's weighted form is replaced in the
encoding by one exact field that carries each organization's distributed Skellam encoding; ``finish`` decodes it
(refusing fewer inputs than the plan's honest organizations: the round's aggregate is abandoned) before the half
takes the sums.

Resumption: the round is a deterministic function of the stage messages it accepted and its closes, in order.
``hetfed.aggregator.run.secure_stages`` journals them (the stage log, with the update log's masked inputs) and
feeds them to a fresh round of the same setup after a restart: it ends at the same stage with the same outbox.
The round itself keeps no copy of them (a masked input is 8 bytes a parameter).

Driven by ``hetfed.aggregator.run.secure_stages`` (the SecureStage RPC, the push path and the round's close),
when a run sets ``secure_aggregation``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hetfed import secagg
from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.wire.distributed import DistributedSum, rotation_seed
from hetfed.wire.errors import WireError, from_secagg
from hetfed.wire.payloads import (
    Payload,
    SecAggKeyAdvert,
    SecAggMaskedInput,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggSharedKeys,
    SecAggUnmask,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import AlgorithmSpec
from hetfed.wire.summation import WEIGHT, sums


@dataclass(frozen=True)
class SecureParams:
    """The encoding's bounds and the graph's shape. hetfed's own choices, each with why:

    ``value_bound``: |x| of every summed value (a weight, a class mean); 100 is far beyond a trained model's
    weights and a sigmoid latent, and costs log2(100) ≈ 7 of the value bits. ``weight_bound``: the largest weight
    one payload carries (an example count); 10^6 examples per organization. ``value_bits``: 40, so a
    weighted value w·x is quantized on a step of value_bound·weight_bound / (2^39 − 1) ≈ 1.8·10^-4, which the
    division by Σw (at least 1) only shrinks; 40 bits need the 64-bit ring. ``degree`` 0: the complete graph
    (SecAgg, hetfed.secagg's default for tens of organizations); ``threshold`` 0: floor(k/2) + 1."""

    value_bound: float = 100.0
    weight_bound: float = 1e6
    value_bits: int = 40
    degree: int = 0
    threshold: int = 0


def graph_parameters(members: int, params: SecureParams) -> tuple[int, int]:
    """k and t of a round over ``members``: the configured degree (0: the complete graph) capped at n - 1, one
    less where n·k is odd (no k-regular graph); the configured threshold (0: floor(k/2) + 1) capped at k. A run's
    config keeps k/2 < t for its full roster (``RunConfig``), and a cap keeps it: min(t, k) > k/2."""
    degree = min(params.degree, members - 1) if params.degree else secagg.default_degree(members)
    if degree > 1 and members * degree % 2:
        degree -= 1
    threshold = min(params.threshold, degree) if params.threshold else secagg.default_threshold(degree)
    return degree, threshold


def graph_seed(run_seed: int, round_: int) -> bytes:
    """The round's 32-byte graph seed, derived from the run seed and the round (both sides can recompute it)."""
    return hashlib.sha256(f"hetfed-secagg-graph:{run_seed}:{round_}".encode()).digest()


def encoding_fields(shapes: Mapping[str, tuple[int, ...]], params: SecureParams,
                    unit: bool) -> tuple[secagg.Field, ...]:
    """One field per named array of the summed form (``hetfed.wire.summation.shapes``), in name order: a
    weight is bounded by ``weight_bound`` (1 under unit weights), a weighted value by that times ``value_bound``."""
    weight = 1.0 if unit else params.weight_bound
    return tuple(secagg.Field(name, tuple(shape), weight if name.endswith(WEIGHT) else weight * params.value_bound)
                 for name, shape in sorted(shapes.items()))


class SecureRound:
    """The aggregator's side of one round's secure aggregation (module docstring)."""

    def __init__(self, spec: AlgorithmSpec, half: ServerHalf, run_id: str, round_: int, roster: tuple[str, ...],
                 run_seed: int, shapes: Mapping[str, tuple[int, ...]], params: SecureParams = SecureParams(),
                 distributed: DistributedSum | None = None) -> None:
        refusal = spec.secure_aggregation_refusal() or half.secure_aggregation_refusal()
        if refusal:
            raise WireError("invalid_value", f"secure aggregation: {refusal}")
        self.spec, self.half, self.unit = spec, half, half.summed_unit_weights
        n = len(roster)
        degree, threshold = graph_parameters(n, params)
        self.distributed = distributed
        self.rotation_seed = rotation_seed(run_seed, round_)
        summed = shapes if distributed is None else distributed.replace_shapes(shapes)
        fields = encoding_fields(summed, params, self.unit)
        if distributed is not None:
            exact = distributed.field(params.value_bits)
            fields = tuple(exact if f.name == exact.name else f for f in fields)
        try:
            encoding = secagg.Encoding.for_inputs(fields, n, params.value_bits)
            self.config = secagg.RoundConfig(run_id, round_, tuple(roster), degree, threshold,
                                             graph_seed(run_seed, round_), encoding)
        except secagg.SecAggError as exc:
            raise from_secagg(exc) from None
        self.session = secagg.ServerSession(self.config)
        # Each kind's arrays in the schema's order (the encoding's fields are sorted by name).
        self._order = {kind: [n.partition("/")[2] for n in shapes if n.startswith(kind.value + "/")]
                       for kind in spec.summed_upload}
        self.abandoned = ""  # why the round's aggregate was abandoned ("" while it was not)
        self.result: secagg.Aggregate | None = None
        self.outbox: dict[str, Payload] = {}  # what the last close gave each organization

    @property
    def stage(self) -> str:
        """The open stage: advertise, share_keys, mask, unmask, done or abandoned."""
        return "abandoned" if self.abandoned and self.session.stage != "done" else self.session.stage

    def abandon(self, why: str) -> None:
        """Abandon the round's aggregate outside the protocol (a restart that cannot resume it): nothing more is
        taken or given out, nothing is unmasked, the half is not touched."""
        self.abandoned, self.outbox = why or "abandoned", {}

    def setup(self) -> SecAggSetup:
        """What every organization of the roster receives with the round's instructions."""
        return SecAggSetup(self.config, self.unit)

    def receive(self, organization: str, payload: Payload) -> None:
        """One stage message from ``organization`` (the caller's identity): refused unless it is the sender and
        the message is the open stage's."""
        handlers: dict[type, Callable[[Any], None]] = {
            SecAggKeyAdvert: self.session.receive_advert, SecAggSharedKeys: self.session.receive_shared_keys,
            SecAggMaskedInput: self.session.receive_masked, SecAggUnmask: self.session.receive_unmask}
        if self.abandoned:
            raise WireError("unexpected_stage", f"round {self.config.round}'s secure aggregate was abandoned")
        handler = handlers.get(type(payload))
        message = getattr(payload, "message", None)
        if handler is None or isinstance(message, secagg.UnmaskRequest):
            raise WireError("payload_kind_not_allowed", f"{payload.kind.value} is not a client's stage message")
        sender = getattr(message, "sender", "")
        if sender != organization:
            raise WireError("identity_mismatch", f"a stage message of {sender!r} sent by {organization!r}")
        try:
            handler(message)
        except secagg.SecAggError as exc:
            raise from_secagg(exc) from None

    def close_stage(self) -> dict[str, Payload]:
        """End the open stage (advertise, share_keys or mask): what each remaining organization receives next.
        An abandoned round gives nothing (``abandoned`` says why)."""
        closers: dict[str, tuple[Callable[[], Mapping[str, Any]], Callable[[Any], Payload]]] = {
            "advertise": (self.session.close_advertising, SecAggPeerKeys),
            "share_keys": (self.session.close_sharing, SecAggPeerShares),
            "mask": (self.session.close_masking, SecAggUnmask)}
        if self.stage not in closers:
            raise WireError("unexpected_stage", f"no stage to close at {self.stage}")
        close, wrap = closers[self.stage]
        try:
            self.outbox = {org: wrap(msg) for org, msg in close().items()}
            return dict(self.outbox)
        except secagg.AbandonedError as exc:
            self.outbox = {}
            self.abandoned = str(exc)
            return {}

    def finish(self) -> secagg.Aggregate | None:
        """Unmask and decode the sum, check it, and hand it to the server half (``accumulate_sum``); None when
        the round's aggregate is abandoned (too few parties) or refused (an element of the sum beyond the
        survivors times its bound, which no honest inputs give, or by the half's own checks of the sum): the half is
        not touched, ``abandoned`` says why."""
        if self.stage != "unmask":
            raise WireError("unexpected_stage", f"finishing at {self.stage}")
        try:
            result = self.session.finish()
        except secagg.SecAggError as exc:  # too few shares, or a sum no honest inputs give: refused
            self.abandoned = str(from_secagg(exc))
            return None
        values = result.values
        if self.distributed is not None:
            try:
                values = self.distributed.decode(values, self.rotation_seed, len(result.survivors))
            except WireError as exc:  # fewer inputs than the honest organizations the noise counts on
                self.abandoned = str(exc)
                return None
        summed = {kind: replace(total, values={n: total.values[n] for n in self._order[kind] if n in total.values})
                  for kind, total in sums(self.spec.summed_upload, values).items()}
        try:  # the half's own checks of the sum (a half may refuse it: WireError)
            self.half.accumulate_sum(Phase.TRAIN, summed, result.survivors)
        except WireError as exc:
            self.abandoned = str(exc)
            return None
        self.result = result
        return result
