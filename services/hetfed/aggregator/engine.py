"""The round engine: one loop for every algorithm, durable, with quorum, deadlines and contract checks.

A run moves through phases (``hetfed.wire.phases.Phase``): setup (round 0, only when the algorithm uploads
something once), train (rounds 1..R), evaluate (round R+1: clients evaluate the final state and report
metrics) and finished. A round closes when every organization has pushed, or once its deadline has passed
with at least the quorum. Every accepted update is on disk before it is acknowledged; the server half's
state is checkpointed atomically at each round close, and a restart replays the open round's stored updates.
The engine sees typed messages only: the wire package converts at the gRPC boundary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hetfed.aggregator import k8s_events
from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.metrics import AggregatorMetrics
from hetfed.aggregator.org_ledger import OrganizationLedger
from hetfed.aggregator.store import RunStore
from hetfed.wire import contract, messages
from hetfed.wire.config import to_mapping
from hetfed.wire.errors import WireError
from hetfed.wire.messages import (
    Encoded,
    Instructions,
    JoinReply,
    JoinRequest,
    ParsedUpdate,
    PullRequest,
    PushReply,
    RoundSummary,
    RunStatus,
)
from hetfed.wire.payloads import EvalMetrics, Received
from hetfed.wire.phases import Action, Phase
from hetfed.wire.rpc import Pulled
from hetfed.wire.traffic import KindCount, TrafficBreakdown, with_envelope

log = logging.getLogger("hetfed.aggregator")


@dataclass(frozen=True)
class Limits:
    """Per-run limits on what arrives and how instructions are chunked."""

    chunk_bytes: int
    max_update_bytes: int
    max_tensor_elements: int


def _traffic_json(b: TrafficBreakdown) -> dict[str, dict[str, int]]:
    return {k: {"bytes": c.bytes, "messages": c.messages, "elements": c.elements} for k, c in b.kinds.items()}


def _traffic_from_json(d: dict[str, Any]) -> TrafficBreakdown:
    # Older checkpoints stored [bytes, messages, elements] lists.
    return TrafficBreakdown({k: KindCount(*v) if isinstance(v, list) else KindCount(**v) for k, v in d.items()})


def _metrics_json(m: EvalMetrics) -> dict[str, Any]:
    return {"train_loss": m.train_loss, "num_train_examples": m.num_train_examples, "test_accuracy": m.test_accuracy,
            "test_loss": m.test_loss, "num_test_examples": m.num_test_examples, "extra": dict(m.extra)}


def _metrics_from_json(v: Any) -> EvalMetrics:
    if isinstance(v, list):  # older checkpoints: positional
        return EvalMetrics(v[0], v[1], v[2], v[3], v[4], dict(v[5]))
    return EvalMetrics(**{**v, "extra": dict(v["extra"])})


@dataclass
class RoundRecord:
    """What happened in one round: who pushed, how long it took, traffic and reported metrics."""

    round: int
    phase: Phase
    started: float
    duration: float = 0.0
    clients: int = 0
    up: TrafficBreakdown = field(default_factory=TrafficBreakdown)
    down: TrafficBreakdown = field(default_factory=TrafficBreakdown)
    reports: dict[str, EvalMetrics] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form with named fields (for the history file)."""
        return {
            "round": self.round,
            "phase": self.phase.value,
            "duration": self.duration,
            "clients": self.clients,
            "up": _traffic_json(self.up),
            "down": _traffic_json(self.down),
            "reports": {org: _metrics_json(m) for org, m in self.reports.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RoundRecord:
        """Inverse of ``to_json``."""
        rec = cls(d["round"], Phase(d["phase"]), 0.0, d["duration"], d["clients"], _traffic_from_json(d["up"]),
                  _traffic_from_json(d["down"]))
        rec.reports = {org: _metrics_from_json(v) for org, v in d["reports"].items()}
        return rec

    def summary(self, clients: int | None = None) -> RoundSummary:
        """The typed summary Status reports."""
        return RoundSummary(self.round, self.clients if clients is None else clients, self.duration,
                            messages.summary_traffic(self.up, self.down), dict(self.reports))


class Run:
    """One federated run hosted by the aggregator; thread-safe."""

    def __init__(self, cfg: RunConfig, state_dir: str, metrics: AggregatorMetrics, limits: Limits) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.train_config = cfg.train_config()
        self.wire_dtype = None if self.train_config.wire_dtype == "float32" else self.train_config.wire_dtype
        self.half = make_server_half(self.spec, self.train_config, cfg.run_info())
        self.store = RunStore(state_dir, cfg.id)
        self.metrics = metrics
        self.limits = limits
        self._cond = threading.Condition()
        self.phase = self.spec.first_phase
        self.round = 0 if self.phase is Phase.SETUP else 1
        self.schema: contract.Schema = {}
        self.joined: set[str] = set()
        self.declared: set[str] = set()  # organizations whose tensor declaration matched the run's schema
        self.pushed: dict[str, bytes] = {}  # organization -> SHA-256 of its accepted update this round
        self.history: list[RoundRecord] = []
        self.ledger = OrganizationLedger()  # per organization: last accepted round, bytes up and down
        self._summaries: list[RoundSummary] = []  # Status summaries of history[:len], built once
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = False
        # (round, organization or "*") -> the encoded instructions of the open round
        self._cache: dict[tuple[int, str], Encoded] = {}
        self._config_json = json.dumps(to_mapping(self.train_config), sort_keys=True)
        self._restore()
        self._publish_round_gauges()

    # ----------------------------------------------------------------- durability
    def _meta(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "round": self.round,
            "schema": contract.schema_to_json(self.schema),
            "joined": sorted(self.joined),
            "declared": sorted(self.declared),
            # The closed rounds' records are in the store's append-only history; this many are valid.
            "history_len": len(self.history),
            "organizations": self.ledger.to_json(),
        }

    def _checkpoint(self) -> None:
        self.store.save_checkpoint(self._meta(), self.half.state())

    def _restore(self) -> None:
        loaded = self.store.load_checkpoint()
        if loaded is None:
            self._checkpoint()
            return
        meta, arrays = loaded
        self.phase, self.round = Phase(meta["phase"]), int(meta["round"])
        self.schema = contract.schema_from_json(meta["schema"])
        self.joined = set(meta["joined"])
        self.declared = set(meta.get("declared", meta["joined"]))
        self.ledger = OrganizationLedger.from_json(meta.get("organizations"))
        records = meta["history"] if "history" in meta else self.store.load_history(int(meta["history_len"]))
        self.history = [RoundRecord.from_json(r) for r in records]
        self.half.load_state(arrays)
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = bool(self.joined)
        replayed = 0
        for org, data in self.store.updates(self.round):
            update = ParsedUpdate(data).check(self.spec, self.phase, self.schema, self.limits.max_tensor_elements,
                                              self.cfg.id, self.round, org)
            self._fold(org, update, hashlib.sha256(data).digest())
            replayed += 1
        log.info("run %s resumed at %s round %d with %d stored updates", self.cfg.id, self.phase.value,
                 self.round, replayed)
        self._maybe_close_locked()

    # ----------------------------------------------------------------- join
    def _check_member(self, organization: str) -> None:
        if organization not in self.cfg.organizations:
            raise WireError("unknown_organization", f"organization {organization!r} is not part of run {self.cfg.id!r}")
        if organization not in self.joined:
            raise WireError("not_joined", f"organization {organization!r} must Join run {self.cfg.id!r} first")
        if self.spec.shared_schema and organization not in self.declared:
            raise WireError("not_declared", f"organization {organization!r} must declare its tensors: join run "
                                            f"{self.cfg.id!r} again with declared_tensors")

    def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization of this run; the first declaration fixes the run's tensor schema."""
        if organization not in self.cfg.organizations:
            raise WireError("unknown_organization", f"organization {organization!r} is not part of run {self.cfg.id!r}")
        if self.cfg.seed_set is not None:
            got = request.seed_set
            want = self.cfg.seed_set
            if got is None or got.id != want.id or got.sha256 != want.sha256:
                held = f"{got.id[:64]!r} (sha256 {got.sha256[:12]}…)" if got else "none"
                raise WireError(
                    "seed_set_mismatch",
                    f"run {self.cfg.id!r} uses seed set {want.id!r} (sha256 {want.sha256[:12]}…); the client holds {held}",
                )
        declares = bool(request.declared) and bool(self.spec.shared_schema)
        declared = contract.schema_from_declared(request.declared, self.spec) if declares else {}
        with self._cond:
            if declares:
                if self.schema:
                    contract.check_same_schema(self.schema, declared)
                else:
                    self.schema = declared
            new = organization not in self.joined or (declares and organization not in self.declared)
            self.joined.add(organization)
            if declares:
                self.declared.add(organization)
            if not self._deadline_armed:
                # The first round's clock starts when the first organization arrives.
                self._deadline_armed = True
                self.current.started = time.monotonic()
            if new:
                self._checkpoint()
            return JoinReply(
                run_id=self.cfg.id,
                algorithm=self.cfg.algorithm,
                config_json=self._config_json,
                current_round=self.round,
                total_rounds=self.cfg.rounds,
                seed=self.cfg.seed,
                organizations=tuple(self.cfg.organizations),
                declare_required=bool(self.spec.shared_schema) and organization not in self.declared,
            )

    # ----------------------------------------------------------------- instructions
    def round_seed(self, round_: int) -> int:
        """The seed of a round's shared random draws, derived from the run seed."""
        return int.from_bytes(hashlib.sha256(f"{self.cfg.seed}:{round_}".encode()).digest()[:8], "little")

    def _instructions_locked(self, organization: str) -> Encoded:
        """This organization's instructions for the open round, built once (once for all when broadcast)."""
        key = (self.round, "*" if self.half.broadcast else organization)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == self.round}
            payloads = self.half.payloads_for(self.phase, self.round, organization)
            self._cache[key] = messages.encode_instructions(Instructions(
                run_id=self.cfg.id, round=self.round, action=Action.of(self.phase), total_rounds=self.cfg.rounds,
                round_seed=self.round_seed(self.round), organization="" if self.half.broadcast else organization,
                payloads=payloads,
            ), self.wire_dtype)
        return self._cache[key]

    def _simple_locked(self, action: Action) -> Encoded:
        key = (self.round, action.value)
        if key not in self._cache:
            self._cache[key] = messages.encode_instructions(
                Instructions(self.cfg.id, self.round, action, self.cfg.rounds))
        return self._cache[key]

    def pull(self, organization: str, request: PullRequest, max_wait: float) -> Pulled:
        """Long-poll: the next instructions for ``organization``, or WAIT after ``request.wait_seconds``."""
        self._check_member(organization)
        deadline = time.monotonic() + min(request.wait_seconds, max_wait)
        with self._cond:
            while True:
                if self.phase is Phase.FINISHED:
                    return Pulled(self._simple_locked(Action.FINISH), self.round)
                if organization not in self.pushed and request.completed_round < self.round:
                    return Pulled(self._instructions_locked(organization), self.round)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Pulled(self._simple_locked(Action.WAIT), self.round)
                self._cond.wait(min(remaining, 1.0))

    def record_traffic(self, organization: str, round_: int, direction: str, b: TrafficBreakdown) -> None:
        """Count traffic with ``organization`` in the metrics and, when it belongs to the open round, its record."""
        with self._cond:
            self._count_locked(organization, round_, direction, b)

    def _count_locked(self, organization: str, round_: int, direction: str, b: TrafficBreakdown) -> None:
        self.metrics.traffic.record(self.cfg.id, self.cfg.algorithm, organization, direction, b)
        self.ledger.count(organization, direction, b)
        if round_ == self.current.round:
            (self.current.up if direction == "up" else self.current.down).add(b)

    # ----------------------------------------------------------------- push
    def admit_push(self, organization: str, round_: int) -> None:
        """Refuse a push from a non-member or for another round before its chunks are read."""
        self._check_member(organization)
        with self._cond:
            self._check_round_locked(round_)

    def push(self, organization: str, round_: int, update: ParsedUpdate, digest: bytes,
             up: TrafficBreakdown) -> PushReply:
        """Check, persist and fold in an update; idempotent by (run, round, organization)."""
        self._check_member(organization)
        with self._cond:
            self._check_round_locked(round_)
            phase = self.phase
            if organization in self.pushed:
                return self._duplicate_locked(organization, digest)
        received = update.check(self.spec, phase, self.schema, self.limits.max_tensor_elements, self.cfg.id, round_,
                                organization)
        self.half.validate(phase, organization, received)
        with self._cond:
            self._check_round_locked(round_)
            if organization in self.pushed:
                return self._duplicate_locked(organization, digest)
            self.store.write_update(round_, organization, update.data)
            self._fold(organization, received, digest)
            reply = PushReply(accepted=True, duplicate=False, round=round_)
            # Counted before the round can close, so both belong to this round's record.
            self._count_locked(organization, round_, "up", up)
            self._count_locked(organization, round_, "down",
                               with_envelope(TrafficBreakdown(), messages.push_reply_size(reply)))
            self._maybe_close_locked()
            return reply

    def _check_round_locked(self, round_: int) -> None:
        if self.phase is Phase.FINISHED:
            raise WireError("late", f"run {self.cfg.id!r} has finished; round {round_} is closed")
        if round_ != self.round:
            state = "is closed" if round_ < self.round else "has not started"
            raise WireError("late", f"round {round_} {state}; the current round is {self.round} ({self.phase.value})")

    def _duplicate_locked(self, organization: str, digest: bytes) -> PushReply:
        if self.pushed[organization] != digest:
            raise WireError(
                "replayed",
                f"organization {organization!r} already pushed a different update for round {self.round}",
            )
        self.metrics.duplicates.labels(self.cfg.id).inc()
        return PushReply(accepted=True, duplicate=True, round=self.round)

    def _figures(self, m: EvalMetrics) -> dict[str, float]:
        """Every reported figure by name, the spec's declared figures (by their key) included."""
        out = dict(m.extra)
        for f in self.spec.figures:
            value = m.test_accuracy if f.source == "test_accuracy" else m.extra.get(f.source)
            if value is not None:
                out[f.key] = value
        return out

    def _fold(self, organization: str, update: Received, digest: bytes) -> None:
        self.half.accumulate(self.phase, organization, update)
        self.pushed[organization] = digest
        self.ledger.pushed(organization, self.round)
        m = update.maybe(EvalMetrics)
        if m is not None:
            self.current.reports[organization] = m
            labels = (self.cfg.id, self.cfg.algorithm, organization)
            self.metrics.client_train_loss.labels(*labels).set(m.train_loss)
            self.metrics.client_test_accuracy.labels(*labels).set(m.test_accuracy)
            for name, value in self._figures(m).items():
                self.metrics.client_metric.labels(*labels, name).set(value)

    # ----------------------------------------------------------------- closing rounds
    def tick(self) -> None:
        """Close the open round if its deadline has passed with a quorum."""
        with self._cond:
            self._maybe_close_locked()

    def _maybe_close_locked(self) -> None:
        if self.phase is Phase.FINISHED or not self.pushed:
            return
        everyone = len(self.pushed) == len(self.cfg.organizations)
        overdue = (
            self._deadline_armed
            and time.monotonic() - self.current.started >= self.cfg.round_deadline_seconds
            and len(self.pushed) >= self.cfg.quorum
        )
        if everyone or overdue:
            self._close_locked()

    def _close_locked(self) -> None:
        self.half.close_round(self.phase, self.round)
        rec = self.current
        rec.duration = time.monotonic() - rec.started
        rec.clients = len(self.pushed)
        self.history.append(rec)
        self.store.append_history(rec.to_json())
        self.metrics.round_duration.labels(self.cfg.id, self.cfg.algorithm).observe(rec.duration)
        self.metrics.clients_per_round.labels(self.cfg.id, self.cfg.algorithm).set(rec.clients)
        figures = [self._figures(m) for m in rec.reports.values()]
        for name in {n for f in figures for n in f}:
            values = [f[name] for f in figures if name in f]
            self.metrics.client_metric_mean.labels(self.cfg.id, self.cfg.algorithm, name).set(sum(values) / len(values))
        log.info("run %s closed %s round %d with %d clients in %.2fs", self.cfg.id, self.phase.value, self.round,
                 rec.clients, rec.duration)
        k8s_events.emit("RoundClosed", f"run {self.cfg.id} closed {self.phase.value} round {self.round} "
                        f"with {rec.clients} clients in {rec.duration:.2f}s")
        if self.phase is Phase.SETUP:
            self.phase, self.round = Phase.TRAIN, 1
        elif self.phase is Phase.TRAIN and self.round < self.cfg.rounds:
            self.round += 1
        elif self.phase is Phase.TRAIN:
            self.phase, self.round = Phase.EVALUATE, self.round + 1
        else:
            self.phase = Phase.FINISHED
        self.pushed = {}
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._checkpoint()
        self.store.drop_rounds_before(self.round)
        self._publish_round_gauges()
        self._cond.notify_all()

    def _publish_round_gauges(self) -> None:
        self.metrics.current_round.labels(self.cfg.id, self.cfg.algorithm).set(self.round)

    # ----------------------------------------------------------------- status
    def status(self) -> RunStatus:
        """The run's state and per-round history."""
        with self._cond:
            # Closed rounds never change: each one's summary is built once (runs of thousands of rounds
            # are polled several times a second), the open round's every time.
            self._summaries.extend(rec.summary() for rec in self.history[len(self._summaries):])
            history = list(self._summaries)
            if self.phase is not Phase.FINISHED:
                history.append(self.current.summary(clients=len(self.pushed)))
            return RunStatus(
                run_id=self.cfg.id,
                algorithm=self.cfg.algorithm,
                phase=self.phase,
                round=self.round,
                total_rounds=self.cfg.rounds,
                organizations=tuple(self.cfg.organizations),
                pushed_this_round=tuple(sorted(self.pushed)),
                history=tuple(history),
                organization_status=self.ledger.statuses(self.cfg.organizations, self.joined),
            )
