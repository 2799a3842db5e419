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

Durable (docs/security.md): each stage message is in the run's stage log (``hetfed.aggregator.journal.stages``)
before the coordinator takes it, each close (with the digest of what it gives out) before any of it is given
out; ``restore`` rebuilds the open round at start-up, or abandons its aggregate where the logs disagree. A round
whose aggregate is abandoned, at any stage, closes by itself with the half untouched. Not done yet: the setup
does not ride on the TRAIN instructions (a stage call answers it until the organization advertises).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence

from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.journal import Journal
from hetfed.aggregator.journal.stages import StageKind
from hetfed.aggregator.run.secure import SecureParams, SecureRound
from hetfed.aggregator.run.state import Rules, RunState, check_member, check_round
from hetfed.wire import codec
from hetfed.wire.contract import Schema
from hetfed.wire.distributed import DistributedSum
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import Payload, PayloadKind, Received, SecAggMaskedInput
from hetfed.wire.phases import Phase
from hetfed.wire.rpc import SecureStageReply
from hetfed.wire.specs import AlgorithmSpec
from hetfed.wire.summation import WEIGHT

log = logging.getLogger("hetfed.aggregator")


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


_bytes = codec.payload_to_bytes


def outbox_digest(sr: SecureRound) -> bytes:
    """SHA-256 of what the last close gave out: each organization's message, in name order, and the stage."""
    h = hashlib.sha256(f"{sr.stage}\0{sr.abandoned}\0".encode())
    for org in sorted(sr.outbox):
        raw = _bytes(sr.outbox[org])
        h.update(f"{org}\0{len(raw)}\0".encode() + raw)
    return h.digest()


