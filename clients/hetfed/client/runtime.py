"""The client runtime: join, long-poll for instructions, run the algorithm's hook, push; retry with backoff.

The runtime knows no algorithm: it learns the run's algorithm, config and seed from Join, builds the
organization's model and the algorithm's client half from the registries, declares its tensors when the
run asks for them, and then follows instructions. Failed calls are retried by the reason the aggregator
gives (``RemoteError.retryable``), never by matching message text.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hetfed.client.config import ClientConfig
from hetfed.client.crashpoints import crash_point
from hetfed.wire.messages import Fingerprint
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.phases import Action
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.base import PeriodicEvalConfig, SharedSpaceConfig
from hetfed.wire.traffic import TrafficMetrics

if TYPE_CHECKING:
    import torch

    from hetfed.client.algorithms.base import ClientHalf
    from hetfed.client.data import ClientData
    from hetfed.client.privacy.session import PrivacySession
    from hetfed.client.state import StateFile

log = logging.getLogger("hetfed.client")
T = TypeVar("T")


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

class ClientError(RuntimeError):
    """The aggregator refused this client for a reason retrying cannot fix, or stayed unreachable.

    ``permanent``: no retry of the same process can succeed (a refusal by reason, a state directory that
    belongs to another run); the CLI exits 2 so a Job's failure policy fails at once instead of retrying."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class PrivacyBudgetSpent(ClientError):  # noqa: N818 (an outcome, not a fault)
    """The organization's privacy budget would be exceeded by its next round: it sends nothing more and leaves the
    run (exit status 3; the round goes on under the quorum rules)."""

    exit_status = 3

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


def backoff_delays(initial: float, maximum: float, multiplier: float, rng: random.Random) -> Iterator[float]:
    """Exponential backoff with full jitter: uniform(0, min(max, initial·multiplier^k))."""
    cap = initial
    while True:
        yield rng.uniform(0, cap)
        cap = min(maximum, cap * multiplier)


