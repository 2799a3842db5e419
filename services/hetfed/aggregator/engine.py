"""The round engine: one loop for every algorithm, durable, with quorum, deadlines and contract checks.

A run moves through phases (``hetfed.wire.phases.Phase``): setup (round 0, only when the algorithm uploads
something once), train (rounds 1..R), evaluate (round R+1: clients evaluate the final state and report
metrics) and finished. A round closes when every organization has pushed, or once its deadline has passed
with at least the quorum. Every accepted update is on disk before it is acknowledged; the server half's
state is checkpointed atomically at each round close, and a restart replays the open round's stored updates.
The engine sees typed messages only: the wire package converts at the gRPC boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hetfed.aggregator import k8s_events
from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.crashpoints import crash_point
from hetfed.aggregator.metrics import AggregatorMetrics
from hetfed.aggregator.org_ledger import OrganizationLedger
from hetfed.aggregator.store import Disk, RunConflictError, RunStore, StateError, StorageError
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
    Refusal,
    RoundSummary,
    RunStatus,
)
from hetfed.wire.payloads import (
    EvalMetrics,
    FactorizedWeights,
    HeadWeights,
    ModelWeights,
    Received,
    training_examples,
)
from hetfed.wire.phases import Action, Phase
from hetfed.wire.rpc import Pulled, clip
from hetfed.wire.traffic import KindCount, TrafficBreakdown, with_envelope

log = logging.getLogger("hetfed.aggregator")
# Payloads whose example count is an aggregation weight.
WEIGHTED = (ModelWeights, HeadWeights, FactorizedWeights)


@dataclass(frozen=True)
class Limits:
    """Per-run limits on what arrives and how instructions are chunked."""

    chunk_bytes: int
    max_update_bytes: int
    max_tensor_elements: int
    # Example counts: an organization's declared training examples bound its updates' counts; this bounds
    # the declaration itself, and every count of an organization that declared none.
    max_examples: int = 1_000_000_000
    # Named figures (EvalMetrics.extra) in one report, and the length of every name a client chooses
    # (figures, declared tensors).
    max_metrics_per_report: int = 64
    max_name_chars: int = 128
    max_declared_tensors: int = 10_000


class Changes:
    """Wakes long-polls waiting in an asyncio event loop, from any thread, when a run's state changes.

    A waiter costs a future, not a thread; a cancelled wait (the client gave up) removes itself at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    @property
    def waiting(self) -> int:
        """How many long-polls wait now."""
        return len(self._waiters)

    def notify(self) -> None:
        """Wake every waiter (callable from any thread).

        Waiters are woken ``WAKE_BATCH`` per event-loop iteration, not all at once: a thousand long-polls woken
        in one iteration would run their next steps back to back while health checks, pushes and Status
        calls that arrived meanwhile wait behind all of them."""
        with self._lock:
            self.version += 1
            waiters, self._waiters = self._waiters, set()
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for loop, fut in waiters:
            by_loop.setdefault(loop, []).append(fut)
        for loop, futs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its waiters are gone
                loop.call_soon_threadsafe(_wake_batches, futs)

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once the version is no longer ``seen``, or after ``timeout`` seconds; cancellable."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        with self._lock:
            if self.version != seen:
                return
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(entry[1], timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(entry)


# Long-polls woken per event-loop iteration when a run changes (see ``Changes.notify``).
WAKE_BATCH = 32
# Non-members refused lately that Status lists (their names are the caller's choice: bounded).
MAX_LISTED_STRANGERS = 16
# Per-organization instruction messages a run keeps built (memory does not grow with the federation).
PER_ORGANIZATION_INSTRUCTIONS = 8


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake_batches(futs: list[asyncio.Future[None]]) -> None:
    """Wake the first ``WAKE_BATCH`` of ``futs`` now and the rest in later iterations (on the loop)."""
    for fut in futs[:WAKE_BATCH]:
        _wake(fut)
    if len(futs) > WAKE_BATCH:
        asyncio.get_running_loop().call_soon(_wake_batches, futs[WAKE_BATCH:])


def _bad_name(name: str, limit: int) -> str:
    """Why a client-chosen name is refused ("" when it is acceptable)."""
    if not name:
        return "is empty"
    if len(name) > limit:
        return f"has {len(name)} characters; at most {limit}"
    if any(unicodedata.category(c)[0] == "C" for c in name):
        return "holds control characters"
    return ""


def _check_metric_domains(m: EvalMetrics) -> None:
    """WireError ``implausible_metric`` for a test accuracy outside [0, 1] or a negative loss (NaN and
    infinities are refused earlier, ``non_finite``)."""
    if not 0.0 <= m.test_accuracy <= 1.0:
        raise WireError("implausible_metric", f"eval_metrics.test_accuracy is {m.test_accuracy:.6g}; an accuracy "
                                              "is in [0, 1] (the run's check_metric_domains)")
    for name in ("train_loss", "test_loss"):
        value = getattr(m, name)
        if not (math.isfinite(value) and value >= 0.0):
            raise WireError("implausible_metric", f"eval_metrics.{name} is {value:.6g}; a loss is finite and >= 0 "
                                                  "(the run's check_metric_domains)")


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
    """One federated run hosted by the aggregator; thread-safe (see the module docstring)."""

    def __init__(self, cfg: RunConfig, state_dir: str, metrics: AggregatorMetrics, limits: Limits,
                 disk: Disk | None = None) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.train_config = cfg.train_config()
        self.wire_dtype = None if self.train_config.wire_dtype == "float32" else self.train_config.wire_dtype
        self.half = self._new_half()
        self.store = RunStore(state_dir, cfg.id, disk)
        self.metrics = metrics
        self.limits = limits
        # Example counts: the run's bound, within the server's.
        self.max_examples = min(limits.max_examples, cfg.max_examples)
        self._lock = threading.RLock()
        # A closed round's checkpoint is written after its clients are woken (outside the lock); until it is
        # on disk, pushes and joins of the next round wait on _committed.
        self._committed = threading.Condition(self._lock)
        self._commit_lock = threading.Lock()  # one checkpoint writer at a time
        self._pending: tuple[dict[str, Any], dict[str, Any], int] | None = None  # (meta, arrays, drop before)
        self._commit_error = ""
        self._traffic_lock = threading.Lock()  # never held across I/O: the event loop counts traffic
        self.changes = Changes()
        self.phase = self.spec.first_phase
        self.round = 0 if self.phase is Phase.SETUP else 1
        self.schema: contract.Schema = {}
        self.joined: set[str] = set()
        self.declared: set[str] = set()  # organizations whose tensor declaration matched the run's schema
        self.examples: dict[str, int] = {}  # organization -> training examples it declared at Join
        self.pushed: dict[str, bytes] = {}  # organization -> SHA-256 of its accepted update this round
        self._committing: set[str] = set()  # organizations whose logged update is being synced, not yet folded
        self.history: list[RoundRecord] = []
        self.ledger = OrganizationLedger()  # per organization: last accepted round, bytes up and down
        # Members refused for a reason no retry can fix: organization -> (reason, message). They no longer hold a
        # round open. A few non-members refused lately are kept for Status (never in metrics: unbounded names).
        self.refused: dict[str, tuple[str, str]] = {}
        self._strangers: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._summaries: list[RoundSummary] = []  # Status summaries of history[:len], built once
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = False
        # The server half's memory is ahead of the durable state (a close failed after changing it).
        self._stale = False
        self._close_error = ""
        # (round, organization or "*") -> the encoded instructions of the open round: the broadcast message, or
        # at most PER_ORGANIZATION_INSTRUCTIONS per-organization ones (least recently used first out; one evicted
        # is rebuilt, identically, should its organization pull again)
        self._cache: OrderedDict[tuple[int, str], Encoded] = OrderedDict()
        self._wait: tuple[int, Encoded] | None = None
        self._finish: Encoded | None = None
        # The figure names each organization reported last, and the means published last: a name nobody
        # reports any more leaves the metrics, so label values stay bounded by the last reports.
        self._figure_names: dict[str, set[str]] = {}
        self._mean_names: set[str] = set()
        self._config_json = json.dumps(to_mapping(self.train_config), sort_keys=True)
        try:
            with self._lock:
                self._restore()
        except BaseException:
            self.store.close()  # its lock too: the aggregator may go on serving the other runs
            raise
        self.commit_pending()
        self._publish_round_gauges()

    def _new_half(self) -> ServerHalf:  # type: ignore[type-arg]
        return make_server_half(self.spec, self.train_config, self.cfg.run_info())

    # ----------------------------------------------------------------- durability
    def _meta(self, phase: Phase | None = None, round_: int | None = None, schema: contract.Schema | None = None,
              joined: set[str] | None = None, declared: set[str] | None = None,
              examples: dict[str, int] | None = None) -> dict[str, Any]:
        """The checkpoint's metadata: the run's state, with the given parts replaced (not yet committed)."""
        return {
            "phase": (phase or self.phase).value,
            "round": self.round if round_ is None else round_,
            "schema": contract.schema_to_json(self.schema if schema is None else schema),
            "joined": sorted(self.joined if joined is None else joined),
            "declared": sorted(self.declared if declared is None else declared),
            "examples": dict(sorted((self.examples if examples is None else examples).items())),
            "organizations": self.ledger.to_json(),
            "algorithm": self.cfg.algorithm,
            "refused": {org: list(v) for org, v in sorted(self.refused.items())},
        }

    def _restore(self) -> None:
        try:
            loaded = self.store.recover()
        except StateError as exc:
            raise StateError(f"run {self.cfg.id!r}: {exc}") from None
        if loaded is None:
            try:
                self.store.save_checkpoint(self._meta(), self.half.state())
            except StorageError as exc:
                raise StateError(f"run {self.cfg.id!r}: cannot write its first checkpoint: {exc}") from None
            return
        meta = loaded.meta
        where = self.store.checkpoint_path
        stored = meta.get("algorithm") if isinstance(meta, dict) else None
        if stored is not None and stored != self.cfg.algorithm:
            raise RunConflictError(f"run {self.cfg.id!r}: its state in {self.store.dir} was written by algorithm "
                                   f"{stored!r}, the config now names {self.cfg.algorithm!r}; give the run a new id, "
                                   "or remove that directory to start it over")
        try:
            self.phase, self.round = Phase(meta["phase"]), int(meta["round"])
            self.schema = contract.schema_from_json(meta["schema"])
            self.joined = set(meta["joined"])
            self.declared = set(meta.get("declared", meta["joined"]))
            self.examples = {str(k): int(v) for k, v in meta.get("examples", {}).items()}
            self.ledger = OrganizationLedger.from_json(meta.get("organizations"))
            self.refused = {str(o): (str(v[0]), str(v[1])) for o, v in meta.get("refused", {}).items()
                            if o in self.cfg.organizations}
        except (KeyError, ValueError, TypeError) as exc:
            raise StateError(f"run {self.cfg.id!r}: {where} holds invalid metadata ({type(exc).__name__}: {exc})") \
                from None
        try:
            self.history = [RoundRecord.from_json(r) for r in loaded.history]
        except (KeyError, ValueError, TypeError) as exc:
            raise StateError(f"run {self.cfg.id!r}: {self.store.history_path} holds an invalid record "
                             f"({type(exc).__name__}: {exc})") from None
        try:
            self.half.load_state(loaded.arrays)
        except Exception as exc:
            raise RunConflictError(f"run {self.cfg.id!r}: the arrays in {where} do not fit algorithm "
                                   f"{self.cfg.algorithm!r} as configured ({type(exc).__name__}: {exc}); give the "
                                   "run a new id, or remove its state directory to start it over") from None
        for org, (reason, _) in self.refused.items():
            self.metrics.refused_organizations.labels(self.cfg.id, org, reason).set(1)
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = bool(self.joined)
        if self.phase is Phase.FINISHED:
            self.store.drop_rounds_before(self.round + 1)
            log.info("run %s resumed finished after %d rounds", self.cfg.id, len(self.history))
            return
        replayed = 0
        for org, received, digest in self._logged_updates():
            self._fold(org, received, digest)
            replayed += 1
        log.info("run %s resumed at %s round %d with %d stored updates", self.cfg.id, self.phase.value,
                 self.round, replayed)
        self._try_close_locked()

    def _logged_updates(self) -> list[tuple[str, Received, bytes]]:
        """The open round's logged updates, checked again; one that no longer passes is skipped (and logged)."""
        out = []
        for org, data in self.store.updates(self.round):
            try:
                if org not in self.cfg.organizations:
                    raise WireError("unknown_organization", f"{clip(org, 64)!r} is not part of the run")
                update = ParsedUpdate(data).check(self.spec, self.phase, self.schema, self.limits.max_tensor_elements,
                                                  self.cfg.id, self.round, org)
            except WireError as err:
                log.error("run %s: the logged update of %r for round %d is skipped (%s); the organization is asked "
                          "for it again", self.cfg.id, clip(org, 64), self.round, err)
                continue
            out.append((org, update, hashlib.sha256(data).digest()))
        return out

    def _fresh_locked(self) -> None:
        """Rebuild the server half from the durable state when a failed close left it ahead of the disk."""
        if not self._stale:
            return
        try:
            _, arrays = self.store.read_checkpoint()
            half = self._new_half()
            half.load_state(arrays)
            for org, received, _ in self._logged_updates():
                if org in self.pushed:
                    half.accumulate(self.phase, org, self._weighted(org, received))
        except (StateError, OSError) as exc:
            raise WireError("storage_unavailable", f"run {self.cfg.id!r} cannot reload its state after a failed "
                                                   f"write ({exc})") from None
        self.half = half
        self._stale = False
        log.info("run %s: server state rebuilt from the checkpoint and %d logged updates", self.cfg.id,
                 len(self.pushed))

    def close(self) -> None:
        """Write the last close's checkpoint if it is still pending, then close the run's files."""
        self.commit_pending()
        with self._lock:
            self.store.close()

    # ----------------------------------------------------------------- join
    def check_member(self, organization: str) -> None:
        """Refuse an organization that is not in the run, has not joined, or owes its declaration (lock-free)."""
        if organization not in self.cfg.organizations:
            raise WireError("unknown_organization", f"organization {clip(organization, 64)!r} is not part of run "
                                                    f"{self.cfg.id!r}")
        if organization not in self.joined:
            raise WireError("not_joined", f"organization {organization!r} must Join run {self.cfg.id!r} first")
        if self.spec.shared_schema and organization not in self.declared:
            raise WireError("not_declared", f"organization {organization!r} must declare its tensors: join run "
                                            f"{self.cfg.id!r} again with declared_tensors")

    def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization of this run; the first declaration fixes the run's tensor schema."""
        if organization not in self.cfg.organizations:
            raise WireError("unknown_organization", f"organization {clip(organization, 64)!r} is not part of run "
                                                    f"{self.cfg.id!r}")
        if self.phase is Phase.FINISHED:
            raise WireError("run_finished", f"run {self.cfg.id!r} finished after {len(self.history)} rounds (its "
                                            f"state is in {self.store.dir}); to train again give the run a new id, "
                                            "or remove its state to start it over")
        if self.cfg.seed_set is not None:
            got = request.seed_set
            want = self.cfg.seed_set
            if got is None or got.id != want.id or got.sha256 != want.sha256:
                held = f"{got.id[:64]!r} (sha256 {got.sha256[:12]}…)" if got else "none"
                raise WireError(
                    "seed_set_mismatch",
                    f"run {self.cfg.id!r} uses seed set {want.id!r} (sha256 {want.sha256[:12]}…); the client holds {held}",
                )
        n = request.num_train_examples
        if not 0 <= n <= self.max_examples:
            raise WireError("invalid_value", f"num_train_examples must be in [0, {self.max_examples}] (the run's "
                                             f"max_examples, server.max_examples_per_organization), got {n}")
        if len(request.declared) > self.limits.max_declared_tensors:
            raise WireError("oversized", f"{len(request.declared)} declared tensors; at most "
                                         f"{self.limits.max_declared_tensors}")
        for d in request.declared:
            bad = _bad_name(d.name, self.limits.max_name_chars)
            if bad:
                raise WireError("invalid_value", f"declared tensor name {clip(d.name, 64)!r} {bad}")
        declares = bool(request.declared) and bool(self.spec.shared_schema)
        declared_schema = contract.schema_from_declared(request.declared, self.spec) if declares else {}
        with self._lock:
            self._await_commit_locked()  # a join's checkpoint must not overtake the last close's
            schema = self.schema
            if declares:
                if schema:
                    contract.check_same_schema(schema, declared_schema)
                else:
                    schema = declared_schema
            joined = self.joined | {organization}
            declared = self.declared | {organization} if declares else self.declared
            examples = {**self.examples, organization: n} if n else self.examples
            if (joined, declared, examples, schema) != (self.joined, self.declared, self.examples, self.schema):
                self._fresh_locked()
                try:
                    self.store.save_checkpoint(self._meta(schema=schema, joined=joined, declared=declared,
                                                          examples=examples), self.half.state())
                except StorageError as exc:
                    self._storage_failed(exc)
                self.schema, self.joined, self.declared, self.examples = schema, joined, declared, examples
            self._unrefuse_locked(organization)
            if not self._deadline_armed:
                # The first round's clock starts when the first organization arrives.
                self._deadline_armed = True
                self.current.started = time.monotonic()
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

    def _storage_failed(self, exc: StorageError) -> NoReturn:
        self.metrics.storage_errors.labels(self.cfg.id).inc()
        raise WireError("storage_unavailable", f"{exc}; nothing changed: try again") from None

    # ----------------------------------------------------------------- instructions
    def round_seed(self, round_: int) -> int:
        """The seed of a round's shared random draws, derived from the run seed."""
        return int.from_bytes(hashlib.sha256(f"{self.cfg.seed}:{round_}".encode()).digest()[:8], "little")

    def _instructions_locked(self, organization: str) -> Encoded:
        """This organization's instructions for the open round, built once (once for all when broadcast)."""
        key = (self.round, "*" if self.half.broadcast else organization)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        for old in [k for k in self._cache if k[0] != self.round]:
            del self._cache[old]
        payloads = self.half.payloads_for(self.phase, self.round, organization)
        encoded = self._cache[key] = messages.encode_instructions(Instructions(
            run_id=self.cfg.id, round=self.round, action=Action.of(self.phase), total_rounds=self.cfg.rounds,
            round_seed=self.round_seed(self.round), organization="" if self.half.broadcast else organization,
            payloads=payloads,
        ), self.wire_dtype)
        while len(self._cache) > PER_ORGANIZATION_INSTRUCTIONS:  # per-organization messages only ever exceed it
            self._cache.popitem(last=False)
        return encoded

    def poll(self, organization: str, request: PullRequest) -> Pulled | None:
        """The organization's next instructions if there are any now, else None (it waits on ``changes``).

        An organization that has not pushed in the open round gets its instructions even when it says it
        completed this round: the aggregator lost its update (a damaged log), so it is asked again.
        """
        with self._lock:
            if self.phase is Phase.FINISHED:
                if self._finish is None:
                    self._finish = messages.encode_instructions(
                        Instructions(self.cfg.id, self.round, Action.FINISH, self.cfg.rounds))
                return Pulled(self._finish, self.round)
            if organization not in self.pushed and request.completed_round <= self.round:
                self._fresh_locked()
                return Pulled(self._instructions_locked(organization), self.round)
            return None

    def wait_reply(self) -> Pulled:
        """The WAIT instructions of the open round (lock-free: the event loop answers an expired long-poll)."""
        cached = self._wait
        round_ = self.round
        if cached is None or cached[0] != round_:
            cached = (round_, messages.encode_instructions(
                Instructions(self.cfg.id, round_, Action.WAIT, self.cfg.rounds)))
            self._wait = cached
        return Pulled(cached[1], cached[0])

    def record_traffic(self, organization: str, round_: int, direction: str, b: TrafficBreakdown) -> None:
        """Count traffic with ``organization`` in the metrics and, when it belongs to the open round, its record."""
        self.metrics.traffic.record(self.cfg.id, self.cfg.algorithm, organization, direction, b)
        self.ledger.count(organization, direction, b)
        with self._traffic_lock:
            current = self.current
            if round_ == current.round:
                (current.up if direction == "up" else current.down).add(b)

    # ----------------------------------------------------------------- push
    def admit_push(self, organization: str, round_: int) -> None:
        """Refuse a push from a non-member or for another round before its chunks are read (lock-free)."""
        self.check_member(organization)
        self._check_round(round_)

    def _check_limits(self, organization: str, update: Received) -> None:
        """Example counts within what the organization declared (or the maximum); bounded named figures."""
        declared = self.examples.get(organization, 0)
        if self.cfg.example_weights == "declared" and not declared and any(
                isinstance(p, WEIGHTED) for p in update):
            raise WireError("invalid_value", f"run {self.cfg.id!r} weighs updates by the training examples declared "
                                             f"at Join (example_weights = 'declared'); {organization!r} declared none")
        bound = declared or self.max_examples
        why = (f"{organization!r} declared {declared} training examples at Join" if declared else
               f"it declared none, and the limit is {self.max_examples} (the run's max_examples, "
               "server.max_examples_per_organization)")
        for p in update:
            n = training_examples(p)
            if n is not None and not 0 <= n <= bound:
                raise WireError("invalid_value", f"{p.kind.value} claims {n} training examples; {why}")
            if isinstance(p, EvalMetrics):
                if not 0 <= p.num_test_examples <= self.max_examples:
                    raise WireError("invalid_value", f"eval_metrics claims {p.num_test_examples} test examples; the "
                                                     f"limit is {self.max_examples}")
                if self.cfg.check_metric_domains:
                    _check_metric_domains(p)
                if len(p.extra) > self.limits.max_metrics_per_report:
                    raise WireError("oversized", f"eval_metrics carries {len(p.extra)} named figures; at most "
                                                 f"{self.limits.max_metrics_per_report} (server.max_metrics_per_report)")
                for name in p.extra:
                    bad = _bad_name(name, self.limits.max_name_chars)
                    if bad:
                        raise WireError("invalid_value", f"eval_metrics figure name {clip(name, 64)!r} {bad}")

    def push(self, organization: str, round_: int, update: ParsedUpdate, digest: bytes,
             up: TrafficBreakdown, defer_commit: bool = False) -> PushReply:
        """Check, log durably and fold in an update; idempotent by (run, round, organization).

        ``digest`` is the SHA-256 of ``update.data``. When the update completes the round, the round's
        checkpoint is written before returning, or, with ``defer_commit``, left to the caller's
        ``commit_pending`` (so the acknowledgement need not wait for it).
        """
        self.check_member(organization)
        reply = self._push(organization, round_, update, digest, up)
        if not defer_commit:
            self.commit_pending()
        return reply

    def _push(self, organization: str, round_: int, update: ParsedUpdate, digest: bytes,
              up: TrafficBreakdown) -> PushReply:
        with self._lock:
            self._check_round(round_)
            if organization in self.pushed:
                return self._duplicate_locked(organization, digest)
            self._fresh_locked()
            phase, half = self.phase, self.half
        received = update.check(self.spec, phase, self.schema, self.limits.max_tensor_elements, self.cfg.id, round_,
                                organization)
        self._check_limits(organization, received)
        half.validate(phase, organization, received)
        with self._lock:
            self._await_commit_locked()  # the last close's checkpoint first: the log then holds this round only
            self._check_round(round_)
            if organization in self.pushed:
                return self._duplicate_locked(organization, digest)
            self._check_not_committing(organization)
            if self.half is not half or self._stale:  # a failed close changed the half while this was decoded
                self._fresh_locked()
                self.half.validate(phase, organization, received)
            try:
                ticket = self.store.append_update(round_, organization, update.data, digest)
            except StorageError as exc:
                self._storage_failed(exc)
            update.release()  # written: the log has the bytes, the decoded arrays are what is folded
            self._committing.add(organization)
        # Durable outside the lock: concurrent pushes share one fsync (group commit), and polls, status and
        # other pushes' checks go on meanwhile. Not folded, not acknowledged until it is on disk.
        try:
            durable = self.store.sync(ticket)
        except StorageError as exc:
            with self._lock:
                self._committing.discard(organization)
                self.store.repair()  # every record past the last durable point is cut: none was acknowledged
            self._storage_failed(StorageError(self.store.failed_update(organization, round_, exc)))
        with self._lock:
            self._committing.discard(organization)
            self._check_round(round_)  # the round closed while the record was being synced: it was cut
            if not durable:
                self._storage_failed(StorageError(self.store.failed_update(
                    organization, round_, "it was cut back with the records of a failed fsync")))
            if organization in self.pushed:  # folded by a rebuild from the log while it was synced
                return self._duplicate_locked(organization, digest)
            self._fresh_locked()
            self._fold(organization, received, digest)
            reply = PushReply(accepted=True, duplicate=False, round=round_)
            # Counted before the round can close, so both belong to this round's record.
            self.record_traffic(organization, round_, "up", up)
            self.record_traffic(organization, round_, "down",
                                with_envelope(TrafficBreakdown(), messages.push_reply_size(reply)))
            # The update is durable: it is acknowledged even when the close it completes must be retried.
            self._try_close_locked()
            crash_point("push.acknowledged")
            return reply

    def _check_not_committing(self, organization: str) -> None:
        if organization in self._committing:
            raise WireError("too_many_streams", f"an update of {organization!r} for round {self.round} is being "
                                                f"made durable; try again in a moment")

    def _check_round(self, round_: int) -> None:
        phase, current = self.phase, self.round
        if phase is Phase.FINISHED:
            raise WireError("late", f"run {self.cfg.id!r} has finished; round {round_} is closed")
        if round_ != current:
            state = "is closed" if round_ < current else "has not started"
            raise WireError("late", f"round {round_} {state}; the current round is {current} ({phase.value})")

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

    def _weighted(self, organization: str, update: Received) -> Received:
        """The update with its aggregation weights replaced by the organization's declaration, when the run
        weighs by declarations (``example_weights = "declared"``)."""
        if self.cfg.example_weights != "declared":
            return update
        n = self.examples.get(organization, 0)
        return Received([dataclasses.replace(p, num_examples=n) if isinstance(p, WEIGHTED) else p for p in update],
                        repeated=update.kinds)

    def _fold(self, organization: str, update: Received, digest: bytes) -> None:
        self.half.accumulate(self.phase, organization, self._weighted(organization, update))
        self.pushed[organization] = digest
        self.ledger.pushed(organization, self.round)
        m = update.maybe(EvalMetrics)
        if m is not None:
            self.current.reports[organization] = m
            labels = (self.cfg.id, self.cfg.algorithm, organization)
            self.metrics.client_train_loss.labels(*labels).set(m.train_loss)
            self.metrics.client_test_accuracy.labels(*labels).set(m.test_accuracy)
            figures = self._figures(m)
            for name, value in figures.items():
                self.metrics.client_metric.labels(*labels, name).set(value)
            for gone in self._figure_names.get(organization, set()) - set(figures):
                self.metrics.client_metric.remove(*labels, gone)
            self._figure_names[organization] = set(figures)

    # ----------------------------------------------------------------- refusals
    def refuse(self, organization: str, err: WireError) -> None:
        """Record that ``organization`` was refused for a reason no retry can fix: shown in Status, an Event, a
        metric (members only); a member no longer holds the open round, which closes if everyone else pushed."""
        if err.retryable or err.reason == "late":
            return
        org = clip(organization, 64)
        entry = (err.reason, clip(err.message))
        with self._lock:
            if organization not in self.cfg.organizations:
                self._strangers[org] = entry
                self._strangers.move_to_end(org)
                while len(self._strangers) > MAX_LISTED_STRANGERS:
                    self._strangers.popitem(last=False)
            elif self.refused.get(organization) != entry:
                old = self.refused.get(organization)
                if old is not None:
                    self.metrics.refused_organizations.remove(self.cfg.id, organization, old[0])
                self.refused[organization] = entry
                self.metrics.refused_organizations.labels(self.cfg.id, organization, err.reason).set(1)
                log.error("run %s: organization %r refused for good (%s): %s; %s", self.cfg.id, organization,
                          err.reason, entry[1], "its earlier admission stands" if self._admitted(organization)
                          else "rounds no longer wait for it")
                k8s_events.emit("OrganizationRefused", f"run {self.cfg.id}: organization {organization} refused "
                                f"({err.reason}): {entry[1]}", warning=True)
                self._try_close_locked()
        self.commit_pending()

    def _admitted(self, organization: str) -> bool:
        """Whether the organization joined (and declared, when the run asks for it)."""
        return organization in self.joined and (not self.spec.shared_schema or organization in self.declared)

    def _given_up(self, organization: str) -> bool:
        """Refused for good and never admitted: rounds no longer wait for it. A refusal of an admitted
        organization (a new pod with another model while the old one still runs) is shown; its admission stands."""
        return organization in self.refused and not self._admitted(organization)

    def _unrefuse_locked(self, organization: str) -> None:
        """An organization that joined after all is no longer refused."""
        old = self.refused.pop(organization, None)
        if old is not None:
            self.metrics.refused_organizations.remove(self.cfg.id, organization, old[0])
            log.info("run %s: organization %r, refused earlier (%s), joined", self.cfg.id, organization, old[0])

    # ----------------------------------------------------------------- closing rounds
    def tick(self) -> None:
        """Close the open round if its deadline has passed with a quorum (retrying a close, or the checkpoint of
        one, that failed)."""
        with self._lock:
            self._try_close_locked()
        self.commit_pending()

    def _try_close_locked(self) -> None:
        """Close the round if it is due; a failure to persist the close is logged (once) and retried later."""
        try:
            self._maybe_close_locked()
        except WireError as err:
            if str(err) != self._close_error:
                log.error("run %s: round %d could not close (%s); retried by the deadline ticker", self.cfg.id,
                          self.round, err)
            self._close_error = str(err)
        else:
            self._close_error = ""

    def _maybe_close_locked(self) -> None:
        if self.phase is Phase.FINISHED or not self.pushed:
            return
        # Everyone who can still push: an organization refused for good, never admitted, no longer holds it open.
        everyone = all(org in self.pushed or self._given_up(org) for org in self.cfg.organizations)
        overdue = (
            self._deadline_armed
            and time.monotonic() - self.current.started >= self.cfg.round_deadline_seconds
            and len(self.pushed) >= self.cfg.quorum
        )
        if everyone or overdue:
            self._close_locked()

    def _next(self) -> tuple[Phase, int]:
        if self.phase is Phase.SETUP:
            return Phase.TRAIN, 1
        if self.phase is Phase.TRAIN and self.round < self.cfg.rounds:
            return Phase.TRAIN, self.round + 1
        if self.phase is Phase.TRAIN:
            return Phase.EVALUATE, self.round + 1
        return Phase.FINISHED, self.round

    def _close_locked(self) -> None:
        """Close the open round: aggregate, commit (history line, then checkpoint), then move on in memory."""
        self._fresh_locked()
        rec = self.current
        rec.duration = time.monotonic() - rec.started
        rec.clients = len(self.pushed)
        self._stale = True  # close_round changes the half before the close is durable
        self.half.close_round(self.phase, self.round)
        phase, round_ = self._next()
        with self._traffic_lock:  # the event loop may be counting traffic into this record
            record = rec.to_json()
        try:
            self.store.append_history(record)
        except StorageError as exc:
            self._storage_failed(exc)
        # The history line is durable; the checkpoint that counts it (the commit point) is written by
        # commit_pending once the lock is released, while clients already fetch the next round. Should the
        # process die first, the restart cuts the uncounted line and closes this round again from the log,
        # whose records stay until the checkpoint is on disk: the same aggregate, since it is deterministic.
        drop = round_ + 1 if phase is Phase.FINISHED else round_
        self._pending = (self._meta(phase=phase, round_=round_), self.half.state(), drop)
        self._stale = False
        self.history.append(rec)
        self.metrics.round_duration.labels(self.cfg.id, self.cfg.algorithm).observe(rec.duration)
        self.metrics.clients_per_round.labels(self.cfg.id, self.cfg.algorithm).set(rec.clients)
        figures = [self._figures(m) for m in rec.reports.values()]
        names = {n for f in figures for n in f}
        for name in names:
            values = [f[name] for f in figures if name in f]
            self.metrics.client_metric_mean.labels(self.cfg.id, self.cfg.algorithm, name).set(sum(values) / len(values))
        for gone in self._mean_names - names if figures else set():
            self.metrics.client_metric_mean.remove(self.cfg.id, self.cfg.algorithm, gone)
        self._mean_names = names if figures else self._mean_names
        log.info("run %s closed %s round %d with %d clients in %.2fs", self.cfg.id, self.phase.value, self.round,
                 rec.clients, rec.duration)
        k8s_events.emit("RoundClosed", f"run {self.cfg.id} closed {self.phase.value} round {self.round} "
                        f"with {rec.clients} clients in {rec.duration:.2f}s")
        with self._traffic_lock:
            self.phase, self.round = phase, round_
            self.pushed = {}
            self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._publish_round_gauges()
        self.changes.notify()

    def commit_pending(self) -> None:
        """Write the checkpoint of the last close, if one is pending (call without holding the run's lock), then
        drop the closed round's logged updates. A failure is logged once and retried by the deadline ticker;
        meanwhile the next round's pushes are answered ``storage_unavailable``."""
        with self._commit_lock:
            with self._lock:
                pending = self._pending
            if pending is None:
                return
            meta, arrays, drop = pending
            try:
                self.store.commit_close(meta, arrays)
            except StorageError as exc:
                self.metrics.storage_errors.labels(self.cfg.id).inc()
                with self._lock:
                    if str(exc) != self._commit_error:
                        log.error("run %s: the checkpoint of round %d's close could not be written (%s); retried "
                                  "by the deadline ticker", self.cfg.id, self.round - 1, exc)
                    self._commit_error = str(exc)
                    self._committed.notify_all()
                return
            with self._lock:
                self._pending = None
                self._commit_error = ""
                # A finished run keeps no logged update: a restart must not replay the evaluation round.
                self.store.drop_rounds_before(drop)
                self._committed.notify_all()

    def has_pending_commit(self) -> bool:
        """Whether a closed round's checkpoint waits to be written."""
        return self._pending is not None

    def _await_commit_locked(self, timeout: float = 30.0) -> None:
        """Wait (releasing the lock) until the last close's checkpoint is on disk; ``storage_unavailable`` when
        its write failed or does not finish in ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._pending is not None:
            left = deadline - time.monotonic()
            if self._commit_error or left <= 0:
                raise WireError("storage_unavailable", f"round {self.round - 1}'s checkpoint is not on disk yet "
                                                       f"({self._commit_error or 'still being written'}); try again")
            self._committed.wait(left)

    def _publish_round_gauges(self) -> None:
        self.metrics.current_round.labels(self.cfg.id, self.cfg.algorithm).set(self.round)

    # ----------------------------------------------------------------- status
    def status(self) -> RunStatus:
        """The run's state and per-round history."""
        with self._lock:
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
                refused=tuple(Refusal(o, r, m) for o, (r, m) in [*sorted(self.refused.items()),
                                                                  *self._strangers.items()]),
            )
