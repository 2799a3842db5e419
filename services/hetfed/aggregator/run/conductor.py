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

import logging
import threading
from collections.abc import Mapping
from typing import Protocol

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.checkpoint import CheckpointMeta
from hetfed.aggregator.journal.crashpoints import crash_point
from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.journal.journal import Journal
from hetfed.aggregator.journal.store import Disk
from hetfed.aggregator.run import admission, resume
from hetfed.aggregator.run.admission import Limits
from hetfed.aggregator.run.aggregation import Aggregation
from hetfed.aggregator.run.instructions import InstructionCache
from hetfed.aggregator.run.intake import Intake
from hetfed.aggregator.run.notifier import ChangeNotifier
from hetfed.aggregator.run.open_round import OpenRound
from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.aggregator.run.secure import SecureParams
from hetfed.aggregator.run.secure_stages import SecureStages
from hetfed.aggregator.run.state import (
    Close,
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
from hetfed.aggregator.run.status import StatusBoard
from hetfed.wire import messages
from hetfed.wire.errors import WireError, clip
from hetfed.wire.messages import (
    JoinReply,
    JoinRequest,
    ParsedUpdate,
    Pulled,
    PullRequest,
    PushReply,
    RunStatus,
)
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.rpc import SecureStageReply
from hetfed.wire.traffic import Direction, TrafficBreakdown, with_envelope

log = logging.getLogger("hetfed.aggregator")


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
        self.train_config = cfg.algorithm_config
        self._lock = threading.RLock()
        # A closed round's checkpoint is written after its clients are woken, outside the lock.
        self.journal = Journal(cfg.id, state_dir, disk, self._lock, observer.storage_error)
        self.aggregation = Aggregation(lambda: make_server_half(self.spec, self.train_config, self.cfg.run_info()),
                                       cfg, self.journal, limits.max_tensor_elements)
        self.max_examples = min(limits.max_examples, cfg.max_examples)  # the run's bound, within the server's
        self.rules = Rules(cfg.id, tuple(cfg.organizations), cfg.rounds, cfg.quorum, bool(self.spec.shared_schema),
                           self.spec.first_phase, str(self.journal.dir))
        # Secure aggregation's stages of the open round (``params`` None: not secure; no run option sets it yet).
        self.secure = SecureStages(self.spec, self.rules, cfg.seed, cfg.round_deadline_seconds,
                                   SecureParams() if cfg.secure_aggregation else None, cfg.distributed_sum)
        self.intake = Intake(cfg, limits, self.max_examples, self.rules, self.journal, self.aggregation, self._lock,
                             lambda: self.state, lambda: self.secure.active(self.state))
        self.state = RunState.start(self.rules)
        dtype = self.train_config.wire_dtype
        self.instructions = InstructionCache(cfg.id, cfg.rounds, cfg.seed, None if dtype == "float32" else dtype)
        self.notifier = ChangeNotifier()
        self.history: list[RoundRecord] = []
        self.ledger = OrganizationLedger()  # per organization: last accepted round, bytes up and down
        self.open_round = OpenRound(self.round, self.phase)
        self._board = StatusBoard()
        self._close_error = ""
        self._config_json = messages.encode_config(self.train_config)
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
    current = property(lambda self: self.open_round.record)  # the open round's record

    def _meta(self, state: RunState | None = None) -> CheckpointMeta:
        return CheckpointMeta((state or self.state).to_json(), self.cfg.algorithm, self.ledger.to_json())

    def _restore_locked(self) -> None:
        """Read the run's durable state back (a new run writes its first checkpoint) and replay the open round's
        logged updates; StateError or RunConflictError when it cannot be resumed."""
        loaded = self.journal.recover_or_start(lambda: (self._meta(), self.aggregation.half.state()))
        if loaded is None:
            return
        store = self.journal.store
        back = resume.restored(loaded, self.cfg, self.rules, store.checkpoint_path, store.history_path)
        self.history, self.state, self.ledger = back.history, back.state, back.ledger
        self.aggregation.load(back.arrays, store.checkpoint_path)
        self.observer.restored(self.refused)
        self.open_round = OpenRound(self.round, self.phase, armed=bool(self.joined))
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

    def check_member(self, organization: str) -> None:
        """Refuse an organization that is not in the run, has not joined, or owes its declaration (lock-free)."""
        check_member(self.state, self.rules, organization)

    def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization of this run; the first declaration fixes the run's tensor schema, the first
        declared label count and input shape (those the algorithm shares) the run's data."""
        declared, data = admission.check_join_request(self.cfg, self.limits, self.max_examples, self.state,
                                                      organization, request)
        with self._lock:
            self.journal.await_commit_locked(self.round - 1)  # a join's checkpoint must not overtake the last close's
            self._apply_locked(join(self.state, self.rules, organization, declared, request.num_train_examples, data))
            self.open_round.arm()  # the first round's clock starts when the first organization arrives
            return JoinReply(run_id=self.cfg.id, algorithm=self.cfg.algorithm, config_json=self._config_json,
                             current_round=self.round, total_rounds=self.cfg.rounds, seed=self.cfg.seed,
                             organizations=tuple(self.cfg.organizations),
                             declare_required=bool(self.spec.shared_schema) and organization not in self.declared,
                             secure_aggregation=self.secure.params is not None)

    def poll(self, organization: str, request: PullRequest) -> Pulled | None:
        """The organization's next instructions if there are any now, else None (it waits on ``notifier``). One
        that has not pushed in the open round gets them even when it says it completed this round: the aggregator
        lost its update (a damaged log), so it is asked again."""
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

    def secure_stage(self, organization: str, round_: int, payload: Payload | None) -> SecureStageReply:
        """Take ``organization``'s stage message of secure aggregation for the open round (None: none) and say
        what it gets now (``hetfed.aggregator.run.secure_stages``); a close wakes the waiting callers."""
        with self._lock:
            check_member(self.state, self.rules, organization)
            check_round(self.state, self.rules, round_)
            sr = self.secure.current(self.state, lambda: self.aggregation.current(self.state))
            if payload is not None and self.secure.take(sr, organization, payload):
                self.notifier.notify()
            self._try_close_locked()  # the last unmask reply ends the round
            return self.secure.reply(sr, organization)

    def record_traffic(self, organization: str, round_: int, direction: Direction, b: TrafficBreakdown,
                       in_round: bool = True) -> None:
        """Count traffic in the metrics and, when ``in_round`` and of the open round, in its record."""
        self.observer.traffic(organization, direction, b)
        self.ledger.count(organization, direction, b)
        if in_round:
            self.open_round.count(round_, direction, b)

    def admit_push(self, organization: str, round_: int) -> None:
        """Refuse a push from a non-member or for another round before its chunks are read (lock-free)."""
        check_member(self.state, self.rules, organization)
        check_round(self.state, self.rules, round_)

    def push(self, organization: str, round_: int, update: ParsedUpdate, digest: bytes,
             up: TrafficBreakdown, defer_commit: bool = False) -> PushReply:
        """Check, log durably and fold in an update (``digest``: its BLAKE3 digest); idempotent by (run, round,
        organization). A refused leave notice is the caller's to record (``refuse(at_push=True)``). The checkpoint
        of a round it completes is written before returning, or, with ``defer_commit``, by ``commit_pending``."""
        with self._lock:
            check_member(self.state, self.rules, organization)
            step = seen(self.state, self.rules, organization, round_, digest)  # the one duplicate check
            self._apply_locked(step)
            if step.effects:
                return PushReply(accepted=True, duplicate=True, round=round_)
            claim = self.intake.claim_locked(organization, round_, self.ledger.get(organization).privacy)
        received, durable = self.intake.take(claim, update, digest)  # not folded before it is on disk
        with self._lock:
            self.intake.settle_locked(claim, durable)
            self._apply_locked(accept(self.state, self.rules, organization, round_, digest), received, update.privacy)
            reply = PushReply(accepted=True, duplicate=False, round=round_)
            # Counted before the round can close, so both belong to this round's record.
            self.record_traffic(organization, round_, Direction.UP, up)
            self.record_traffic(organization, round_, Direction.DOWN,
                                with_envelope(TrafficBreakdown(), messages.push_reply_size(reply)))
            # The update is durable: it is acknowledged even when the close it completes must be retried.
            self._try_close_locked()
            crash_point("push.acknowledged")
        if not defer_commit:
            self.commit_pending()
        return reply

    def _apply_locked(self, step: Step, received: Received | None = None,
                      privacy: PrivacyDeclaration | None = None) -> None:
        """Carry out a transition's effects in order, then adopt its state (a Persist first writes it, a Close
        moves to it). ``received`` and ``privacy``: the checked update a Fold folds in, and what it declared."""
        for effect in step.effects:
            if isinstance(effect, Persist):  # the checkpoint, then the state: nothing changes unless it is written
                self.journal.await_commit_locked(self.round - 1)  # after the last close's checkpoint, not before
                self.journal.persist_locked(self._meta(step.state), self.aggregation.current(self.state).state())
                self.state = step.state
            elif isinstance(effect, Fold):
                assert received is not None
                if self.secure.active(self.state):  # the masked input goes to the round's coordinator
                    self.secure.fold(self.state, effect.organization, received,
                                     lambda: self.aggregation.current(self.state))
                else:
                    self.aggregation.fold(self.state, effect.organization, received)
                self.ledger.pushed(effect.organization, self.round, privacy)
                m = received.maybe(EvalMetrics)
                if m is not None:
                    self.open_round.report(effect.organization, m)
                self.observer.folded(effect.organization, m)
            elif isinstance(effect, Close):
                self._close_locked(effect, step.state)
            elif isinstance(effect, Duplicate):
                self.observer.duplicate()
            elif isinstance(effect, RefusalChanged):
                self.observer.refusal(effect, step.state.given_up(effect.organization, self.rules))
            elif isinstance(effect, Stranger):
                self._board.stranger(effect.organization, effect.reason, effect.message)
        self.state = step.state

    def refuse(self, organization: str, err: WireError, at_push: bool = False) -> None:
        """Record that ``organization`` was refused for a reason no retry can fix: shown in Status, an Event, a
        metric (members only). A member never admitted, or whose own push was refused (its client exits), no
        longer holds the open round, which closes if everyone else pushed."""
        if err.retryable or err.reason == "late":
            return
        with self._lock:
            step = refuse(self.state, self.rules, organization, err.reason, clip(err.message), at_push)
            try:
                self._apply_locked(step)
            except WireError as failed:  # kept in memory; the next close's checkpoint persists it
                log.error("run %s: the refusal of %r could not be persisted (%s)", self.cfg.id, organization, failed)
                self._apply_locked(Step(step.state, tuple(e for e in step.effects if not isinstance(e, Persist))))
            self._try_close_locked()
        self.commit_pending()

    def tick(self) -> None:
        """Close the open round if its deadline has passed with a quorum (retrying a close, or the checkpoint of
        one, that failed)."""
        with self._lock:
            self._try_close_locked()
        self.commit_pending()

    def _try_close_locked(self) -> None:
        """Close the round if it is due; a failure to persist the close is logged (once) and retried later."""
        try:
            self.secure.expire(self.state, self.notifier.notify)  # a secure round's stage 1 or 2 past its deadline
            overdue = self.open_round.overdue(self.cfg.round_deadline_seconds)
            if due(self.state, self.rules, overdue) and self.secure.ready(
                    self.state, lambda: self.aggregation.current(self.state), self.notifier.notify):
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
        rec = self.open_round.end(len(self.pushed))
        rec.abandoned = self.secure.abandoned(self.state)
        arrays = self.aggregation.close_round(self.state, effect, self.instructions.drop)  # ahead until durable()
        self.journal.append_history(self.open_round.line())
        # The history line is durable; the checkpoint that counts it (the commit point) is written by
        # commit_pending once the lock is released, while clients already fetch the next round. Should the
        # process die first, the restart cuts the uncounted line and closes this round again from the log,
        # whose records stay until the checkpoint is on disk: the same aggregate, since it is deterministic.
        drop = nxt.round + 1 if nxt.phase is Phase.FINISHED else nxt.round
        self.journal.set_close_locked(self._meta(nxt), arrays, drop)
        self.aggregation.durable()
        self.history.append(rec)
        self.observer.closed(rec)
        self.state = nxt
        self.open_round.open(nxt.round, nxt.phase)
        self.observer.round_opened(nxt.round)
        self.notifier.notify()

    def commit_pending(self) -> None:
        """Write the checkpoint of the last close, if one is pending (call without holding the run's lock)."""
        self.journal.commit_pending(lambda: self.round - 1)

    def has_pending_commit(self) -> bool:
        """Whether a closed round's checkpoint waits to be written."""
        return self.journal.pending()

    def status(self) -> RunStatus:
        """The run's state and per-round history."""
        with self._lock:
            return self._board.status(self.cfg, self.state, self.history, self.current, self.ledger)
