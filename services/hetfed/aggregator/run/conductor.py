"""The run's conductor: one round loop for every algorithm, durable, with quorum, deadlines and contract checks.

A run moves through phases (``hetfed.wire.phases.Phase``): setup (round 0, only when the algorithm uploads
something once), train (rounds 1..R), evaluate (round R+1: clients evaluate the final state and report
metrics) and finished. A round closes when every organization still expected has pushed, or once its deadline
has passed with at least the quorum.

The rules live in ``hetfed.aggregator.run.state``: a frozen ``RunState`` and pure transitions that return the
next state and its effects. ``Run`` conducts them: it holds the lock and dispatches every effect in one loop
(``_apply_locked``) to its collaborators, through their public methods: the ``Journal``
(``hetfed.aggregator.journal``), the ``Aggregation`` (the numpy server half, kept in step with the journal), the
admission checks, the instruction cache, the organizations' ledger and an ``Observer`` (metrics, Events, the log).
Every accepted update is on disk before it is acknowledged; a round's close is committed by a checkpoint; a
restart replays the open round's logged updates.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import NoReturn, Protocol

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.checkpoint import CheckpointMeta
from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.journal.journal import Journal
from hetfed.aggregator.journal.store import Disk, StateError, StorageError, WalTicket
from hetfed.aggregator.run import admission, resume
from hetfed.aggregator.run.admission import Limits
from hetfed.aggregator.run.aggregation import Aggregation
from hetfed.aggregator.run.instructions import InstructionCache, round_seed
from hetfed.aggregator.run.notifier import ChangeNotifier
from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.aggregator.run.state import (
    Close,
    DataShape,
    Duplicate,
    Fold,
    Persist,
    RefusalChanged,
    Refused,
    Rules,
    RunState,
    Step,
    Stranger,
    accept,
    check_member,
    check_round,
    close,
    due,
    join,
    refuse,
    seen,
)
from hetfed.aggregator.run.status import run_status
from hetfed.wire import contract, messages
from hetfed.wire.config import to_mapping
from hetfed.wire.errors import WireError, clip
from hetfed.wire.messages import (
    JoinReply,
    JoinRequest,
    ParsedUpdate,
    Pulled,
    PullRequest,
    PushReply,
    RoundSummary,
    RunStatus,
)
from hetfed.wire.payloads import EvalMetrics, Received
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.traffic import Direction, TrafficBreakdown, with_envelope

log = logging.getLogger("hetfed.aggregator")
# Non-members refused lately that Status lists (their names are the caller's choice: bounded).
MAX_LISTED_STRANGERS = 16


class Observer(Protocol):
    """What a run tells the outside; it never changes the run (``hetfed.aggregator.observe`` implements it)."""

    def folded(self, organization: str, m: EvalMetrics | None) -> None:
        """An update was folded in; ``m``: the metrics it reported."""

    def closed(self, rec: RoundRecord) -> None:
        """A round closed."""

    def round_opened(self, round_: int) -> None:
        """The run's current round."""

    def refusal(self, change: RefusalChanged, released: bool) -> None:
        """A member's refusal was recorded or lifted; ``released``: rounds no longer wait for it."""

    def restored(self, refused: Mapping[str, Refused]) -> None:
        """Refusals read back at start-up."""

    def storage_error(self) -> None:
        """A write to the run's state directory failed."""

    def duplicate(self) -> None:
        """An update arrived again, identical."""

    def traffic(self, organization: str, direction: Direction, b: TrafficBreakdown) -> None:
        """Bytes exchanged with an organization."""


