"""The client's round loop: pull instructions, run the algorithm's hook, push, then keep what the round leaves.

``RoundLoop`` follows the aggregator from the round the organization resumes after until FINISH. Each round it
checks the privacy budget (leaving the run when the next round would exceed it), runs the half's hook
(``run_round``), protects the figures it uploads under ``[privacy]``, keeps the update on disk (with a state
directory: ``hetfed.client.pending``), pushes, and then saves the private state, writes the snapshots, and records
the organization's own exact figures (its record, gauges and reports). A process restarted in the middle of a push
resumes the kept push instead of working its round again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Gauge

from hetfed.client import crashpoints
from hetfed.client.config import ClientConfig
from hetfed.client.crashpoints import crash_point
from hetfed.client.errors import ClientError, PrivacyBudgetSpent
from hetfed.wire.errors import WireError
from hetfed.wire.messages import Instructions, JoinReply
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.phases import Action
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.rpc import AggregatorClient, OutgoingPush, RemoteError
from hetfed.wire.specs import AlgorithmSpec
from hetfed.wire.specs.base import PeriodicEvalConfig

# Stream of an organization's distributed-DP generator when its noise_seed is fixed (a repeatable experiment).
_DDP_STREAM = 0xDD9

if TYPE_CHECKING:
    from hetfed.client.algorithms.base import ClientHalf
    from hetfed.client.data import ClientData
    from hetfed.client.own_record import OwnRecord
    from hetfed.client.pending import PendingPushFile, RoundKey
    from hetfed.client.privacy.session import PrivacySession
    from hetfed.client.secure import Distributed
    from hetfed.client.state import StateFile

log = logging.getLogger("hetfed.client")


def evaluation_due(round_: int, every: int) -> bool:
    """Whether training round ``round_`` evaluates on the held-out sets (rounds 1, 1 + every, 1 + 2·every, ...)."""
    return (round_ - 1) % every == 0


def run_round(half: ClientHalf, action: Action, round_: int, round_seed: int,  # type: ignore[type-arg]
              received: Received) -> list[Payload]:
    """One round of the round loop: set whether it evaluates (``eval_every`` of a PeriodicEvalConfig, else every
    round; setup and the final evaluation always do), then call the half's hook for ``action``; the upload."""
    every = half.config.eval_every if isinstance(half.config, PeriodicEvalConfig) else 1
    half.ctx.evaluating = action is not Action.TRAIN or evaluation_due(round_, every)
    if action is Action.SETUP:
        return half.setup(round_seed)
    if action is Action.TRAIN:
        from hetfed.client.training import round_lr_factor  # torch is loaded: the half built its model

        with round_lr_factor(half.config.lr_factor(round_)):
            return half.train(round_, round_seed, received)
    return [half.evaluate(round_, received)]


@dataclass(frozen=True)
class Member:
    """This organization in the run it joined: the reply, the algorithm and its half, the data and the privacy
    session (None without ``[privacy]``)."""

    joined: JoinReply
    spec: AlgorithmSpec
    half: ClientHalf  # type: ignore[type-arg]
    data: ClientData
    privacy: PrivacySession | None
    wire_dtype: str | None

    @property
    def algorithm(self) -> str:
        """The run's algorithm."""
        return self.joined.algorithm


@dataclass(frozen=True)
class Gauges:
    """The client's per-round gauges, labelled (run, algorithm, organization)."""

    train_loss: Gauge
    test_accuracy: Gauge
    round: Gauge