def resolve_device(name: str) -> str:
    """The torch device for a config value ("auto" picks CUDA when present)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ClientError(f"device {name!r} requested but CUDA is not available here")
    return name


class ClientRuntime:
    """One organization's participation in one run, over real gRPC."""

    def __init__(self, config: ClientConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        labels = ["run", "algorithm", "organization"]
        self.train_loss = Gauge("hetfed_client_train_loss", "Training loss of the last round", labels,
                                registry=self.registry)
        self.test_accuracy = Gauge("hetfed_client_test_accuracy", "Test accuracy reported in the last round", labels,
                                   registry=self.registry)
        self.round_gauge = Gauge("hetfed_client_round", "Last round this organization completed", labels,
                                 registry=self.registry)
        self._rng = random.Random(config.data.seed * 7919 + len(config.organization))
        self.client = AggregatorClient(config.aggregator, config.tls, config.organization, config.run,
                                       traffic=TrafficMetrics(self.registry, "client"), retry=self._retry)
        self.algorithm = ""
        self.reports: list[tuple[int, EvalMetrics]] = []
        self._train_cpu = 0.0
        self._train_wall = 0.0
        # The round the saved private state had finished (-1: started fresh).
        self.resumed_round = -1

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying retryable failures with backoff until ``give_up_after_seconds``."""
        r = self.config.retry
        delays = backoff_delays(r.initial_backoff_seconds, r.max_backoff_seconds, r.multiplier, self._rng)
        start = time.monotonic()
        while True:
            try:
                return call()
            except RemoteError as err:
                if not err.retryable:
                    raise
                if time.monotonic() - start > r.give_up_after_seconds:
                    raise ClientError(f"{what}: aggregator unreachable for {r.give_up_after_seconds:.0f}s "
                                      f"({err})") from None
                delay = next(delays)
                log.info("%s failed (%s%s); retrying in %.2fs", what, err.code.name,
                         f" {err.reason}" if err.reason else "", delay)
                time.sleep(delay)

    def _timed(self, upload: list[Payload], cpu: float, wall: float) -> list[Payload]:
        """The upload with the cumulative CPU and wall seconds of local work added to its metrics."""
        self._train_cpu += cpu
        self._train_wall += wall
        timing = {"train_cpu_seconds": self._train_cpu, "train_wall_seconds": self._train_wall,
                  "process_cpu_seconds": time.process_time()}
        return [dataclasses.replace(p, extra={**p.extra, **timing}) if isinstance(p, EvalMetrics) else p
                for p in upload]

    def _resume(self, half: ClientHalf, algorithm: str, seed: int, current_round: int) -> StateFile | None:  # type: ignore[type-arg]
        """The state file (None without ``state_dir``), its saved state loaded into ``half`` when there is one."""
        from hetfed.client.state import StateFile, StateMismatchError, digest

        cfg = self.config
        if not cfg.state_dir:
            log.info("%s: no state_dir configured; private state starts fresh and ends with this process",
                     cfg.organization)
            return None
        store = StateFile(cfg.state_dir, cfg.run, {"run": cfg.run, "organization": cfg.organization,
                                                   "algorithm": algorithm, "seed": seed, "model": cfg.model.reference})
        try:
            saved = store.load()
        except StateMismatchError as exc:
            raise ClientError(str(exc), permanent=True) from None
        if saved is None:
            log.info("%s: no saved state in %s; private state starts fresh", cfg.organization, store.path)
            return store
        if saved.round > current_round:
            raise ClientError(f"{store.path} holds the state after round {saved.round}, but run {cfg.run!r} is at "
                              f"round {current_round}: the run was started over under the same id; move the file "
                              "away to start this organization afresh", permanent=True)
        try:
            half.load_private_state(saved.state)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise ClientError(f"{store.path} does not fit this organization's model ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:300]}); move it away to start afresh",
                              permanent=True) from None
        self.resumed_round = saved.round
        log.info("%s: resumed from %s after round %d (%s)", cfg.organization, store.path, saved.round,
                 digest(half.private_state()))
        return store

    def _own_data_and_model(self) -> ClientData:
        """This organization's data, with its architecture built once on a probe batch: a data factory or model
        builder that cannot serve (it cannot be imported, raises, returns the wrong thing) stops the client in
        one line before it joins, so nothing is sent."""
        from hetfed.client.data import load_client_data
        from hetfed.client.models import build_model

        cfg = self.config
        try:
            data = load_client_data(cfg.data)
            model = build_model(cfg.model.reference, data.input_shape, data.num_classes,
                                latent_dim=cfg.model.latent_dim or None)
            if cfg.privacy.enabled:  # a model DP-SGD cannot serve is refused before joining
                from hetfed.client.privacy.mechanisms import prepare_model

                prepare_model(model, cfg.privacy, cfg.organization)
        except (ValueError, ImportError) as exc:
            raise ClientError(" ".join(str(exc).split()), permanent=True) from None
        return data

    def _privacy_session(self, data: ClientData, device: torch.device) -> PrivacySession | None:
        """The organization's DP session (None without ``[privacy]``): its ledger continued from ``state_dir``; a
        ledger that cannot be continued or a budget already spent stops the client before it joins."""
        cfg = self.config
        if not cfg.privacy.enabled:  # before the imports: dp-accounting (and scipy) cost a client without DP 65 MB
            return None
        from hetfed.client.privacy.ledger import LedgerError
        from hetfed.client.privacy.mechanisms import PrivacyError
        from hetfed.client.privacy.session import PrivacySession

        try:
            session = PrivacySession(cfg.privacy, cfg.run, cfg.organization, cfg.state_dir, len(data.train), device,
                                     groups=data.train.groups)
        except (LedgerError, PrivacyError) as exc:
            raise ClientError(str(exc), permanent=True) from None
        budget, spent = cfg.privacy.budget, session.spent()
        if budget is not None and spent >= budget:
            raise ClientError(f"{cfg.organization}: privacy budget ε={budget:g} is already spent in run {cfg.run!r} "
                              f"(ε={spent:.4g}, {session.ledger.path}); nothing more can be sent", permanent=True)
        if not cfg.state_dir:
            log.warning("%s: privacy: ephemeral_ledger: the privacy ledger ends with this process, and every "
                        "declaration says so (a run with refuse_ephemeral_ledgers refuses them)", cfg.organization)
        elif spent > 0:
            log.info("%s: privacy: ledger %s continued at ε=%.4g", cfg.organization, session.ledger.path, spent)
        try:  # N̂ goes out at Join: released (or read back) first
            session.release_examples()
        except LedgerError as exc:
            raise ClientError(str(exc), permanent=True) from None
        return session

    def _evaluated_before(self) -> bool:
        """Whether the state directory says this organization finished the run's evaluate round."""
        from hetfed.client.state import StateFile

        cfg = self.config
        if not cfg.state_dir:
            return False
        return StateFile(cfg.state_dir, cfg.run, {
            "run": cfg.run, "organization": cfg.organization}).evaluated()

    def _leave(self, round_: int, wire_dtype: str | None, privacy: PrivacySession) -> None:
        """Tell the aggregator this organization leaves (a declaration with ``budget_spent`` and no payload), so no
        round waits for it; the aggregator answers with the refusal ``privacy_budget_spent``."""
        from hetfed.wire.errors import PRIVACY_BUDGET_SPENT_REASON

        err = self.client.leave(round_, privacy=privacy.declaration(budget_spent=True), wire_dtype=wire_dtype)
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

    def _plan_privacy(self, half: ClientHalf, privacy: PrivacySession, rounds: int) -> None:  # type: ignore[type-arg]
        """Check that ``half`` can send under DP as configured and fix σ for the run's planned rounds."""
        from hetfed.client.privacy.mechanisms import PrivacyError
        from hetfed.client.training import steps_per_round

        mechanism = half.privacy_mechanism
        assert mechanism is not None
        try:
            half.check_privacy()
            setup, per_round = half.privacy_plan(privacy.q, steps_per_round(privacy.num_examples, half.config))
            # Metric releases: every training round that evaluates, and the final evaluation; none for a half
            # whose metrics evaluate a model trained outside DP (they stay withheld).
            every = half.config.eval_every if isinstance(half.config, PeriodicEvalConfig) else 1
            evaluations = sum(evaluation_due(r, every) for r in range(1, rounds + 1)) + 1
            sets = 1 + len(half.ctx.eval_sets) if half.deployed_under_dp else 0
            privacy.plan(mechanism, setup, per_round, rounds, privacy.evaluation_plan(sets, evaluations))
        except (PrivacyError, ValueError) as exc:
            raise ClientError(f"{self.config.organization}: {' '.join(str(exc).split())}", permanent=True) from None

    def run(self) -> list[tuple[int, EvalMetrics]]:
        """Take part in the run until it finishes; returns the metrics of each round as this organization computed
        them (exact: under [privacy] the upload carried them withheld or released with noise)."""
        try:
            return self._run()
        except RemoteError as err:
            # Non-retryable by reason: the same request fails again whoever retries it (a new pod included).
            reason = err.reason or err.code.name
            details = " ".join(err.details.split()).removeprefix(f"{reason}: ")  # the text starts with the reason
            raise ClientError(f"{err.code.name}: the aggregator refused {self.config.organization!r} for good "
                              f"({reason}): {details}", permanent=True) from None
        finally:
            self.client.close()

    def _run(self) -> list[tuple[int, EvalMetrics]]:
        import torch

        from hetfed.client.algorithms import ClientContext, client_half_type
        from hetfed.client.artifacts import write_snapshot
        from hetfed.client.models import SplitModel
        from hetfed.client.training import TrainingDivergedError

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.metrics_port >= 0:
            start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=self.registry)
        device = torch.device(resolve_device(cfg.device))
        data = self._own_data_and_model()
        privacy = self._privacy_session(data, device)
        seed_set = Fingerprint(*data.seed_set) if data.seed_set else None
        # Under DP the organization declares its released count N̂, never N.
        num_examples = privacy.num_examples if privacy is not None else len(data.train)
        try:
            joined = self.client.join(seed_set=seed_set, num_train_examples=num_examples,
                                      num_classes=data.num_classes, input_shape=data.input_shape)
        except RemoteError as err:
            if err.reason == "run_finished" and self._evaluated_before():
                # Killed between its last push and FINISH: the run it completed has ended; nothing to redo.
                log.info("%s: run %s finished; this organization had completed it (%s)", cfg.organization,
                         cfg.run, cfg.state_dir)
                return self.reports
            raise
        self.algorithm = joined.algorithm
        spec = get_spec(joined.algorithm)
        config = joined.config
        wire_dtype = None if config.wire_dtype == "float32" else config.wire_dtype
        # A run with one latent space (a SharedSpaceConfig) sets the width unless the model config does.
        shared = config.latent_dim if isinstance(config, SharedSpaceConfig) else None
        latent = cfg.model.latent_dim or shared or None

        half_type = client_half_type(spec)
        if privacy is not None:  # before anything trains or is declared
            from hetfed.client.privacy.ledger import LedgerError

            try:
                privacy.joined(int(joined.current_round))
            except LedgerError as exc:
                raise ClientError(str(exc), permanent=True) from None

        if privacy is not None and half_type.privacy_mechanism is None:
            raise ClientError(f"{cfg.organization}: [privacy] is set, but hetfed has no DP mechanism for "
                              f"{joined.algorithm}'s uploads (docs/privacy.md lists the algorithms it serves)",
                              permanent=True)
        if privacy is not None:
            privacy.set_batch_size(config.batch_size)

        def build() -> SplitModel:
            # The run's seed fixes the initial weights, the same in every organization; the algorithm's half
            # builds the architecture (most as registered, some wrapped in what the algorithm needs).
            model = half_type.make_model(cfg.model.reference, data.input_shape, data.num_classes, seed=int(joined.seed),
                                         latent_dim=latent, bounded_latent=spec.latent_bounded(config), config=config)
            if privacy is not None:  # BatchNorm replaced by GroupNorm (or refused) before the model trains
                from hetfed.client.privacy.mechanisms import prepare_model

                model = prepare_model(model, cfg.privacy, cfg.organization)  # type: ignore[assignment]
            return model.to(device)  # type: ignore[return-value]

        ctx = ClientContext(cfg.organization, build(), data, device, config, int(joined.seed), build_model=build,
                            num_workers=cfg.data.num_workers, pin_memory=cfg.data.pin_memory, privacy=privacy)
        half = half_type(ctx)
        if privacy is not None:
            self._plan_privacy(half, privacy, int(joined.total_rounds))
        if joined.declare_required:
            self.client.join(declared=half.declarations(wire_dtype), seed_set=seed_set,
                             num_train_examples=num_examples, num_classes=data.num_classes,
                             input_shape=data.input_shape)
        log.info("%s joined run %s (%s) at round %d on %s", cfg.organization, cfg.run, joined.algorithm,
                 joined.current_round, device)
        labels = (cfg.run, joined.algorithm, cfg.organization)
        store = self._resume(half, joined.algorithm, int(joined.seed), int(joined.current_round))
        completed = self.resumed_round
        own = None  # under [privacy], the organization's own exact figures (docs/configuration.md: output_dir)
        if privacy is not None and cfg.output_dir:
            from hetfed.client.own_record import OwnRecord

            own = OwnRecord(cfg.output_dir, cfg.organization, cfg.run, resumed_round=completed)
        final: tuple[int, EvalMetrics] | None = None  # the evaluate round's figures, when this process reported them
        while True:
            ins = self.client.pull(completed, cfg.pull_wait_seconds, spec)
            round_ = ins.round
            if ins.action is Action.WAIT:
                continue
            if ins.action is Action.FINISH:
                log.info("%s: run %s finished", cfg.organization, cfg.run)
                break
            received = Received(ins.payloads, spec.repeated_download)
            if privacy is not None and ins.action is not Action.EVALUATE:
                why = privacy.exhausted_before(setup=ins.action is Action.SETUP)
                if why is not None:
                    log.warning("%s", why)
                    self._leave(round_, wire_dtype, privacy)
                    raise PrivacyBudgetSpent(why)
                privacy.begin_round(round_, ins.round_seed)
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                upload = run_round(half, ins.action, round_, ins.round_seed, received)
            except TrainingDivergedError as exc:  # retrying the round from the same state diverges the same way
                # The notice names the event only: the loss value is a figure of private data (kept in the log).
                log.warning("%s: local training diverged in round %d: %s", cfg.organization, round_, exc)
                self._leave_for(round_, f"its local training diverged in round {round_}")
                raise ClientError(f"{cfg.organization}: local training diverged in round {round_}: {exc}; its model "
                                  "is no longer finite and nothing was sent. A lower learning rate (lr), or a cap "
                                  "on the gradient's norm (max_grad_norm), may avoid it", permanent=True) from None
            if cfg.report_timing:
                upload = self._timed(upload, time.process_time() - cpu, time.perf_counter() - wall)
            exact = [p for p in upload if isinstance(p, EvalMetrics)]  # the organization's own figures
            declaration = None
            if privacy is not None:  # the ledger is on disk before the upload leaves
                # Figures of private data leave only as released (their releases in this round's ledger entry).
                upload = [privacy.protect(p) if isinstance(p, EvalMetrics) else p for p in upload]
                declaration = privacy.close_round(round_)
                figures = privacy.figures(declaration)
                upload = [dataclasses.replace(p, extra={**p.extra, **figures}) if isinstance(p, EvalMetrics) else p
                          for p in upload]
                exact = [dataclasses.replace(p, extra={**p.extra, **figures}) for p in exact]
                crash_point("privacy.ledger_written")
            try:
                self.client.push(round_, upload, wire_dtype, privacy=declaration)
            except RemoteError as err:
                if err.reason != "late":
                    raise
                log.warning("round %d closed before our update arrived: %s", round_, err.details)
            if store is not None:  # after the aggregator has the update: a restart resumes after this round
                log.info("%s: state after round %d saved (%s)", cfg.organization, round_,
                         store.save(round_, half.private_state(), evaluated=ins.action is Action.EVALUATE))
            if cfg.output_dir and (ins.action is Action.EVALUATE or (ins.action is Action.TRAIN and round_ == 1)):
                tag = "final" if ins.action is Action.EVALUATE else "round-1"
                write_snapshot(cfg.output_dir, tag, half.deployed_model(), data, cfg.model.reference,
                               half.ctx.source(data.probe_set()[1]))
            completed = round_
            if own is not None and exact:  # the true count: the upload declared the released one
                own.record(round_, exact, len(data.train))
            for p in exact:  # the organization's own record, its gauges and its card hold the exact figures
                if privacy is not None:  # logged here for the operator; the upload carried them gated
                    log.info("%s: round %d (exact, not sent): train_loss=%.6g test_accuracy=%.6g test_loss=%.6g",
                             cfg.organization, round_, p.train_loss, p.test_accuracy, p.test_loss)
                self.reports.append((round_, p))
                self.train_loss.labels(*labels).set(p.train_loss)
                self.test_accuracy.labels(*labels).set(p.test_accuracy)
                if ins.action is Action.EVALUATE:
                    final = (round_, p)
            self.round_gauge.labels(*labels).set(round_)
        if final is not None:  # the model this organization would deploy, with what it reached (docs/export.md)
            from hetfed.client.export import export_after_run

            if privacy is not None:  # Opacus' hooks off: TorchScript cannot compile a module with backward hooks
                privacy.release()

            export_after_run(cfg, half, joined.algorithm, *final, self.registry)
        if cfg.metrics_port >= 0 and cfg.metrics_linger_seconds > 0:
            time.sleep(cfg.metrics_linger_seconds)  # serve the final counts to the next scrape
        return self.reports