class Run:
    """One federated run hosted by the aggregator; thread-safe (see the module docstring)."""

    def __init__(self, cfg: RunConfig, state_dir: str, observer: Observer, limits: Limits,
                 disk: Disk | None = None) -> None:
        self.cfg, self.spec, self.observer, self.limits = cfg, cfg.spec, observer, limits
        self.train_config = cfg.train_config()
        self._lock = threading.RLock()
        # A closed round's checkpoint is written after its clients are woken, outside the lock.
        self.journal = Journal(cfg.id, state_dir, disk, self._lock, observer.storage_error)
        self.aggregation = Aggregation(lambda: make_server_half(self.spec, self.train_config, self.cfg.run_info()),
                                       cfg, self.journal, limits.max_tensor_elements)
        self.max_examples = min(limits.max_examples, cfg.max_examples)  # the run's bound, within the server's
        self.rules = Rules(cfg.id, tuple(cfg.organizations), cfg.rounds, cfg.quorum, bool(self.spec.shared_schema),
                           self.spec.first_phase, str(self.journal.dir))
        self.state = RunState.start(self.rules)
        dtype = self.train_config.wire_dtype
        self.instructions = InstructionCache(cfg.id, cfg.rounds, cfg.seed, None if dtype == "float32" else dtype)
        self._traffic_lock = threading.Lock()  # never held across I/O: the event loop counts traffic
        self.notifier = ChangeNotifier()
        self.history: list[RoundRecord] = []
        self.ledger = OrganizationLedger()  # per organization: last accepted round, bytes up and down
        self._strangers: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._summaries: list[RoundSummary] = []  # Status summaries of history[:len], built once
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = False
        self._close_error = ""
        self._config_json = json.dumps(to_mapping(self.train_config), sort_keys=True)
        try:
            with self._lock:
                self._restore_locked()
        except BaseException:
            self.journal.close()  # its lock too: the aggregator may go on serving the other runs
            raise
        self.commit_pending()
        self.observer.round_opened(self.round)

    # The state's parts, as the service, the metrics collector and tests read them.
    phase = property(lambda self: self.state.phase)
    round = property(lambda self: self.state.round)
    schema = property(lambda self: self.state.schema)
    joined = property(lambda self: self.state.joined)
    declared = property(lambda self: self.state.declared)
    examples = property(lambda self: self.state.examples)
    pushed = property(lambda self: self.state.pushed)
    refused = property(lambda self: self.state.refused)

    # ----------------------------------------------------------------- durability
    def _meta(self, state: RunState | None = None) -> CheckpointMeta:
        return CheckpointMeta((state or self.state).to_json(), self.cfg.algorithm, self.ledger.to_json())

    def _storage_failed(self, exc: StorageError) -> NoReturn:
        self.observer.storage_error()
        raise WireError("storage_unavailable", f"{exc}; nothing changed: try again") from None

    def _restore_locked(self) -> None:
        """Read the run's durable state back (a new run writes its first checkpoint) and replay the open round's
        logged updates; StateError or RunConflictError when it cannot be resumed."""
        try:
            loaded = self.journal.recover()
        except StateError as exc:
            raise StateError(f"run {self.cfg.id!r}: {exc}") from None
        if loaded is None:
            try:
                self.journal.save_checkpoint(self._meta(), self.aggregation.half.state())
            except StorageError as exc:
                raise StateError(f"run {self.cfg.id!r}: cannot write its first checkpoint: {exc}") from None
            return
        store = self.journal.store
        back = resume.restored(loaded, self.cfg, self.rules, store.checkpoint_path, store.history_path)
        self.history, self.state, self.ledger = back.history, back.state, back.ledger
        self.aggregation.load(back.arrays, store.checkpoint_path)
        self.observer.restored(self.refused)
        self.current = RoundRecord(self.round, self.phase, time.monotonic())
        self._deadline_armed = bool(self.joined)
        if self.phase is Phase.FINISHED:
            self.journal.drop_rounds_before(self.round + 1)
            log.info("run %s resumed finished after %d rounds", self.cfg.id, len(self.history))
            return
        replayed = self.aggregation.logged(self.state)
        for u in replayed:  # their declarations bring the ledger's last ε up to date
            self._apply_locked(accept(self.state, self.rules, u.organization, self.round, u.digest), u.received,
                               u.privacy)
        log.info("run %s resumed at %s round %d with %d stored updates", self.cfg.id, self.phase.value,
                 self.round, len(replayed))
        self._try_close_locked()

    def close(self) -> None:
        """Write the last close's checkpoint if it is still pending, then close the run's files."""
        self.commit_pending()
        with self._lock:
            self.journal.close()

    # ----------------------------------------------------------------- join and instructions
    def check_member(self, organization: str) -> None:
        """Refuse an organization that is not in the run, has not joined, or owes its declaration (lock-free)."""
        check_member(self.state, self.rules, organization)

    def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization of this run; the first declaration fixes the run's tensor schema, the first
        declared label count and input shape (those the algorithm shares) the run's data."""
        declared = None  # join() refuses a non-member or a finished run first
        if organization in self.cfg.organizations and self.phase is not Phase.FINISHED:
            admission.check_join(self.cfg, self.limits, self.max_examples, request)
            if request.declared and self.spec.shared_schema:
                declared = contract.schema_from_declared(request.declared, self.spec)
        data = DataShape(request.num_classes if self.spec.shared_label_space else 0,
                         request.input_shape if self.spec.shared_input_shape else ())
        with self._lock:
            self.journal.await_commit_locked(self.round - 1)  # a join's checkpoint must not overtake the last close's
            self._apply_locked(join(self.state, self.rules, organization, declared, request.num_train_examples, data))
            if not self._deadline_armed:  # the first round's clock starts when the first organization arrives
                self._deadline_armed = True
                self.current.started = time.monotonic()
            return JoinReply(run_id=self.cfg.id, algorithm=self.cfg.algorithm, config_json=self._config_json,
                             current_round=self.round, total_rounds=self.cfg.rounds, seed=self.cfg.seed,
                             organizations=tuple(self.cfg.organizations),
                             declare_required=bool(self.spec.shared_schema) and organization not in self.declared)

    def round_seed(self, round_: int) -> int:
        """The seed of a round's shared random draws, derived from the run seed."""
        return round_seed(self.cfg.seed, round_)

    def poll(self, organization: str, request: PullRequest) -> Pulled | None:
        """The organization's next instructions if there are any now, else None (it waits on ``notifier``).

        An organization that has not pushed in the open round gets its instructions even when it says it
        completed this round: the aggregator lost its update (a damaged log), so it is asked again.
        """
        with self._lock:
            if self.phase is Phase.FINISHED:
                return self.instructions.finish(self.round)
            if organization not in self.pushed and request.completed_round <= self.round:
                half = self.aggregation.current(self.state)
                return Pulled(self.instructions.get(half, self.phase, self.round, organization), self.round)
            return None

    def wait_reply(self) -> Pulled:
        """The WAIT instructions of the open round (lock-free: the event loop answers an expired long-poll)."""
        return self.instructions.wait(self.round)

    def record_traffic(self, organization: str, round_: int, direction: Direction, b: TrafficBreakdown) -> None:
        """Count traffic with ``organization`` in the metrics and, when it belongs to the open round, its record."""
        self.observer.traffic(organization, direction, b)
        self.ledger.count(organization, direction, b)
        with self._traffic_lock:
            current = self.current
            if round_ == current.round:
                (current.up if direction is Direction.UP else current.down).add(b)

    # ----------------------------------------------------------------- push
    def admit_push(self, organization: str, round_: int) -> None:
        """Refuse a push from a non-member or for another round before its chunks are read (lock-free)."""
        check_member(self.state, self.rules, organization)
        check_round(self.state, self.rules, round_)

    def push(self, organization: str, round_: int, update: ParsedUpdate, digest: bytes,
             up: TrafficBreakdown, defer_commit: bool = False) -> PushReply:
        """Check, log durably and fold in an update; idempotent by (run, round, organization). A leave notice is
        refused ``privacy_budget_spent`` or ``organization_left`` (``admission.refuse_leave``): the caller records
        the refusal (``refuse(at_push=True)``), and rounds stop waiting for the organization from the open one on.

        ``digest`` is the BLAKE3 digest of ``update.data``. The update is claimed (an accepted one again is
        answered before its bytes are decoded again), checked outside the lock, logged under it, made durable
        outside it (concurrent pushes share one fsync), then folded in under the lock again. When it completes the
        round, the round's checkpoint is written before returning, or, with ``defer_commit``, left to the caller's
        ``commit_pending`` (so the acknowledgement need not wait for it).
        """
        with self._lock:
            claimed = self._claim_locked(organization, round_, digest)
            if claimed is None:
                return PushReply(accepted=True, duplicate=True, round=round_)
            state, half = claimed
        try:
            received = admission.check_push(self.cfg, self.limits, self.max_examples, state, organization, round_,
                                            update, half, self.ledger.get(organization).privacy)
            with self._lock:
                ticket = self._log_locked(organization, round_, update, digest, received, half)
        except BaseException:
            with self._lock:
                self.journal.settle_locked(organization)
            raise
        reply = self._sync_and_fold(organization, round_, digest, received, ticket, up, update.privacy)
        if not defer_commit:
            self.commit_pending()
        return reply

    def _claim_locked(self, organization: str, round_: int,
                      digest: bytes) -> tuple[RunState, ServerHalf] | None:  # type: ignore[type-arg]
        """None for an accepted update again (a duplicate, counted); else claim the organization's place in the
        log (no other update of it comes in meanwhile) and return the state and half that check the update."""
        check_member(self.state, self.rules, organization)
        step = seen(self.state, self.rules, organization, round_, digest)
        self._apply_locked(step)
        if step.effects:
            return None
        self.journal.claim_locked(organization, round_)
        try:
            return self.state, self.aggregation.current(self.state)
        except WireError:
            self.journal.settle_locked(organization)
            raise

    def _log_locked(self, organization: str, round_: int, update: ParsedUpdate, digest: bytes, received: Received,
                    half: ServerHalf) -> WalTicket:  # type: ignore[type-arg]
        """Append the checked update to the journal's log (not yet durable)."""
        self.journal.await_commit_locked(self.round - 1)  # the last close's checkpoint first: the log holds this round
        check_round(self.state, self.rules, round_)  # the round closed (on its deadline) while it was checked
        self.aggregation.revalidate(self.state, organization, received, half)
        try:
            ticket = self.journal.log_locked(organization, round_, update.data, digest)
        except StorageError as exc:
            self._storage_failed(exc)
        update.release()  # written: the log has the bytes, the decoded arrays are what is folded
        return ticket

    def _sync_and_fold(self, organization: str, round_: int, digest: bytes, received: Received, ticket: WalTicket,
                       up: TrafficBreakdown, privacy: PrivacyDeclaration | None) -> PushReply:
        """Make the record durable outside the lock, then fold it in (with the privacy it declared, for the
        organization's ledger). Not folded, not acknowledged until it is on disk."""
        try:
            durable = self.journal.sync(organization, round_, ticket)
        except StorageError as exc:
            self._storage_failed(exc)
        with self._lock:
            self.journal.settle_locked(organization)
            check_round(self.state, self.rules, round_)  # the round closed while it was synced: it was cut
            if not durable:
                self._storage_failed(StorageError(self.journal.cut_message(organization, round_)))
            self._apply_locked(accept(self.state, self.rules, organization, round_, digest), received, privacy)
            reply = PushReply(accepted=True, duplicate=False, round=round_)
            # Counted before the round can close, so both belong to this round's record.
            self.record_traffic(organization, round_, Direction.UP, up)
            self.record_traffic(organization, round_, Direction.DOWN,
                                with_envelope(TrafficBreakdown(), messages.push_reply_size(reply)))
            # The update is durable: it is acknowledged even when the close it completes must be retried.
            self._try_close_locked()
            crash_point("push.acknowledged")
            return reply

    # ----------------------------------------------------------------- effects
    def _apply_locked(self, step: Step, received: Received | None = None,
                      privacy: PrivacyDeclaration | None = None) -> None:
        """Carry out a transition's effects in order, then adopt its state (a Persist first writes it, a Close
        moves to it). ``received`` and ``privacy``: the checked update a Fold folds in, and what it declared."""
        for effect in step.effects:
            if isinstance(effect, Persist):
                try:  # the checkpoint, then the state: nothing changed when it cannot be written
                    arrays = self.aggregation.current(self.state).state()
                    self.journal.save_checkpoint(self._meta(step.state), arrays)
                except StorageError as exc:
                    self._storage_failed(exc)
                self.state = step.state
            elif isinstance(effect, Fold):
                assert received is not None
                self.aggregation.fold(self.state, effect.organization, received)
                self.ledger.pushed(effect.organization, self.round, privacy)
                m = received.maybe(EvalMetrics)
                if m is not None:
                    self.current.reports[effect.organization] = m
                self.observer.folded(effect.organization, m)
            elif isinstance(effect, Close):
                self._close_locked(effect, step.state)
            elif isinstance(effect, Duplicate):
                self.observer.duplicate()
            elif isinstance(effect, RefusalChanged):
                self.observer.refusal(effect, step.state.given_up(effect.organization, self.rules))
            elif isinstance(effect, Stranger):
                self._strangers[effect.organization] = (effect.reason, effect.message)
                self._strangers.move_to_end(effect.organization)
                while len(self._strangers) > MAX_LISTED_STRANGERS:
                    self._strangers.popitem(last=False)
        self.state = step.state

    # ----------------------------------------------------------------- refusals
    def refuse(self, organization: str, err: WireError, at_push: bool = False) -> None:
        """Record that ``organization`` was refused for a reason no retry can fix: shown in Status, an Event, a
        metric (members only). A member never admitted, or whose own push was refused (its client exits), no
        longer holds the open round, which closes if everyone else pushed."""
        if err.retryable or err.reason == "late":
            return
        with self._lock:
            step = refuse(self.state, self.rules, organization, err.reason, clip(err.message), at_push)
            try:
                if any(isinstance(e, Persist) for e in step.effects):
                    self.journal.await_commit_locked(self.round - 1)  # must not overtake the last close's checkpoint
                self._apply_locked(step)
            except WireError as failed:  # kept in memory; the next close's checkpoint persists it
                log.error("run %s: the refusal of %r could not be persisted (%s)", self.cfg.id, organization, failed)
                self._apply_locked(Step(step.state, tuple(e for e in step.effects if not isinstance(e, Persist))))
            self._try_close_locked()
        self.commit_pending()

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
            overdue = self._deadline_armed and time.monotonic() - self.current.started >= self.cfg.round_deadline_seconds
            if due(self.state, self.rules, overdue):
                self._apply_locked(close(self.state, self.rules))
        except WireError as err:
            if str(err) != self._close_error:
                log.error("run %s: round %d could not close (%s); retried by the deadline ticker", self.cfg.id,
                          self.round, err)
            self._close_error = str(err)
        else:
            self._close_error = ""

    def _close_locked(self, effect: Close, nxt: RunState) -> None:
        """Carry out a Close: aggregate, commit (history line, then checkpoint), then move on in memory."""
        rec = self.current
        rec.duration = time.monotonic() - rec.started
        rec.clients = len(self.pushed)
        arrays = self.aggregation.close_round(self.state, effect)  # ahead of the disk until durable()
        with self._traffic_lock:  # the event loop may be counting traffic into this record
            record = rec.to_json()
        try:
            self.journal.append_history(record)
        except StorageError as exc:
            self._storage_failed(exc)
        # The history line is durable; the checkpoint that counts it (the commit point) is written by
        # commit_pending once the lock is released, while clients already fetch the next round. Should the
        # process die first, the restart cuts the uncounted line and closes this round again from the log,
        # whose records stay until the checkpoint is on disk: the same aggregate, since it is deterministic.
        drop = nxt.round + 1 if nxt.phase is Phase.FINISHED else nxt.round
        self.journal.set_close_locked(self._meta(nxt), arrays, drop)
        self.aggregation.durable()
        self.history.append(rec)
        self.observer.closed(rec)
        with self._traffic_lock:
            self.state = nxt
            self.current = RoundRecord(nxt.round, nxt.phase, time.monotonic())
        self.observer.round_opened(nxt.round)
        self.notifier.notify()

    def commit_pending(self) -> None:
        """Write the checkpoint of the last close, if one is pending (call without holding the run's lock)."""
        self.journal.commit_pending(lambda: self.round - 1)

    def has_pending_commit(self) -> bool:
        """Whether a closed round's checkpoint waits to be written."""
        return self.journal.pending()

    # ----------------------------------------------------------------- status
    def status(self) -> RunStatus:
        """The run's state and per-round history."""
        with self._lock:
            # Closed rounds never change: each one's summary is built once (runs of thousands of rounds are polled
            # several times a second), the open round's every time.
            self._summaries.extend(rec.summary() for rec in self.history[len(self._summaries):])
            return run_status(self.cfg, self.state, self._summaries, self.current, self.ledger, self._strangers)
