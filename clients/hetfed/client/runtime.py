"""The client runtime: join, long-poll for instructions, run the algorithm's hook, push; retry with backoff.

The runtime knows no algorithm: it learns the run's algorithm, config and seed from Join, builds the
organization's model and the algorithm's client half from the registries, declares its tensors when the
run asks for them, and then follows instructions. Failed calls are retried by the reason the aggregator
gives (``RemoteError.retryable``), never by matching message text.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hetfed.client.config import ClientConfig
from hetfed.client.errors import ClientError, PrivacyBudgetSpent
from hetfed.client.rounds import Gauges, Member, RoundLoop, evaluation_due, run_round
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.errors import WireError
from hetfed.wire.messages import Fingerprint, JoinReply
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.specs import AlgorithmSpec, TrainConfig, get_spec
from hetfed.wire.specs.base import PeriodicEvalConfig, SharedSpaceConfig
from hetfed.wire.traffic import TrafficMetrics

if TYPE_CHECKING:
    import torch

    from hetfed.client.algorithms.base import ClientHalf
    from hetfed.client.data import ClientData
    from hetfed.client.models import SplitModel
    from hetfed.client.privacy.ledger import DistributedRelease
    from hetfed.client.privacy.session import PrivacySession
    from hetfed.client.state import StateFile
    from hetfed.wire.distributed import DistributedSum

log = logging.getLogger("hetfed.client")
T = TypeVar("T")
# Names the round loop and the shared errors module hold, kept importable from here.
__all__ = ["ClientError", "ClientRuntime", "PrivacyBudgetSpent", "backoff_delays", "evaluation_due",
           "resolve_device", "run_round"]


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
        self.gauges = Gauges(self.train_loss, self.test_accuracy, self.round_gauge)
        self._rng = random.Random(config.data.seed * 7919 + len(config.organization))
        self.client = AggregatorClient(config.aggregator, config.tls, config.organization, config.run,
                                       traffic=TrafficMetrics(self.registry, "client"), retry=self._retry)
        self.algorithm = ""
        self.reports: list[tuple[int, EvalMetrics]] = []
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
            mechanism, distributed = distributed_releases(half, mechanism)
            privacy.plan(mechanism, setup, per_round, rounds, privacy.evaluation_plan(sets, evaluations),
                         distributed)
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

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.metrics_port >= 0:
            start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=self.registry)
        device = torch.device(resolve_device(cfg.device))
        data = self._own_data_and_model()
        privacy = self._privacy_session(data, device)
        joined = self._first_join(data, privacy)
        if joined is None:
            return self.reports
        member = self._set_up(joined, data, privacy, device)
        store = self._resume(member.half, joined.algorithm, int(joined.seed), int(joined.current_round))
        pending = None
        if store is not None:  # the round's update is kept beside the state until it is acknowledged
            from hetfed.client.pending import PendingPushFile

            pending = PendingPushFile(cfg.state_dir or "", cfg.run, store.identity)
        final = RoundLoop(self.client, cfg, member, store, self.gauges, self.reports, self.resumed_round,
                          pending).run()
        if final is not None:  # the model this organization would deploy, with what it reached (docs/export.md)
            from hetfed.client.export import export_after_run

            if privacy is not None:  # Opacus' hooks off: TorchScript cannot compile a module with backward hooks
                privacy.release()
            export_after_run(cfg, member.half, joined.algorithm, *final, self.registry)
        if cfg.metrics_port >= 0 and cfg.metrics_linger_seconds > 0:
            time.sleep(cfg.metrics_linger_seconds)  # serve the final counts to the next scrape
        return self.reports

    def _join(self, data: ClientData, privacy: PrivacySession | None,
              declared: Sequence[DeclaredTensor] = ()) -> JoinReply:
        """Join the run with what this organization declares: its data's seed set, training examples (under DP the
        released count N̂, never N), label count and input shape, and ``declared`` tensors."""
        seed_set = Fingerprint(*data.seed_set) if data.seed_set else None
        num_examples = privacy.num_examples if privacy is not None else len(data.train)
        return self.client.join(declared=declared, seed_set=seed_set, num_train_examples=num_examples,
                                num_classes=data.num_classes, input_shape=data.input_shape)

    def _first_join(self, data: ClientData, privacy: PrivacySession | None) -> JoinReply | None:
        """The Join reply; None when the run has finished and this organization had completed it."""
        try:
            return self._join(data, privacy)
        except RemoteError as err:
            if err.reason == "run_finished" and self._evaluated_before():
                # Killed between its last push and FINISH: the run it completed has ended; nothing to redo.
                log.info("%s: run %s finished; this organization had completed it (%s)", self.config.organization,
                         self.config.run, self.config.state_dir)
                return None
            raise

    def _set_up(self, joined: JoinReply, data: ClientData, privacy: PrivacySession | None,
                device: torch.device) -> Member:
        """The run's algorithm config, model and client half, with DP planned under ``[privacy]``; the half's
        tensors declared when the run asks for them."""
        from hetfed.client.algorithms import ClientContext, client_half_type

        cfg = self.config
        self.algorithm = joined.algorithm
        spec = get_spec(joined.algorithm)
        config = joined.config
        wire_dtype = None if config.wire_dtype == "float32" else config.wire_dtype
        half_type = client_half_type(spec)
        if privacy is not None:  # before anything trains or is declared
            self._privacy_joined(privacy, half_type.privacy_mechanism is not None, joined, config.batch_size)
        build = self._model_builder(half_type, spec, config, joined, data, privacy, device)
        distributed = distributed_plan(config, joined, cfg.organization)
        ctx = ClientContext(cfg.organization, build(), data, device, config, int(joined.seed), build_model=build,
                            num_workers=cfg.data.num_workers, pin_memory=cfg.data.pin_memory, privacy=privacy,
                            distributed=distributed)
        try:
            half = half_type(ctx)
        except ValueError as exc:  # the algorithm cannot serve this model: one line (the traceback at debug level)
            log.debug("the client half refused the model", exc_info=exc)
            raise ClientError(f"{cfg.organization}: {joined.algorithm} cannot serve this organization's model: "
                              f"{' '.join(str(exc).split())}", permanent=True) from None
        if privacy is not None:
            self._plan_privacy(half, privacy, int(joined.total_rounds))
        if joined.declare_required:
            self._join(data, privacy, half.declarations(wire_dtype))
        log.info("%s joined run %s (%s) at round %d on %s", cfg.organization, cfg.run, joined.algorithm,
                 joined.current_round, device)
        return Member(joined, spec, half, data, privacy, wire_dtype)

    def _privacy_joined(self, privacy: PrivacySession, served: bool, joined: JoinReply, batch_size: int) -> None:
        """The DP session told the round it joined at and the run's batch size; refused when hetfed has no DP
        mechanism for the algorithm's uploads (``served`` False)."""
        from hetfed.client.privacy.ledger import LedgerError

        try:
            privacy.joined(int(joined.current_round))
        except LedgerError as exc:
            raise ClientError(str(exc), permanent=True) from None
        if not served:
            raise ClientError(f"{self.config.organization}: [privacy] is set, but hetfed has no DP mechanism for "
                              f"{joined.algorithm}'s uploads (docs/privacy.md lists the algorithms it serves)",
                              permanent=True)
        privacy.set_batch_size(batch_size)

    def _model_builder(self, half_type: type[ClientHalf], spec: AlgorithmSpec,  # type: ignore[type-arg]
                       config: TrainConfig, joined: JoinReply, data: ClientData, privacy: PrivacySession | None,
                       device: torch.device) -> Callable[[], SplitModel]:
        """How the organization's model is built, for the half (which may build more than one)."""
        cfg = self.config
        # A run with one latent space (a SharedSpaceConfig) sets the width unless the model config does.
        shared = config.latent_dim if isinstance(config, SharedSpaceConfig) else None
        latent = cfg.model.latent_dim or shared or None

        def build() -> SplitModel:
            # The run's seed fixes the initial weights, the same in every organization; the algorithm's half
            # builds the architecture (most as registered, some wrapped in what the algorithm needs).
            model = half_type.make_model(cfg.model.reference, data.input_shape, data.num_classes,
                                         seed=int(joined.seed), latent_dim=latent,
                                         bounded_latent=spec.latent_bounded(config), config=config)
            if privacy is not None:  # BatchNorm replaced by GroupNorm (or refused) before the model trains
                from hetfed.client.privacy.mechanisms import prepare_model

                model = prepare_model(model, cfg.privacy, cfg.organization)  # type: ignore[assignment]
            return model.to(device)  # type: ignore[return-value]

        return build


def distributed_plan(config: TrainConfig, joined: JoinReply, organization: str) -> DistributedSum | None:
    """Under secure aggregation, the run's distributed-DP plan (``TrainConfig.distributed_sum``): the same one the
    aggregator builds from the run's config, its organizations and rounds."""
    if not joined.secure_aggregation:
        return None
    try:
        return config.distributed_sum(len(joined.organizations), int(joined.total_rounds))
    except WireError as exc:
        raise ClientError(f"{organization}: {exc.message}", permanent=True) from None


def distributed_releases(half: ClientHalf, mechanism: str) -> tuple[str, list[DistributedRelease]]:  # type: ignore[type-arg]
    """The declared mechanism and each training round's distributed releases: one of the run's plan when the half
    uploads its summed kind for the secure sum to noise, else none."""
    if half.ctx.distributed is None:
        return mechanism, []
    from hetfed.client.privacy.ledger import DistributedRelease

    return "dp-sgd+distributed-skellam", [DistributedRelease.of(half.ctx.distributed.plan)]
