"""A run's secure aggregation between the round's training and its close: stages 1, 2 and 4 of the open round
(the SecureStage RPC), each bound to the caller's identity.

``SecureStages`` keeps the open round's coordinator (``hetfed.aggregator.run.secure.SecureRound``), built on the
first stage call of a training round: its roster is every member of the run that is not given up (one that has
not joined yet, or does not advertise, is a dropout before masking: nobody masks with it), its shapes are the
spec's summed kinds as the server half fixes them from its config (``ServerHalf.summed_shapes``), else as the
run's tensor schema declares them. A stage closes as soon as every organization the
previous stage's close addressed (every roster member, for the first) has sent its message, or once a round
deadline has passed since it opened with at least the run's quorum sent (``expire``); the close's
messages then wait for their organizations. A message sent again, byte for byte, is a retry and changes
nothing; a different one for a stage already answered is refused (``replayed``).

Algorithm-agnostic: the spec says which kinds are summed, the server half whether and how it takes their sum.

Stage 3 rides on PushUpdate: a secure run's training update carries its masked input instead of the summed
kinds (``AlgorithmSpec.uploads``), and ``fold`` hands it to the coordinator. When the round is due (``ready``)
the mask stage closes and the unmask requests go out; the last survivor's answer (or the deadline) unmasks the
sum into the server half (``finish``), and the round closes as any other.

Not done yet (docs/security.md): the setup does not ride on the TRAIN instructions (a stage call answers it
until the organization advertises); a restart mid-round (the log's masked inputs are not replayed into a
coordinator); a round abandoned before masking does not close by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.run.secure import SecureParams, SecureRound
from hetfed.aggregator.run.state import Rules, RunState
from hetfed.wire import codec
from hetfed.wire.contract import Schema
from hetfed.wire.distributed import DistributedSum
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import Payload, PayloadKind, Received, SecAggMaskedInput
from hetfed.wire.phases import Phase
from hetfed.wire.rpc import SecureStageReply
from hetfed.wire.specs import AlgorithmSpec
from hetfed.wire.summation import WEIGHT


def schema_shapes(schema: Schema, kinds: frozenset[PayloadKind]) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the summed form (``hetfed.wire.summation.shapes``) of ``kinds`` as ``schema``
    declares them: each declared tensor, and the kind's weight (one per class for class mean embeddings)."""
    out: dict[str, tuple[int, ...]] = {}
    for kind in sorted(kinds, key=lambda k: k.value):
        declared = schema.get(kind)
        if not declared:
            raise WireError("missing_payload", f"secure aggregation sums {kind.value}, which no organization declared")
        for name, decl in declared.items():
            out[f"{kind.value}/{name}"] = tuple(decl.shape)
        means = declared.get("means")
        per_class = kind is PayloadKind.CLASS_MEAN_EMBEDDINGS and means is not None
        out[kind.value + WEIGHT] = (means.shape[0],) if per_class and means is not None else ()
    return out


def _bytes(payload: Payload) -> bytes:
    return codec.payload_to_proto(payload).SerializeToString()