class SecureStages:
    """The open round's stages 1, 2 and 4 (module docstring); call under the run's lock."""

    def __init__(self, spec: AlgorithmSpec, rules: Rules, run_seed: int, deadline_seconds: float,
                 params: SecureParams | None, half: Callable[[RunState], ServerHalf],
                 notify: Callable[[], None], journal: Journal,
                 distributed: DistributedSum | None = None) -> None:
        self.spec, self.rules, self.run_seed, self.deadline_seconds = spec, rules, run_seed, deadline_seconds
        self.half, self.notify = half, notify  # the run's server half as the disk has it; wakes waiting callers
        self.journal = journal  # its stage log holds the open round's stage messages and closes
        self._unmasking_since = 0.0  # when the mask stage closed (time.monotonic)
        self._stage_since = 0.0  # when the open stage (advertise or share_keys) opened
        self.params = params  # None: the run does not aggregate securely
        self.distributed = distributed  # the summed kind under distributed DP (None: none)
        self.round: SecureRound | None = None
        self._sent: dict[tuple[str, str], bytes] = {}  # (stage, organization) -> the message it sent there

    @classmethod
    def of(cls, cfg: RunConfig, rules: Rules, half: Callable[[RunState], ServerHalf],
           notify: Callable[[], None], journal: Journal) -> SecureStages:
        """A run's stages: ``SecureParams`` when the run aggregates securely, none (``params`` None) otherwise."""
        params = SecureParams(degree=cfg.secure_degree, threshold=cfg.secure_threshold)
        return cls(cfg.spec, rules, cfg.seed, cfg.round_deadline_seconds, params if cfg.secure_aggregation else None,
                   half, notify, journal, cfg.distributed_sum)

    def current(self, state: RunState) -> SecureRound:
        """The open round's coordinator, built on first use (WireError when the run or the phase has none)."""
        if self.params is None:
            raise WireError("payload_kind_not_allowed", f"run {self.rules.run_id!r} does not aggregate securely")
        if state.phase is not Phase.TRAIN:
            raise WireError("unexpected_stage", f"no secure aggregation in the {state.phase.value} phase")
        if self.round is None or self.round.config.round != state.round:
            roster = tuple(o for o in self.rules.organizations if not state.given_up(o, self.rules))
            self._open(state, roster, log=True)
        assert self.round is not None
        return self.round

    def _open(self, state: RunState, roster: tuple[str, ...], log: bool) -> SecureRound:
        """The open round's coordinator over ``roster``; ``log``: its stage log is started first (durably)."""
        assert self.params is not None
        server = self.half(state)
        shapes = server.summed_shapes() or schema_shapes(state.schema, self.spec.summed_upload)
        sr = SecureRound(self.spec, server, self.rules.run_id, state.round, roster, self.run_seed, shapes, self.params,
                         self.distributed)
        if log:
            self.journal.open_stages_locked(state.round, json.dumps(list(roster)).encode())
        self.round, self._sent, self._stage_since = sr, {}, time.monotonic()
        return sr

    def active(self, state: RunState) -> bool:
        """Whether the open round aggregates securely (a training round of a secure run)."""
        return self.params is not None and state.phase is Phase.TRAIN

    def fold(self, state: RunState, organization: str, received: Received) -> bool:
        """Stage 3: an accepted update's masked input goes to the round's coordinator (the half never sees it);
        False when the open round is not secure (the caller folds the update into the half)."""
        if not self.active(state):
            return False
        sr = self.current(state)
        if ("mask", organization) not in self._sent and not sr.abandoned:  # not taken when the round was restored
            masked = received.get(SecAggMaskedInput)
            sr.receive(organization, masked)
            # Answered: it waits for its unmask request. Only that it came is kept: the input is in the running
            # sum, and a copy of each (8 bytes a parameter) would hold N times the model until the round ends.
            self._sent[("mask", organization)] = b""
        return True

    def admit(self, state: RunState, organization: str) -> None:
        """Refuse a masked input (before it is logged) that the open round's coordinator would not take: the
        round's aggregate was abandoned, or its mask stage is not open (``unexpected_stage``)."""
        sr = self.current(state)
        if sr.stage != "mask":
            raise WireError("unexpected_stage", f"a masked input of {organization!r} while round {state.round}'s "
                                                f"secure aggregation is at {sr.stage}")

    def call(self, state: RunState, organization: str, round_: int, payload: Payload | None) -> SecureRound:
        """A SecureStage call of ``organization`` (the caller) for ``round_``: refused unless it is a member and
        the round is the open one; its stage message, if any, taken (a close wakes the waiting callers); the
        open round's coordinator."""
        check_member(state, self.rules, organization)
        check_round(state, self.rules, round_)
        sr = self.current(state)
        if payload is not None and self.take(sr, organization, payload):
            self.notify()
        return sr

    def ready(self, state: RunState, due: bool) -> bool:
        """Whether the open round closes now; ``due``: everyone expected pushed, or its deadline passed with the
        quorum. A secure round's stage 1 or 2 past its deadline closes first (``expire``). Not secure: when due.
        Secure and due, at the mask stage: the stage closes (its unmask requests go out, the callers waiting for
        them are woken) and the round waits. At the unmask stage: once every survivor answered, or one more round
        deadline has passed since the mask stage closed, the sum is unmasked into the half (``finish``, with the
        half as the run holds it now) and the round closes; an abandoned round closes with the half untouched."""
        if not self.active(state):
            return due
        self.expire(state)
        sr = self.round
        if sr is not None and sr.config.round == state.round and sr.stage == "abandoned":
            return True  # abandoned at any stage: the round closes by itself, the model unchanged
        if not due:
            return False
        sr = self.current(state)
        if sr.stage == "mask":
            self._close(sr)
            self._unmasking_since = time.monotonic()
            return bool(sr.abandoned)
        if sr.stage == "unmask":
            answered = {o for s, o in self._sent if s == "unmask"}
            late = time.monotonic() - self._unmasking_since >= self.deadline_seconds
            if not (late or set(sr.outbox) <= answered):
                return False
            sr.half = self.half(state)
            sr.finish()
            self.notify()
            return True
        return sr.stage in ("done", "abandoned")

    def expire(self, state: RunState) -> None:
        """Close stage 1 or 2 once a round deadline has passed since it opened, when at least the run's quorum
        sent (the others are dropouts before masking: nobody masks with them); the waiting callers are woken."""
        sr = self.round
        if not self.active(state) or sr is None or sr.config.round != state.round or \
                sr.stage not in ("advertise", "share_keys"):
            return
        if time.monotonic() - self._stage_since < self.deadline_seconds:
            return
        if len({o for s, o in self._sent if s == sr.stage}) >= max(self.rules.quorum, 1):
            self._close(sr)

    def abandoned(self, state: RunState) -> str:
        """Why the open round's secure aggregate was abandoned ("" when it was not, or the round is not secure)."""
        sr = self.round
        if not self.active(state) or sr is None or sr.config.round != state.round:
            return ""
        return sr.abandoned

    def take(self, sr: SecureRound, organization: str, payload: Payload, replaying: bool = False) -> bool:
        """Receive one stage message from ``organization`` (the caller), durable in the stage log before the
        coordinator takes it; True when it closed the stage. A message to an abandoned round changes nothing
        (the reply says why). ``replaying``: read back from the stage log (neither logged again nor closing)."""
        if isinstance(payload, SecAggMaskedInput):
            raise WireError("payload_kind_not_allowed", "a masked input rides on PushUpdate, not SecureStage")
        raw = _bytes(payload)
        if sr.abandoned or raw in (b for (_, o), b in self._sent.items() if o == organization):
            return False  # an abandoned round, or a retry of a message already taken
        if (sr.stage, organization) in self._sent:
            raise WireError("replayed", f"organization {organization!r} already sent another message for the "
                                        f"{sr.stage} stage of round {sr.config.round}")
        stage = sr.stage
        if not replaying:
            self.journal.log_stage(sr.config.round, StageKind.MESSAGE, organization, raw)
        sr.receive(organization, payload)
        self._sent[(stage, organization)] = raw
        if not replaying and self._complete(sr):
            self._close(sr)
            return True
        return False

    def _complete(self, sr: SecureRound) -> bool:
        """Whether stage 1 or 2 has every message it waits for: every roster member's, then every organization's
        the previous close addressed."""
        expected = set(sr.config.roster) if sr.stage == "advertise" else set(sr.outbox)
        return sr.stage in ("advertise", "share_keys") and expected <= {o for s, o in self._sent if s == sr.stage}

    def _close(self, sr: SecureRound) -> None:
        """Close the open stage (1, 2 or 3) and log the close, with the digest of what it gives out, before any
        of it is given out; the waiting callers are woken. Should the log fail, the round's aggregate is
        abandoned (nothing of the close given out) and the failure raised."""
        sr.close_stage()
        try:
            self.journal.log_stage(sr.config.round, StageKind.CLOSE, "", outbox_digest(sr))
        except WireError as err:
            sr.abandon(f"the stage log could not be written ({err.message})")
            raise
        finally:
            self._stage_since = time.monotonic()
            self.notify()

    def restore(self, state: RunState, logged: Sequence[tuple[str, Received]]) -> None:
        """At start-up: rebuild the open round's coordinator from its stage log, with ``logged``, the open round's
        updates read back from the update log, folded in before the mask stage's close (none after it was
        taken). It ends where the uninterrupted one was, its closes giving the same messages, byte for byte; an
        organization that asks again gets what it got before. Where that cannot be, the round's aggregate is
        abandoned, before anything more is given out (docs/security.md): the stage log is damaged; it lacks the
        round while the update log holds masked inputs; a replayed close would give out something else (a masked
        input the update log lost or gained); a masked input the stages cannot take."""
        if not self.active(state):
            return
        records, damaged = self.journal.stage_records(state.round)
        pending = {org: received.get(SecAggMaskedInput) for org, received in logged}
        if not records or records[0].kind is not StageKind.OPEN:
            if pending or damaged:
                self._give_up(self.current(state), f"the stage log {'is damaged' if damaged else 'lacks the round'}, "
                                                   f"but the update log holds {len(pending)} masked inputs")
            return
        sr = self._open(state, tuple(json.loads(records[0].data)), log=False)
        why = f"the stage log is damaged ({damaged})" if damaged else ""
        for rec in records[1:]:
            if why:
                break
            if rec.kind is StageKind.ABANDON:
                sr.abandon(rec.data.decode(errors="replace"))
                return
            if rec.kind is StageKind.MESSAGE:
                with contextlib.suppress(WireError):  # refused as it was the first time
                    self.take(sr, rec.organization, codec.payload_from_bytes(rec.data), True)
                continue
            if sr.stage == "mask":
                why = self._fold_logged(sr, pending)
            if not why and sr.stage in ("advertise", "share_keys", "mask"):
                stage = sr.stage
                sr.close_stage()
                why = "" if outbox_digest(sr) == rec.data else \
                    f"the replayed close of the {stage} stage would give out other messages than the logged one"
            elif not why:
                why = f"a close logged at the {sr.stage} stage"
        if not why and sr.stage == "mask":
            why = self._fold_logged(sr, pending)
        if not why and pending:
            why = f"the update log holds masked inputs of {sorted(pending)} the stages did not take"
        log.info("run %s: secure round %d resumed at %s from %d stage records", self.rules.run_id, state.round,
                 sr.stage, len(records))
        if why:
            self._give_up(sr, f"an aggregator restart could not resume it: {why}")
        elif sr.stage == "unmask":
            self._unmasking_since = time.monotonic()
        elif self._complete(sr):  # its close was never logged, so nothing of it was given out
            self._close(sr)

    def _fold_logged(self, sr: SecureRound, pending: dict[str, SecAggMaskedInput]) -> str:
        """Take the masked inputs read back from the update log (mask stage); why one could not be ("")."""
        for org in sorted(pending):
            try:
                sr.receive(org, pending.pop(org))
            except WireError as err:
                return f"the logged masked input of {org!r} is refused ({err.reason})"
            self._sent[("mask", org)] = b""
        return ""

    def _give_up(self, sr: SecureRound, why: str) -> None:
        """Abandon the round's aggregate (``SecureRound.abandon``) and log why, so a later restart does too."""
        sr.abandon(why)
        log.warning("run %s: round %d's secure aggregate is abandoned: %s", self.rules.run_id, sr.config.round, why)
        with contextlib.suppress(WireError):  # without it, a later restart finds the same reason again
            self.journal.log_stage(sr.config.round, StageKind.ABANDON, "", why.encode())

    def reply(self, sr: SecureRound, organization: str) -> SecureStageReply:
        """What the organization gets now: the round's setup while it has not advertised, then the last close's
        message for it until it answers that (None: nothing for it now)."""
        answered = (sr.stage, organization) in self._sent
        payload: Payload | None = None
        if not answered and sr.stage not in ("done", "abandoned"):
            payload = sr.setup() if sr.stage == "advertise" else sr.outbox.get(organization)
        return SecureStageReply(payload, sr.stage, sr.abandoned)