class RoundLoop:
    """One organization's rounds of one run, after ``completed`` (the round its saved state had finished, -1)."""

    def __init__(self, client: AggregatorClient, config: ClientConfig, member: Member, store: StateFile | None,
                 gauges: Gauges, reports: list[tuple[int, EvalMetrics]], completed: int,
                 pending: PendingPushFile | None = None) -> None:
        self.client, self.config, self.member, self.store, self.gauges = client, config, member, store, gauges
        self.reports, self.completed = reports, completed
        # Where the round's update is kept until it is acknowledged (None: without a state directory); a kept push
        # of an earlier process is looked for once, for the first round this process is asked to work.
        self.pending = pending
        self._look_for_kept = pending is not None
        self.labels = (config.run, member.algorithm, config.organization)
        self.own: OwnRecord | None = None  # under [privacy], its own exact figures (configuration.md: output_dir)
        if member.privacy is not None and config.output_dir:
            from hetfed.client.own_record import OwnRecord

            self.own = OwnRecord(config.output_dir, config.organization, config.run, resumed_round=completed)
        self.final: tuple[int, EvalMetrics] | None = None  # the evaluate round's figures, if this process reported
        self._train_cpu = 0.0
        self._train_wall = 0.0

    def run(self) -> tuple[int, EvalMetrics] | None:
        """Follow the instructions until FINISH; the evaluate round's figures when this process reported them."""
        cfg, spec = self.config, self.member.spec
        while True:
            ins = self.client.pull(self.completed, cfg.pull_wait_seconds, spec)
            if ins.action is Action.WAIT:
                continue
            if ins.action is Action.FINISH:
                log.info("%s: run %s finished", cfg.organization, cfg.run)
                return self.final
            exact = self._resumed(ins)
            if exact is None:
                upload = self._work(ins, Received(ins.payloads, spec.repeated_download))
                exact = [p for p in upload if isinstance(p, EvalMetrics)]  # the organization's own figures
                upload, exact, declaration = self._protect(ins.round, upload, exact)
                if self.member.joined.secure_aggregation and ins.action is Action.TRAIN:
                    self._push_secure(ins, upload, declaration)
                else:
                    self._push(ins, upload, declaration, exact)
            self._keep(ins, exact)
            if self.pending is not None:  # after the state is saved: a restart now resumes after this round
                self.pending.remove()

    def _work(self, ins: Instructions, received: Received) -> list[Payload]:
        """The round's upload from the half's hook, after the privacy budget's check; a half whose training
        diverged leaves the run (the same state would diverge again)."""
        from hetfed.client.training import TrainingDivergedError

        cfg, privacy, round_ = self.config, self.member.privacy, ins.round
        if privacy is not None and ins.action is not Action.EVALUATE:
            why = privacy.exhausted_before(setup=ins.action is Action.SETUP)
            if why is not None:
                log.warning("%s", why)
                self._leave_spent(round_, privacy)
                raise PrivacyBudgetSpent(why)
            privacy.begin_round(round_, ins.round_seed)
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            upload = run_round(self.member.half, ins.action, round_, ins.round_seed, received)
        except TrainingDivergedError as exc:  # retrying the round from the same state diverges the same way
            # The notice names the event only: the loss value is a figure of private data (kept in the log).
            log.warning("%s: local training diverged in round %d: %s", cfg.organization, round_, exc)
            self._leave_for(round_, f"its local training diverged in round {round_}")
            raise ClientError(f"{cfg.organization}: local training diverged in round {round_}: {exc}; its model "
                              "is no longer finite and nothing was sent. A lower learning rate (lr), or a cap "
                              "on the gradient's norm (max_grad_norm), may avoid it", permanent=True) from None
        if cfg.report_timing:
            upload = self._timed(upload, time.process_time() - cpu, time.perf_counter() - wall)
        return upload

    def _protect(self, round_: int, upload: list[Payload], exact: list[EvalMetrics],
                 ) -> tuple[list[Payload], list[EvalMetrics], PrivacyDeclaration | None]:
        """Under ``[privacy]``, the upload with its figures released (or withheld) and the round's declaration;
        the ledger is on disk before the upload leaves. Without, the upload as it is."""
        privacy = self.member.privacy
        if privacy is None:
            return upload, exact, None
        # Figures of private data leave only as released (their releases in this round's ledger entry).
        upload = [privacy.protect(p) if isinstance(p, EvalMetrics) else p for p in upload]
        declaration = privacy.close_round(round_)
        figures = privacy.figures(declaration)
        upload = [dataclasses.replace(p, extra={**p.extra, **figures}) if isinstance(p, EvalMetrics) else p
                  for p in upload]
        exact = [dataclasses.replace(p, extra={**p.extra, **figures}) for p in exact]
        crash_point("privacy.ledger_written")
        return upload, exact, declaration

    def _key(self, ins: Instructions) -> RoundKey:
        from hetfed.client.pending import RoundKey

        return RoundKey(ins.round, ins.action.name, int(ins.round_seed), self.completed)

    def _push(self, ins: Instructions, upload: list[Payload], declaration: PrivacyDeclaration | None,
              exact: list[EvalMetrics]) -> None:
        """Encode the upload, keep it with the state after the round's work (with a state directory, when it is
        ``keep_push_from_bytes`` or more, or under ``[privacy]``), push it."""
        outgoing = self.client.prepare_push(ins.round, upload, self.member.wire_dtype, privacy=declaration)
        privacy = self.member.privacy
        if self.pending is not None and (privacy is not None or outgoing.size >= self.config.keep_push_from_bytes):
            try:
                self.pending.save(self._key(ins), outgoing.data, outgoing.digest, self.member.half.private_state(),
                                  exact, privacy.released if privacy is not None else {})
            except OSError as exc:  # the push goes all the same: a restart then works the round again
                log.warning("%s: the push of round %d could not be kept in %s (%s); it is sent unkept",
                            self.config.organization, ins.round, self.pending.dir, exc)
                with contextlib.suppress(OSError):
                    self.pending.remove()
        self._send(outgoing)

    def _push_secure(self, ins: Instructions, upload: list[Payload], declaration: PrivacyDeclaration | None) -> None:
        """Under secure aggregation (docs/security.md): the round's stages around the push
        (``hetfed.client.secure.SecureExchange``), the summed kinds masked. The push is not kept: a restarted
        process could not answer the unmask request (this round's keys live only in this one). The stochastic
        rounding draws from the round seed and the organization's name."""
        from hetfed.client.secure import SecureExchange

        cfg = self.config
        exchange = SecureExchange(self.client, cfg.organization, ins.round, cfg.pull_wait_seconds)
        rng = np.random.default_rng([int(ins.round_seed), zlib.crc32(cfg.organization.encode())])
        masked = exchange.masked_upload(upload, self.member.spec.summed_upload, rng,
                                        distributed=self._distributed(ins.round))
        if masked is None and exchange.refused:
            log.error("%s: round %d's update refused before masking, nothing of it sent (%s); the organization is "
                      "a dropout of the round", cfg.organization, ins.round, exchange.refused)
            return
        if masked is None:
            log.warning("%s: left out of round %d's secure aggregation (it came after its keys were exchanged, or "
                        "the round's aggregate ended); the round closed without its update", cfg.organization,
                        ins.round)
            return
        crash_point("secure.masked")
        try:
            self._send(self.client.prepare_push(ins.round, masked, self.member.wire_dtype, privacy=declaration))
        except RemoteError as err:  # the round's aggregate was abandoned before the masked input arrived
            if err.reason != "unexpected_stage":
                raise
            log.warning("%s: round %d's secure aggregate ended before its masked input arrived (%s); it sits the "
                        "round out", cfg.organization, ins.round, err.details)
            return
        if not exchange.unmask():
            log.warning("%s: round %d ended without asking this organization to unmask", cfg.organization, ins.round)

    def _distributed(self, round_: int) -> Distributed | None:
        """Under distributed DP: the half's plan, the round's rotation seed and a secret generator for the rounding
        and the noise share (from the organization's ``noise_seed`` when it fixes one, else OS entropy: the round
        seed is the aggregator's, and whoever knows the generator can subtract the share)."""
        plan = self.member.half.ctx.distributed
        if plan is None:
            return None
        from hetfed.wire.distributed import rotation_seed

        privacy, org = self.member.privacy, self.config.organization
        if privacy is not None and privacy.cfg.noise_seed >= 0:
            secret = np.random.default_rng([privacy.cfg.noise_seed, round_, zlib.crc32(org.encode()), _DDP_STREAM,
                                            sum(r.count for r in privacy.ledger.releases)])
        else:
            secret = np.random.default_rng()
        return plan, rotation_seed(int(self.member.joined.seed), round_), secret

    def _send(self, outgoing: OutgoingPush, resume: bool = False) -> None:
        sending = _half_sent if crashpoints.armed("push.half_sent") else None
        try:
            self.client.send_push(outgoing, resume, sending)
        except RemoteError as err:
            if err.reason != "late":
                raise
            log.warning("round %d closed before our update arrived: %s", outgoing.round, err.details)

    def _resumed(self, ins: Instructions) -> list[EvalMetrics] | None:
        """For the first round this process works: when an earlier process kept its push of this very round, the
        state after that round's work restored and the same update pushed from where the aggregator holds it;
        the organization's own exact figures of the round. None otherwise (the round is worked as usual)."""
        if not self._look_for_kept:
            return None
        self._look_for_kept = False
        assert self.pending is not None
        kept = self.pending.take(self._key(ins))
        if kept is None:
            return None
        cfg = self.config
        try:
            outgoing = self.client.reopen_push(ins.round, kept.data)
            if outgoing.digest != kept.digest:
                raise WireError("malformed", "its bytes are not those it was kept with (another digest)")
        except WireError as err:
            log.warning("discarded the kept push in %s: %s; round %d is worked again", self.pending.record,
                        err.message, ins.round)
            self.pending.remove()
            return None
        try:
            self.member.half.load_private_state(kept.state)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            self.pending.remove()
            raise ClientError(f"{self.pending.record} does not fit this organization's model ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:300]}); it is removed", permanent=True) from None
        if self.member.privacy is not None:  # the uploads go on carrying the round's released figures
            self.member.privacy.released = dict(kept.released)
        log.info("%s: resuming the push of round %d kept by an earlier process (%d bytes, %d chunks); the round is "
                 "not worked again", cfg.organization, ins.round, outgoing.size, len(outgoing))
        self._send(outgoing, resume=True)
        return kept.exact

    def _keep(self, ins: Instructions, exact: list[EvalMetrics]) -> None:
        """What a pushed round leaves: the saved state, the snapshots, the organization's own exact figures."""
        from hetfed.client.artifacts import write_snapshot

        cfg, half, data, round_ = self.config, self.member.half, self.member.data, ins.round
        if self.store is not None:  # after the aggregator has the update: a restart resumes after this round
            log.info("%s: state after round %d saved (%s)", cfg.organization, round_,
                     self.store.save(round_, half.private_state(), evaluated=ins.action is Action.EVALUATE))
        if cfg.output_dir and (ins.action is Action.EVALUATE or (ins.action is Action.TRAIN and round_ == 1)):
            tag = "final" if ins.action is Action.EVALUATE else "round-1"
            write_snapshot(cfg.output_dir, tag, half.deployed_model(), data, cfg.model.reference,
                           half.ctx.source(data.probe_set()[1]))
        self.completed = round_
        if self.own is not None and exact:  # the true count: the upload declared the released one
            self.own.record(round_, exact, len(data.train))
        for p in exact:  # the organization's own record, its gauges and its card hold the exact figures
            if self.member.privacy is not None:  # logged here for the operator; the upload carried them gated
                log.info("%s: round %d (exact, not sent): train_loss=%.6g test_accuracy=%.6g test_loss=%.6g",
                         cfg.organization, round_, p.train_loss, p.test_accuracy, p.test_loss)
            self.reports.append((round_, p))
            self.gauges.train_loss.labels(*self.labels).set(p.train_loss)
            self.gauges.test_accuracy.labels(*self.labels).set(p.test_accuracy)
            if ins.action is Action.EVALUATE:
                self.final = (round_, p)
        self.gauges.round.labels(*self.labels).set(round_)

    def _timed(self, upload: list[Payload], cpu: float, wall: float) -> list[Payload]:
        """The upload with the cumulative CPU and wall seconds of local work added to its metrics."""
        self._train_cpu += cpu
        self._train_wall += wall
        timing = {"train_cpu_seconds": self._train_cpu, "train_wall_seconds": self._train_wall,
                  "process_cpu_seconds": time.process_time()}
        return [dataclasses.replace(p, extra={**p.extra, **timing}) if isinstance(p, EvalMetrics) else p
                for p in upload]

    def _leave_spent(self, round_: int, privacy: PrivacySession) -> None:
        """Tell the aggregator this organization leaves (a declaration with ``budget_spent`` and no payload), so no
        round waits for it; the aggregator answers with the refusal ``privacy_budget_spent``."""
        from hetfed.wire.errors import PRIVACY_BUDGET_SPENT_REASON

        err = self.client.leave(round_, privacy=privacy.declaration(budget_spent=True),
                                wire_dtype=self.member.wire_dtype)
        if err is None:
            log.warning("%s: the aggregator accepted a leave notice as an update", self.config.organization)
        elif err.reason != PRIVACY_BUDGET_SPENT_REASON:
            log.warning("%s: the aggregator did not take the leave notice (%s: %s); rounds wait for this "
                        "organization until their deadline", self.config.organization, err.code.name, err.details)

    def _leave_for(self, round_: int, reason: str) -> None:
        """Tell the aggregator this organization leaves the run for ``reason`` (a leave notice: no payload), so no
        round waits for it until its deadline; the aggregator answers with the refusal ``organization_left``. A
        notice that does not get through is logged: the rounds then wait for the deadline, as for a stopped client."""
        from hetfed.wire.errors import MAX_LEAVE_REASON_CHARS, ORGANIZATION_LEFT_REASON

        try:
            err = self.client.leave(round_, leave_reason=reason[:MAX_LEAVE_REASON_CHARS])
        except Exception as exc:  # never let the notice hide why the client stops
            why = f"{type(exc).__name__}: {exc}"
        else:
            if err is not None and err.reason == ORGANIZATION_LEFT_REASON:
                log.info("%s: the aggregator took the leave notice: %s", self.config.organization, err.details)
                return
            why = "it was accepted as an update" if err is None else f"{err.code.name}: {err.details}"
        log.warning("%s: the aggregator did not take the leave notice (%s); rounds wait for this organization until "
                    "their deadline", self.config.organization, why)


def _half_sent(index: int, count: int) -> None:
    """The crash point ``push.half_sent``: the push stream takes its middle chunk."""
    if count > 1 and index == count // 2:
        crash_point("push.half_sent")
