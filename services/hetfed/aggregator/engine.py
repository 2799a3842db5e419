"""The round engine: one loop for every algorithm, durable, with quorum, deadlines and contract checks.

A run moves through phases: ``setup`` (round 0, only when the algorithm uploads something once),
``train`` (rounds 1..R), ``evaluate`` (round R+1: clients evaluate the final state and report
metrics) and ``finished``. A round closes when every organization has pushed, or once its deadline
has passed with at least the quorum. Every accepted update is on disk before it is acknowledged;
the server half's state is checkpointed atomically at each round close, and a restart replays the
open round's stored updates.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from hetfed.aggregator import k8s_events
from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.metrics import AggregatorMetrics
from hetfed.aggregator.org_ledger import OrganizationLedger
from hetfed.aggregator.store import RunStore
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, codec, contract
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, PayloadKind, by_kind
from hetfed.wire.specs import get_spec
from hetfed.wire.traffic import TrafficBreakdown, breakdown, payload_breakdown, with_envelope

log = logging.getLogger("hetfed.aggregator")

_STATE = {
    "setup": apb.RUN_STATE_SETUP,
    "train": apb.RUN_STATE_RUNNING,
    "evaluate": apb.RUN_STATE_EVALUATING,
    "finished": apb.RUN_STATE_FINISHED,
}
_ACTION = {"setup": apb.ACTION_SETUP, "train": apb.ACTION_TRAIN, "evaluate": apb.ACTION_EVALUATE}


@dataclass
class RoundRecord:
    """What happened in one round: who pushed, how long it took, traffic and reported metrics."""

    round: int
    phase: str
    started: float
    duration: float = 0.0
    clients: int = 0
    up: TrafficBreakdown = field(default_factory=TrafficBreakdown)
    down: TrafficBreakdown = field(default_factory=TrafficBreakdown)
    reports: dict[str, EvalMetrics] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form for checkpoints."""
        def tb(b: TrafficBreakdown) -> dict[str, list[int]]:
            return {k: [c.bytes, c.messages, c.elements] for k, c in b.kinds.items()}

        return {
            "round": self.round,
            "phase": self.phase,
            "duration": self.duration,
            "clients": self.clients,
            "up": tb(self.up),
            "down": tb(self.down),
            "reports": {
                org: [m.train_loss, m.num_train_examples, m.test_accuracy, m.test_loss, m.num_test_examples, m.extra]
                for org, m in self.reports.items()
            },
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RoundRecord:
        """Inverse of ``to_json``."""
        from hetfed.wire.traffic import KindCount

        def tb(x: dict[str, list[int]]) -> TrafficBreakdown:
            return TrafficBreakdown({k: KindCount(*v) for k, v in x.items()})

        rec = cls(d["round"], d["phase"], 0.0, d["duration"], d["clients"], tb(d["up"]), tb(d["down"]))
        rec.reports = {
            org: EvalMetrics(train_loss=v[0], num_train_examples=v[1], test_accuracy=v[2], test_loss=v[3],
                             num_test_examples=v[4], extra=dict(v[5]))
            for org, v in d["reports"].items()
        }
        return rec


class Run:
    """One federated run hosted by the aggregator; thread-safe."""

    def __init__(self, cfg: RunConfig, state_dir: str, metrics: AggregatorMetrics, chunk_bytes: int,
                 max_update_bytes: int, max_tensor_elements: int) -> None:
        self.cfg = cfg
        self.spec = get_spec(cfg.algorithm)
        self.train_config = cfg.train_config()
        self.wire_dtype = None if self.train_config.wire_dtype == "float32" else self.train_config.wire_dtype
        self.half = make_server_half(cfg.algorithm, self.train_config, cfg.seed)
        self.store = RunStore(state_dir, cfg.id)
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self.max_update_bytes = max_update_bytes
        self.max_tensor_elements = max_tensor_elements
        self._cond = threading.Condition()
        self.phase = "setup" if self.spec.setup_upload else "train"
        self.round = 0 if self.phase == "setup" else 1
        self.schema: contract.Schema = {}
        self.joined: set[str] = set()
        self.pushed: dict[str, bytes] = {}  # organization -> SHA-256 of its accepted update this round
        self.history: list[RoundRecord] = []
        self.ledger = OrganizationLedger()  # per organization: last accepted round, bytes up and down
        self._summaries: list[apb.RoundSummary] = []  # status() summaries of history[:len], built once
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = False
        # (round, organization or "*") -> the instructions' chunks and their payload-only traffic breakdown
        self._cache: dict[tuple[int, str], tuple[list[apb.Chunk], TrafficBreakdown]] = {}
        self._restore()
        self._publish_round_gauges()

    # ----------------------------------------------------------------- durability
    def _meta(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "round": self.round,
            "schema": {
                k.value: {n: [d.dtype, list(d.shape)] for n, d in t.items()} for k, t in self.schema.items()
            },
            "joined": sorted(self.joined),
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
        self.phase, self.round = meta["phase"], int(meta["round"])
        self.schema = {
            PayloadKind(k): {n: contract.TensorDecl(d[0], tuple(d[1])) for n, d in t.items()}
            for k, t in meta["schema"].items()
        }
        self.joined = set(meta["joined"])
        self.ledger = OrganizationLedger.from_json(meta.get("organizations"))
        records = meta["history"] if "history" in meta else self.store.load_history(int(meta["history_len"]))
        self.history = [RoundRecord.from_json(r) for r in records]
        self.half.load_state(arrays)
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = bool(self.joined)
        replayed = 0
        for org, data in self.store.updates(self.round):
            update = apb.Update.FromString(data)
            payloads = contract.check_update(
                self.spec, self.phase, update.payloads, self.schema, self.max_tensor_elements
            )
            self._fold(org, by_kind(payloads), hashlib.sha256(data).digest())
            replayed += 1
        log.info("run %s resumed at %s round %d with %d stored updates", self.cfg.id, self.phase,
                 self.round, replayed)
        self._maybe_close_locked()

    # ----------------------------------------------------------------- join
    def join(self, organization: str, request: apb.JoinRequest) -> apb.JoinResponse:
        """Admit an organization of this run; the first join fixes the run's tensor schema."""
        if organization not in self.cfg.organizations:
            raise WireError("unknown_organization", f"organization {organization!r} is not part of run {self.cfg.id!r}")
        if self.cfg.seed_set is not None:
            got = request.seed_set
            if got.id != self.cfg.seed_set.id or got.sha256 != self.cfg.seed_set.sha256:
                raise WireError(
                    "seed_set_mismatch",
                    f"run {self.cfg.id!r} uses seed set {self.cfg.seed_set.id!r} "
                    f"(sha256 {self.cfg.seed_set.sha256[:12]}…); the client holds {got.id!r} "
                    f"(sha256 {got.sha256[:12]}…)",
                )
        declared = contract.schema_from_declared(request.declared_tensors, self.spec) if self.spec.shared_schema else {}
        with self._cond:
            if self.spec.shared_schema:
                if self.schema:
                    contract.check_same_schema(self.schema, declared)
                else:
                    self.schema = declared
            new = organization not in self.joined
            self.joined.add(organization)
            if not self._deadline_armed:
                # The first round's clock starts when the first organization arrives.
                self._deadline_armed = True
                self.current.started = time.monotonic()
            if new:
                self._checkpoint()
            return apb.JoinResponse(
                run_id=self.cfg.id,
                algorithm=self.cfg.algorithm,
                algorithm_config_json=_config_json(self.train_config),
                current_round=self.round,
                total_rounds=self.cfg.rounds,
                seed=self.cfg.seed,
                organizations=list(self.cfg.organizations),
            )

    # ----------------------------------------------------------------- instructions
    def _check_member(self, organization: str) -> None:
        if organization not in self.cfg.organizations:
            raise WireError("unknown_organization", f"organization {organization!r} is not part of run {self.cfg.id!r}")
        if organization not in self.joined:
            raise WireError("not_joined", f"organization {organization!r} must Join run {self.cfg.id!r} first")

    def round_seed(self, round_: int) -> int:
        """The seed of a round's shared random draws, derived from the run seed."""
        return int.from_bytes(hashlib.sha256(f"{self.cfg.seed}:{round_}".encode()).digest()[:8], "little")

    def _instructions_locked(self, organization: str) -> tuple[list[apb.Chunk], TrafficBreakdown]:
        """This organization's instructions for the open round, built once (once for all when broadcast)."""
        key = (self.round, "*" if self.half.broadcast else organization)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == self.round}
            ins = apb.Instructions(
                envelope=apb.Envelope(
                    run_id=self.cfg.id, round=self.round,
                    organization_id="" if self.half.broadcast else organization,
                ),
                action=_ACTION[self.phase],  # type: ignore[arg-type]
                round_seed=self.round_seed(self.round),
                total_rounds=self.cfg.rounds,
            )
            for p in self.half.payloads_for(self.phase, self.round, organization):
                codec.fill_payload(ins.payloads.add(), p, self.wire_dtype)  # in place: no extra tensor copy
                ins.envelope.payload_kinds.append(p.kind.proto_enum)  # type: ignore[arg-type]
            self._cache[key] = (list(chunks.split(ins.SerializeToString(), self.chunk_bytes)),
                                payload_breakdown(ins.payloads))
        return self._cache[key]

    def instructions(self, organization: str, completed_round: int,
                     wait: float) -> tuple[list[apb.Chunk], TrafficBreakdown, int]:
        """Long-poll: the next instructions for ``organization`` (chunks, payload traffic, round), or WAIT."""
        self._check_member(organization)
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if self.phase == "finished":
                    return self._simple(apb.ACTION_FINISH), TrafficBreakdown(), self.round
                if organization not in self.pushed and completed_round < self.round:
                    chunk_list, payload_traffic = self._instructions_locked(organization)
                    return chunk_list, payload_traffic, self.round
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return self._simple(apb.ACTION_WAIT), TrafficBreakdown(), self.round
                self._cond.wait(min(remaining, 1.0))

    def _simple(self, action: int) -> list[apb.Chunk]:
        ins = apb.Instructions(
            envelope=apb.Envelope(run_id=self.cfg.id, round=self.round),
            action=action,  # type: ignore[arg-type]
            total_rounds=self.cfg.rounds,
        )
        return list(chunks.split(ins.SerializeToString(), self.chunk_bytes))

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

    def push(self, organization: str, round_: int, data: bytes, digest: bytes,
             wire_bytes: int, n_chunks: int) -> apb.PushUpdateResponse:
        """Check, persist and fold in an update; idempotent by (run, round, organization)."""
        self._check_member(organization)
        with self._cond:
            self._check_round_locked(round_)
            phase = self.phase
            if organization in self.pushed:
                return self._duplicate_locked(organization, digest)
        try:
            update = apb.Update.FromString(data)
        except DecodeError as exc:
            raise WireError("malformed", f"the update is not a valid hetfed.v1.Update: {exc}") from None
        env = update.envelope
        if env.run_id != self.cfg.id or env.round != round_ or env.organization_id != organization:
            raise WireError(
                "envelope_mismatch",
                f"envelope says run {env.run_id!r} round {env.round} organization {env.organization_id!r}; "
                f"the stream is for run {self.cfg.id!r} round {round_} organization {organization!r}",
            )
        try:
            declared_kinds = [PayloadKind.from_proto_enum(k).value for k in env.payload_kinds]
        except ValueError as exc:
            raise WireError("malformed", f"the envelope lists an unknown payload kind: {exc}") from None
        actual_kinds = [codec.payload_kind_of(p).value for p in update.payloads]
        if declared_kinds != actual_kinds:
            raise WireError("envelope_mismatch", f"envelope lists {declared_kinds}, the update carries {actual_kinds}")
        payloads = by_kind(
            contract.check_update(self.spec, phase, update.payloads, self.schema, self.max_tensor_elements)
        )
        self.half.validate(phase, organization, payloads)
        up = breakdown(update.payloads, wire_bytes, messages=n_chunks)
        with self._cond:
            self._check_round_locked(round_)
            if organization in self.pushed:
                return self._duplicate_locked(organization, digest)
            self.store.write_update(round_, organization, data)
            self._fold(organization, payloads, digest)
            resp = apb.PushUpdateResponse(accepted=True, duplicate=False, round=round_)
            # Counted before the round can close, so both belong to this round's record.
            self._count_locked(organization, round_, "up", up)
            self._count_locked(organization, round_, "down", with_envelope(TrafficBreakdown(), resp.ByteSize()))
            self._maybe_close_locked()
            return resp

    def _check_round_locked(self, round_: int) -> None:
        if self.phase == "finished":
            raise WireError("late", f"run {self.cfg.id!r} has finished; round {round_} is closed")
        if round_ != self.round:
            state = "is closed" if round_ < self.round else "has not started"
            raise WireError("late", f"round {round_} {state}; the current round is {self.round} ({self.phase})")

    def _duplicate_locked(self, organization: str, digest: bytes) -> apb.PushUpdateResponse:
        if self.pushed[organization] != digest:
            raise WireError(
                "replayed",
                f"organization {organization!r} already pushed a different update for round {self.round}",
            )
        self.metrics.duplicates.labels(self.cfg.id).inc()
        return apb.PushUpdateResponse(accepted=True, duplicate=True, round=self.round)

    def _fold(self, organization: str, payloads: dict[PayloadKind, Any], digest: bytes) -> None:
        self.half.accumulate(self.phase, organization, payloads)
        self.pushed[organization] = digest
        self.ledger.pushed(organization, self.round)
        m = payloads.get(PayloadKind.EVAL_METRICS)
        if isinstance(m, EvalMetrics):
            self.current.reports[organization] = m
            labels = (self.cfg.id, self.cfg.algorithm, organization)
            self.metrics.client_train_loss.labels(*labels).set(m.train_loss)
            self.metrics.client_test_accuracy.labels(*labels).set(m.test_accuracy)
            for name, value in m.extra.items():
                self.metrics.client_metric.labels(*labels, name).set(value)

    # ----------------------------------------------------------------- closing rounds
    def tick(self) -> None:
        """Close the open round if its deadline has passed with a quorum."""
        with self._cond:
            self._maybe_close_locked()

    def _maybe_close_locked(self) -> None:
        if self.phase == "finished" or not self.pushed:
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
        for name in {n for m in rec.reports.values() for n in m.extra}:
            values = [m.extra[name] for m in rec.reports.values() if name in m.extra]
            self.metrics.client_metric_mean.labels(self.cfg.id, self.cfg.algorithm, name).set(sum(values) / len(values))
        log.info("run %s closed %s round %d with %d clients in %.2fs", self.cfg.id, self.phase, self.round,
                 rec.clients, rec.duration)
        k8s_events.emit("RoundClosed", f"run {self.cfg.id} closed {self.phase} round {self.round} with {rec.clients} clients in {rec.duration:.2f}s")
        if self.phase == "setup":
            self.phase, self.round = "train", 1
        elif self.phase == "train" and self.round < self.cfg.rounds:
            self.round += 1
        elif self.phase == "train":
            self.phase, self.round = "evaluate", self.round + 1
        else:
            self.phase = "finished"
        self.pushed = {}
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._checkpoint()
        self.store.drop_rounds_before(self.round)
        self._publish_round_gauges()
        self._cond.notify_all()

    def _publish_round_gauges(self) -> None:
        self.metrics.current_round.labels(self.cfg.id, self.cfg.algorithm).set(self.round)

    # ----------------------------------------------------------------- status
    def status(self) -> apb.RunStatus:
        """The run's state and per-round history."""
        with self._cond:
            out = apb.RunStatus(
                run_id=self.cfg.id,
                algorithm=self.cfg.algorithm,
                state=_STATE[self.phase],  # type: ignore[arg-type]
                round=self.round,
                total_rounds=self.cfg.rounds,
                organizations=list(self.cfg.organizations),
                pushed_this_round=sorted(self.pushed),
            )
            self.ledger.fill(out, self.cfg.organizations, self.joined)
            # Closed rounds never change: each one's summary is built once (runs of thousands of rounds
            # are polled several times a second), the open round's every time.
            self._summaries.extend(self._summary(rec) for rec in self.history[len(self._summaries):])
            out.history.extend(self._summaries)
            if self.phase != "finished":
                out.history.append(self._summary(self.current))
            return out

    def _summary(self, rec: RoundRecord) -> apb.RoundSummary:
        s = apb.RoundSummary(round=rec.round, clients=rec.clients or len(self.pushed), duration_seconds=rec.duration)
        for direction, tb in (("up", rec.up), ("down", rec.down)):
            for kind, c in sorted(tb.kinds.items()):
                s.traffic.add(direction=direction, payload_kind=kind, bytes=c.bytes,
                              messages=c.messages, elements=c.elements)
        for org, m in sorted(rec.reports.items()):
            s.reports.add(organization_id=org, metrics=codec.payload_to_proto(m).eval_metrics)
        return s


def _config_json(config: Any) -> str:
    import json

    from hetfed.wire.config import to_mapping

    return json.dumps(to_mapping(config), sort_keys=True)