class SecureStages:
    """The open round's stages 1, 2 and 4 (module docstring); call under the run's lock."""

    def __init__(self, spec: AlgorithmSpec, rules: Rules, run_seed: int, deadline_seconds: float,
                 params: SecureParams | None = None, distributed: DistributedSum | None = None) -> None:
        self.spec, self.rules, self.run_seed, self.deadline_seconds = spec, rules, run_seed, deadline_seconds
        self._unmasking_since = 0.0  # when the mask stage closed (time.monotonic)
        self._stage_since = 0.0  # when the open stage (advertise or share_keys) opened
        self.params = params  # None: the run does not aggregate securely
        self.distributed = distributed  # the summed kind under distributed DP (None: none)
        self.round: SecureRound | None = None
        self._sent: dict[tuple[str, str], bytes] = {}  # (stage, organization) -> the message it sent there

    def current(self, state: RunState, half: Callable[[], ServerHalf]) -> SecureRound:
        """The open round's coordinator, built on first use (WireError when the run or the phase has none)."""
        if self.params is None:
            raise WireError("payload_kind_not_allowed", f"run {self.rules.run_id!r} does not aggregate securely")
        if state.phase is not Phase.TRAIN:
            raise WireError("unexpected_stage", f"no secure aggregation in the {state.phase.value} phase")
        if self.round is None or self.round.config.round != state.round:
            roster = tuple(o for o in self.rules.organizations if not state.given_up(o, self.rules))
            server = half()
            shapes = server.summed_shapes() or schema_shapes(state.schema, self.spec.summed_upload)
            self.round = SecureRound(self.spec, server, self.rules.run_id, state.round, roster, self.run_seed,
                                     shapes, self.params, self.distributed)
            self._sent = {}
            self._stage_since = time.monotonic()
        return self.round

    def active(self, state: RunState) -> bool:
        """Whether the open round aggregates securely (a training round of a secure run)."""
        return self.params is not None and state.phase is Phase.TRAIN

    def fold(self, state: RunState, organization: str, received: Received, half: Callable[[], ServerHalf]) -> None:
        """Stage 3: an accepted update's masked input goes to the round's coordinator (the half never sees it)."""
        masked = received.get(SecAggMaskedInput)
        self.current(state, half).receive(organization, masked)
        self._sent[("mask", organization)] = _bytes(masked)  # answered: it waits for its unmask request

    def ready(self, state: RunState, half: Callable[[], ServerHalf], notify: Callable[[], None]) -> bool:
        """A round that is due (everyone expected pushed, or its deadline passed with the quorum): whether it
        closes now. Not secure: yes. At the mask stage, the stage closes (its unmask requests go out, ``notify``
        wakes the callers waiting for them) and the round waits. At the unmask stage, once every survivor
        answered, or one more round deadline has passed since the mask stage closed, the sum is unmasked into the half (``finish``, with the half as the
        run holds it now) and the round closes; an abandoned round closes with the half untouched."""
        if not self.active(state):
            return True
        sr = self.current(state, half)
        if sr.stage == "mask":
            sr.close_stage()
            self._unmasking_since = time.monotonic()
            notify()
            return bool(sr.abandoned)
        if sr.stage == "unmask":
            answered = {o for s, o in self._sent if s == "unmask"}
            late = time.monotonic() - self._unmasking_since >= self.deadline_seconds
            if not (late or set(sr.outbox) <= answered):
                return False
            sr.half = half()
            sr.finish()
            notify()
            return True
        return sr.stage in ("done", "abandoned")

    def expire(self, state: RunState, notify: Callable[[], None]) -> None:
        """Close stage 1 or 2 once a round deadline has passed since it opened, when at least the run's quorum
        sent (the others are dropouts before masking: nobody masks with them); ``notify`` wakes the callers."""
        sr = self.round
        if not self.active(state) or sr is None or sr.config.round != state.round or \
                sr.stage not in ("advertise", "share_keys"):
            return
        if time.monotonic() - self._stage_since < self.deadline_seconds:
            return
        if len({o for s, o in self._sent if s == sr.stage}) >= max(self.rules.quorum, 1):
            sr.close_stage()
            self._stage_since = time.monotonic()
            notify()

    def abandoned(self, state: RunState) -> str:
        """Why the open round's secure aggregate was abandoned ("" when it was not, or the round is not secure)."""
        sr = self.round
        if not self.active(state) or sr is None or sr.config.round != state.round:
            return ""
        return sr.abandoned

    def take(self, sr: SecureRound, organization: str, payload: Payload) -> bool:
        """Receive one stage message from ``organization`` (the caller); True when it closed the stage."""
        if isinstance(payload, SecAggMaskedInput):
            raise WireError("payload_kind_not_allowed", "a masked input rides on PushUpdate, not SecureStage")
        raw = _bytes(payload)
        if raw in (b for (_, o), b in self._sent.items() if o == organization):
            return False  # a retry of a message already taken
        if (sr.stage, organization) in self._sent:
            raise WireError("replayed", f"organization {organization!r} already sent another message for the "
                                        f"{sr.stage} stage of round {sr.config.round}")
        stage = sr.stage
        sr.receive(organization, payload)
        self._sent[(stage, organization)] = raw
        expected = set(sr.config.roster) if stage == "advertise" else set(sr.outbox)
        if stage in ("advertise", "share_keys") and expected <= {o for s, o in self._sent if s == stage}:
            sr.close_stage()
            self._stage_since = time.monotonic()
            return True
        return False

    def reply(self, sr: SecureRound, organization: str) -> SecureStageReply:
        """What the organization gets now: the round's setup while it has not advertised, then the last close's
        message for it until it answers that (None: nothing for it now)."""
        answered = (sr.stage, organization) in self._sent
        payload: Payload | None = None
        if not answered and sr.stage not in ("done", "abandoned"):
            payload = sr.setup() if sr.stage == "advertise" else sr.outbox.get(organization)
        return SecureStageReply(payload, sr.stage, sr.abandoned)
