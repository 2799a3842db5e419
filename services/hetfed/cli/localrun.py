"""``hetfed run``: a real aggregator and real client processes on loopback, one run per algorithm.

Nothing is simulated: the aggregator and every organization are separate processes started with the same
``hetfed aggregator`` / ``hetfed client`` commands a Kubernetes deployment runs, talking gRPC. This module
knows no algorithm and no dataset: what each needs comes from the registries (``hetfed.wire.specs``, and
the datasets, partitions and models of the client package's ``hetfed.client.catalog``) and the experiment
side (``hetfed.cli.experiments``: defaults and labels by name), and every choice is validated before any
process starts. Client code runs here only through the catalog: the client package's own checks of a plan.

Defaults are layered, the later winning: the command's own (``BASE``: models only; rounds: a run's, the
aggregator's ``DEFAULT_ROUNDS``), the dataset's, the algorithm's (for every dataset, then for this dataset), and
finally what the user gave on the command line. The training knobs have no default here: what no layer sets is
the algorithm's declared config (its dataclass defaults and its spec's presets), the very values a hand-written
aggregator file and the chart get. A knob the algorithm declares itself (a paper's schedule) keeps it under the
dataset's layer: each default is stated once.

Each setting is parsed once, here, into the typed configs themselves: one ``RunConfig`` per run (the
aggregator's) and one ``ClientConfig`` per organization of each run. The files are written from them
(``to_sparse_mapping``: only what differs from a dataclass default), and each process reads its file back
through the same dataclasses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfed.aggregator.config import DEFAULT_ROUNDS, AggregatorConfig, RunConfig, SeedSetConfig, ServerConfig
from hetfed.aggregator.journal.store import holder_of
from hetfed.cli import PRIVACY_BUDGET_SPENT, RUN_TIMEOUT_SECONDS
from hetfed.cli.experiments import DEFAULT_COMPARISON, LocalDefaults, dataset_defaults, experiment
from hetfed.cli.forkserver import ForkedProcess, ForkServer
from hetfed.cli.report import fmt_bytes, write_report
from hetfed.client import catalog
from hetfed.client.catalog import (
    DATASETS,
    DEFAULT_DATASET,
    MODELS,
    OWN_FIGURES,
    PARTITIONS,
    ClientConfig,
    DataConfig,
    ModelConfig,
    PrivacyConfig,
    RetryConfig,
    entry_at,
    input_mismatch,
    is_reference,
    models_for,
    read_own_record,
)
from hetfed.wire.config import ConfigError, from_mapping, to_mapping, to_sparse_mapping
from hetfed.wire.messages import RunStatus
from hetfed.wire.payloads import WITHHELD, EvalMetrics
from hetfed.wire.rpc import status_of
from hetfed.wire.specs import SPECS, AlgorithmSpec, get_spec
from hetfed.wire.specs.base import SharedSpaceConfig, TrainConfig
from hetfed.wire.traffic import Direction
from hetfed.wire.transport import TlsConfig

if TYPE_CHECKING:
    from hetfed.cli.certs import FederationCerts

# The orchestrator's own certificate under --tls: a name no run lists, good only for the read-only Status.
OPERATOR_ORGANIZATION = "hetfed-operator"
# The command's own defaults, under every dataset's and algorithm's. No training knob: those are the algorithm's
# declared config (hetfed.wire.specs), which an aggregator file or the chart that leaves them out gets too.
BASE = LocalDefaults(models=("lenet",))
# Training knobs the command line sets for every run (--local-epochs, --lr, --momentum, --batch-size).
TRAIN_KNOBS = ("local_epochs", "lr", "momentum", "batch_size")
# Organizations when neither the user nor the partition says: the data's own default split.
DEFAULT_CLIENTS = DataConfig.num_clients
# Where the aggregator listens and serves its metrics in a local federation: loopback, on ports it picks.
LOOPBACK = "127.0.0.1"
# A local client's own settings (a single thread each, giving up soon on an aggregator that went away).
CLIENT_THREADS = 1
CLIENT_GIVE_UP_SECONDS = 120.0
# The clients' state directories (under DP, their privacy ledgers) in a run's work directory, one per organization.
CLIENT_STATE = "client-state"
# Written to the files even at their dataclass defaults, so that each file says which data, which share of it
# and which latent width its organization uses, and a run's rounds (under DP, ``client_file`` adds the noise seed).
ALWAYS_WRITTEN = ("data.dataset", "data.partition", "data.num_clients", "data.client_index", "data.seed",
                  "model.latent_dim", "runs.rounds")
# Data fields set by their own options, so not through ``data`` (--data FIELD=VALUE): field -> option.
DATA_OPTIONS = {"dataset": "set it with --dataset", "partition": "set it with --partition", "alpha": "set it with --alpha",
                "num_clients": "set it with --clients", "client_index": "it is set per organization",
                "seed": "set it with --seed", "public_fraction": "set it with --public-fraction",
                "test_split": "set it with --test-split", "train_on_public": "it is a benchmark method's option"}


@dataclass(frozen=True)
class LocalRunOptions:
    """What the user asked ``hetfed run`` for; ``None`` (or empty) leaves the choice to the defaults."""

    algorithms: tuple[str, ...] = DEFAULT_COMPARISON
    # None: the partition's number of organizations, else DEFAULT_CLIENTS.
    clients: int | None = None
    rounds: int | None = None
    dataset: str = DEFAULT_DATASET
    partition: str | None = None
    alpha: float = DataConfig.alpha
    seed: int = DataConfig.seed
    # Per-organization architectures (cycled); --model X is ("X",).
    models: tuple[str, ...] = ()
    latent_dim: int | None = None
    # Own test sets of label-skewed partitions: "proportional" or "fedgen" (hetfed.client.data.split_like).
    test_split: str = DataConfig.test_split
    # Clients write model snapshots and probe latents under <workdir>/artifacts (hetfed.client.artifacts).
    artifacts: bool = False
    # Training knobs given on the command line (TRAIN_KNOBS), for every run.
    train: Mapping[str, Any] = field(default_factory=dict)
    wire_dtype: str = TrainConfig.wire_dtype
    output: str | None = None
    timeout: float = RUN_TIMEOUT_SECONDS
    # --set: algorithm -> config field -> value.
    extra_algorithm_config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Partitions with a shared seed set: its fraction of each domain; train on the whole seed set too (AGG).
    public_fraction: float = DataConfig.public_fraction
    train_on_public: bool = False
    quiet: bool = False
    # Federate over mTLS with certificates generated into <workdir>/certs.
    tls: bool = False
    # Clients report their CPU and wall time of local work (benchmarks measure the overhead with it).
    timing: bool = False
    # > 0: set up for a Prometheus (client metrics, <workdir>/prometheus-targets.json, whole-model references).
    metrics_linger: float = 0.0
    # Write report.png and report.md (hetfed.cli.report) next to results.json.
    report: bool = True
    # Further data fields (DataConfig's, for example a held-out target domain): --data FIELD=VALUE.
    data: Mapping[str, Any] = field(default_factory=dict)
    # Every organization's [privacy] fields (PrivacyConfig's, differential privacy): --set privacy.FIELD=VALUE.
    privacy: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunPlan:
    """One run of a local federation, every default resolved."""

    run_id: str
    spec: AlgorithmSpec
    rounds: int
    models: tuple[str, ...]
    latent_dim: int | None
    # The algorithm's config, parsed once here (the command line's values included); the aggregator's file
    # carries its mapping, which the aggregator and the clients read back through the same dataclass.
    train: TrainConfig
    seed_set: SeedSetConfig | None
    # The aggregator's run, as its file carries it.
    run: RunConfig
    # Each organization's client config, as its file carries it but for the aggregator's address and the
    # organization's certificate (known once the aggregator listens, and the certificates exist: ``client_settings``).
    clients: tuple[ClientConfig, ...]

    @property
    def config(self) -> dict[str, Any]:
        """The algorithm's config as written to the aggregator's file (every field, typed values)."""
        return dict(self.run.algorithm_config)


@dataclass(frozen=True)
class LocalPlan:
    """A whole local federation: the shared data settings and one plan per run."""

    opts: LocalRunOptions
    partition: str
    runs: tuple[RunPlan, ...]
    picture: str
    clients: int = DEFAULT_CLIENTS
    # Every organization's data table, by organization (the same but for client_index).
    data: tuple[DataConfig, ...] = ()
    # The [privacy] fields given, as parsed (PrivacyConfig's types; the clients' tables carry them); empty: no DP.
    privacy: dict[str, Any] = field(default_factory=dict)


def run_id_of(algorithm: str) -> str:
    """The run id of an algorithm in a local federation."""
    return algorithm.replace("_", "-")


def _data_config(opts: LocalRunOptions, partition: str, clients: int, index: int) -> DataConfig:
    """Organization ``index``'s data table, parsed as its client parses it (--data's values typed once, here)."""
    given = {**opts.data, "dataset": opts.dataset, "partition": partition, "alpha": opts.alpha,
             "num_clients": clients, "client_index": index, "seed": opts.seed, "public_fraction": opts.public_fraction,
             "test_split": opts.test_split, "train_on_public": opts.train_on_public}
    try:
        return from_mapping(DataConfig, given, "data")
    except ConfigError as exc:
        # A range check names its field itself (data.alpha must ...): its message, without the table's name.
        raise ConfigError(str(exc.__cause__ or exc)) from None


def plan(opts: LocalRunOptions) -> LocalPlan:
    """Resolve every default and validate the whole federation; raises ConfigError with one clear line."""
    privacy, specs = _checked_options(opts)
    entry = DATASETS[opts.dataset]
    catalog.check_dataset_available(opts.dataset)
    own = dataset_defaults(opts.dataset)
    partition = _partition_of(opts, specs, own)
    clients = opts.clients if opts.clients is not None else PARTITIONS[partition].clients or DEFAULT_CLIENTS
    data = tuple(_data_config(opts, partition, clients, index) for index in range(clients))
    own_data = None if entry.builtin else catalog.check_own_data(data)
    runs = tuple(_run_plan(opts, spec, own, partition, data, own_data, privacy) for spec in specs)
    return LocalPlan(opts, partition, runs, entry.picture, clients, data,
                     {name: getattr(privacy, name) for name in opts.privacy})


def _checked_options(opts: LocalRunOptions) -> tuple[PrivacyConfig, list[AlgorithmSpec]]:
    """The options' own mistakes, each one line: the [privacy] table parsed, and the named algorithms' specs."""
    if opts.clients is not None and opts.clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {opts.clients}")
    privacy = _privacy_config(opts.privacy)
    known = {f.name for f in dataclasses.fields(DataConfig)}
    for name in opts.data:
        if name in DATA_OPTIONS:
            raise ConfigError(f"--data {name}: {DATA_OPTIONS[name]}")
        if name not in known:
            import difflib

            close = difflib.get_close_matches(name, sorted(known - set(DATA_OPTIONS)), n=1)
            raise ConfigError(f"--data: unknown data field {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                              + f"; data fields: {', '.join(sorted(known - set(DATA_OPTIONS)))}")
    if not opts.algorithms:
        raise ConfigError("--algorithm names no algorithm")
    if len(set(opts.algorithms)) != len(opts.algorithms):
        raise ConfigError(f"--algorithm names an algorithm twice: {','.join(opts.algorithms)}")
    specs = []
    for name in opts.algorithms:
        try:
            specs.append(get_spec(name))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    for name in opts.extra_algorithm_config:
        if name not in opts.algorithms:
            raise ConfigError(f"--set names algorithm {name!r}, which is not among {', '.join(opts.algorithms)}")
    if opts.dataset not in DATASETS:
        raise ConfigError(f"unknown dataset {opts.dataset!r}; hetfed run offers {', '.join(DATASETS)}")
    return privacy, specs


def _partition_of(opts: LocalRunOptions, specs: Sequence[AlgorithmSpec], own: LocalDefaults) -> str:
    """One partition for every run of the federation: the user's, else the one the algorithms need, else the
    dataset's."""
    entry = DATASETS[opts.dataset]
    partition = opts.partition
    if partition is None:
        wanted = {s.name: experiment(s).defaults_for(opts.dataset).partition for s in specs}
        if not entry.builtin:  # an organization's own data is split as it offers, whatever the algorithms' demos use
            wanted = {n: p for n, p in wanted.items() if p in entry.partitions}
        needs = {p for p in wanted.values() if p is not None}
        if len(needs) > 1:
            raise ConfigError(f"the algorithms need different partitions ({', '.join(sorted(needs))}): "
                              "choose one with --partition")
        partition = needs.pop() if needs else (own.partition or BASE.partition or "")
        if partition not in entry.partitions:
            who = ", ".join(n for n, p in wanted.items() if p == partition)
            raise ConfigError(f"{who} needs the {partition!r} partition, which dataset {opts.dataset!r} does not "
                              f"offer (it offers {', '.join(entry.partitions)})")
    if partition not in entry.partitions:
        raise ConfigError(f"dataset {opts.dataset!r} has no partition {partition!r}; it offers "
                          f"{', '.join(entry.partitions)}")
    return partition


def _models_of(opts: LocalRunOptions, spec: AlgorithmSpec, defaults: LocalDefaults) -> tuple[str, ...]:
    """The run's architectures (cycled over its organizations), checked against the algorithm and the data."""
    entry = DATASETS[opts.dataset]
    models = opts.models or defaults.models
    unknown = [m for m in models if m not in MODELS and not is_reference(m)]
    if unknown:
        raise ConfigError(f"unknown model {unknown[0]!r}; available: {', '.join(MODELS)}, or an own builder "
                          "'package.module:function'")
    if not spec.model_private and len(set(models)) > 1:
        private = ", ".join(s.name for s in SPECS.values() if s.model_private)
        raise ConfigError(f"{spec.name} averages one model, so its organizations need one architecture, got "
                          f"{', '.join(dict.fromkeys(models))}; organizations with different architectures "
                          f"federate with {private}")
    if entry.input_shape is not None:
        for m in [m for m in models if not is_reference(m)]:
            why = input_mismatch(m, entry.input_shape)
            if why is not None:
                whose = "" if opts.models else f"{spec.name}'s default on {opts.dataset!r}: "
                raise ConfigError(f"{whose}{why} (dataset {opts.dataset!r}); choose one with --model: "
                                  f"{', '.join(models_for(entry.input_shape))}")
    return tuple(models)


def _algorithm_config(opts: LocalRunOptions, spec: AlgorithmSpec, own: LocalDefaults, own_data: Any,
                      latent: int | None) -> TrainConfig:
    """The algorithm's config, parsed once: the data set's and the algorithm's entries, the command line's
    knobs and --set over the algorithm's declared defaults (what a file that leaves them out gets)."""
    entry = DATASETS[opts.dataset]
    fields = {f.name for f in dataclasses.fields(spec.config_type)}
    # The dataset's knobs, where the algorithm's config keeps the shared default (an algorithm declaring its
    # own default, in its config or its spec's presets, keeps it: stated once), then the algorithm's entry.
    own_defaults = _own_defaults(spec.config_type) | set(spec.presets)
    config: dict[str, Any] = {k: v for k, v in own.config.items() if k in fields - own_defaults}
    config.update({k: v for k, v in experiment(spec).defaults_for(opts.dataset).config.items() if k in fields})
    config.update({k: v for k, v in opts.train.items() if k in fields})
    config["wire_dtype"] = opts.wire_dtype
    # Algorithms with one label space and one latent space carry their widths in their config.
    shared = issubclass(spec.config_type, SharedSpaceConfig)
    if shared and entry.num_classes is not None:
        config["num_classes"] = entry.num_classes
    elif shared and own_data is not None:
        config["num_classes"] = own_data.num_classes
    if shared and latent is not None:
        config["latent_dim"] = latent
    config.update(opts.extra_algorithm_config.get(spec.name, {}))
    try:
        return spec.parse(config, f"{spec.name} config")
    except ConfigError as exc:
        raise ConfigError(f"--set: {exc}") from None


def _run_plan(opts: LocalRunOptions, spec: AlgorithmSpec, own: LocalDefaults, partition: str,
              data: tuple[DataConfig, ...], own_data: Any, privacy: PrivacyConfig) -> RunPlan:
    """One run of the federation, every default resolved and checked."""
    entry = DATASETS[opts.dataset]
    clients = len(data)
    d = experiment(spec).defaults_for(opts.dataset).over(own.over(BASE))
    if spec.needs_seed_set and not entry.partitions[partition].seed_set:
        offer = [p for p, e in entry.partitions.items() if e.seed_set]
        raise ConfigError(f"{spec.name} needs a seed set every organization holds; partition {partition!r} of "
                          f"{opts.dataset!r} has none" + (f" (use --partition {' or '.join(offer)})" if offer
                                                          else f", and no partition of {opts.dataset!r} has one"))
    models = _models_of(opts, spec, d)
    latent = opts.latent_dim if opts.latent_dim is not None else d.latent_dim
    typed = _algorithm_config(opts, spec, own, own_data, latent)
    if isinstance(typed, SharedSpaceConfig):
        latent = typed.latent_dim
    if privacy.enabled and spec.bounded_latent and not spec.latent_bounded(typed):
        # Its clipped releases take their bound from the sigmoid's [0, 1]^d_e: the client would refuse at setup.
        raise ConfigError(f"{spec.name} under [privacy] needs bounded latents: --set {spec.name}.bounded_latent=true")
    seed_set = None
    if spec.needs_seed_set:
        seed_set = from_mapping(SeedSetConfig, catalog.seed_set_summary(data[0], clients), "seed_set")
    # Unset everywhere: a run's own default (the aggregator's RunConfig).
    rounds = next(n for n in (opts.rounds, d.rounds, DEFAULT_ROUNDS) if n is not None)
    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {rounds}")
    if own_data is not None or any(is_reference(m) for m in models):
        catalog.check_models(opts.dataset, models, latent, spec.latent_bounded(typed), own_data)
    run_id = run_id_of(spec.name)
    # With scraping on, a run whose organizations share one architecture declares the bytes of its whole model,
    # the dashboards' whole-model baseline (heterogeneous organizations have no single whole model to compare with).
    reference = 0
    if opts.metrics_linger > 0 and len(set(models)) == 1:
        reference = catalog.model_bytes(data[0], models[0], latent)
    try:
        run = RunConfig(id=run_id, algorithm=spec.name, organizations=tuple(f"org-{i}" for i in range(clients)),
                        rounds=rounds, seed=opts.seed, algorithm_config=to_mapping(typed), seed_set=seed_set,
                        fedavg_model_bytes=reference,
                        # Every organization trains under differential privacy: the aggregator refuses an update
                        # that does not declare it. One whose budget is spent sends a leave notice and exits
                        # PRIVACY_BUDGET_SPENT; the aggregator stops waiting for it at once.
                        require_privacy=privacy.enabled)
    except ConfigError as exc:
        raise ConfigError(f"run {run_id}: {exc}") from None
    orgs = tuple(_client_of(opts, run_id, data[i], models[i % len(models)], latent, privacy,
                            bool(opts.artifacts or entry.picture or opts.output))
                 for i in range(clients))
    return RunPlan(run_id, spec, rounds, models, latent, typed, seed_set, run, orgs)


def _own_defaults(config_type: type[TrainConfig]) -> set[str]:
    """The training knobs (TrainConfig's fields) whose default ``config_type`` or a base under TrainConfig declares."""
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    return {name for cls in config_type.__mro__ if cls is not TrainConfig and issubclass(cls, TrainConfig)
            for name in inspect.get_annotations(cls) if name in shared}


def _privacy_config(fields: Mapping[str, Any]) -> PrivacyConfig:
    """The organizations' [privacy] table (``--set privacy.FIELD=VALUE``), parsed as a client parses it; a typo or
    a value out of its domain is one line. None given: differential privacy off."""
    cfg = from_mapping(PrivacyConfig, dict(fields), "--set privacy")
    if fields and not cfg.enabled:
        raise ConfigError("--set privacy: differential privacy needs privacy.epsilon_budget, privacy.target_epsilon "
                          f"or privacy.noise_multiplier (got only {', '.join(sorted(fields))})")
    return cfg


def _client_of(opts: LocalRunOptions, run_id: str, data: DataConfig, model: str, latent: int | None,
               privacy: PrivacyConfig, artifacts: bool) -> ClientConfig:
    """An organization's client config in run ``run_id``, but for the aggregator's address and its certificate."""
    organization = f"org-{data.client_index}"
    # Secure mode draws its noise from a fresh key, never a seed, so a local run does not fix one for it.
    if privacy.enabled and not privacy.secure_mode and "noise_seed" not in opts.privacy:
        privacy = dataclasses.replace(privacy, noise_seed=noise_seed(opts.seed, data.client_index))
    # With --output the privacy ledgers are kept in it; a run in a temporary directory loses them with it anyway,
    # so its ledgers are declared ephemeral instead (_run_in says so).
    state_dir = None
    if privacy.enabled and opts.output:
        state_dir = client_state_dir(organization)
    elif privacy.enabled:
        privacy = dataclasses.replace(privacy, ephemeral_ledger=True)
    return ClientConfig(
        organization=organization, run=run_id, threads=CLIENT_THREADS, data=data,
        model=ModelConfig(**{("builder" if is_reference(model) else "name"): model}, latent_dim=latent or 0),
        retry=RetryConfig(give_up_after_seconds=CLIENT_GIVE_UP_SECONDS),
        # With --output each organization's snapshots and its exported model (model/) are kept there.
        output_dir=artifacts_dir(run_id, organization) if artifacts else None,
        report_timing=opts.timing, privacy=privacy, state_dir=state_dir)


def client_state_dir(organization: str) -> str:
    """Where a local run's client keeps its state (its privacy ledger), relative to the run's work directory."""
    return str(Path(CLIENT_STATE) / organization)


def noise_seed(seed: int, index: int) -> int:
    """The DP noise seed of organization ``index`` in a local run with ``--seed seed``, when the user gave none.

    Local runs are experiments, repeated to compare settings: the noise (and the Poisson sampling) is seeded from
    the run's seed and the organization, so the same command gives the same result. A deployment leaves
    privacy.noise_seed at -1 (fresh OS entropy), since whoever knows the seed can subtract the noise.
    """
    digest = hashlib.sha256(f"hetfed-privacy-noise:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


# ------------------------------------------------------------------------------------------------ processes
def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


# Every federation this process has started and not yet stopped: a SIGTERM to `hetfed run` or `hetfed bench`
# stops them all (``stop_all``), so no aggregator or client process outlives its orchestrator.
_LIVE: weakref.WeakSet[LocalFederation] = weakref.WeakSet()
_STOPPING = threading.Event()


def stop_all() -> None:
    """Stop every federation this process started that is still running, and refuse new ones (the CLI's
    SIGTERM handler)."""
    _STOPPING.set()
    for fed in list(_LIVE):
        fed.stop()


class FederationFailedError(RuntimeError):
    """A process of a local federation exited with an error while its run was in progress. The message names
    the process and ends with the last lines of its log; ``hetfed run`` and ``hetfed bench`` print it as their
    error, without a traceback of their own."""


class LocalFederation:
    """Starts, watches and stops an aggregator process and its client processes.

    Client processes are forked from a fork server (``hetfed.cli.forkserver``) that imported torch and the
    client runtime once, when ``fork_clients`` (the default where the OS can fork); each one then runs the
    same ``hetfed client --config FILE`` a deployment runs. ``warm`` lists data configs whose data sets the
    fork server loads once for all its children.
    """

    def __init__(self, workdir: Path, tls: TlsConfig | None = None, fork_clients: bool = True,
                 warm: Sequence[Mapping[str, Any]] = ()) -> None:
        self.workdir = workdir
        # The orchestrator's client certificate when the aggregator requires mTLS.
        self.tls = tls
        self.env = _subprocess_env()
        self.aggregator: subprocess.Popen[bytes] | None = None
        self.clients: dict[str, subprocess.Popen[bytes] | ForkedProcess] = {}
        self.port = 0
        self.metrics_port = -1
        self._forks: ForkServer | None = None
        if _STOPPING.is_set():
            raise RuntimeError("this process is stopping (SIGTERM): no new federation is started")
        _LIVE.add(self)
        if fork_clients and hasattr(os, "fork"):
            # Started first, so its imports overlap with the aggregator's start.
            self._forks = ForkServer(self.env, workdir / "forkserver.log", warm)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child process
        return subprocess.Popen([sys.executable, "-m", "hetfed.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.workdir)

    def start_aggregator(self, config: dict[str, Any], timeout: float = 60.0) -> None:
        """Write the config, start the aggregator and wait until it reports its port."""
        path = self.workdir / "aggregator.json"
        path.write_text(json.dumps(config, indent=2))
        ready = self.workdir / "aggregator.ready"
        ready.unlink(missing_ok=True)
        self.aggregator = self._spawn("aggregator", ["aggregator", "--config", str(path), "--ready-file", str(ready)])
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.aggregator.poll() is not None:
                raise FederationFailedError(f"the aggregator exited with {self.aggregator.returncode}:\n"
                                            f"{self.log_tail('aggregator')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the aggregator did not start within {timeout}s")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.metrics_port = int(info["port"]), int(info["metrics_port"])

    def start_client(self, name: str, config: dict[str, Any]) -> None:
        """Write a client config and start that organization's process (forked when a fork server runs)."""
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(config, indent=2))
        argv = ["client", "--config", str(path)]
        if self._forks is not None:
            self.clients[name] = self._forks.spawn(name, argv, self.workdir / f"{name}.log", self.workdir, self.env)
        else:
            self.clients[name] = self._spawn(name, argv)

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of a process's log."""
        p = self.workdir / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""

    def failed_client(self) -> str | None:
        """The name of a client process that exited with an error, if any (leaving a run because its privacy
        budget is spent is no error)."""
        for name, proc in self.clients.items():
            if proc.poll() not in (None, 0, PRIVACY_BUDGET_SPENT):
                return name
        return None

    def left_clients(self) -> list[str]:
        """The client processes that left their run because their organization's privacy budget is spent."""
        return [name for name, proc in self.clients.items() if proc.poll() == PRIVACY_BUDGET_SPENT]

    def exited(self, name: str) -> bool:
        """Whether a client process has exited."""
        return self.clients[name].poll() is not None

    def raise_if_failed(self) -> None:
        """Raise with the log's tail if a client failed or the aggregator exited while a run is in progress."""
        bad = self.failed_client()
        if bad:
            raise FederationFailedError(f"{bad} failed:\n{self.log_tail(bad)}")
        if self.aggregator is not None and self.aggregator.poll() is not None:
            raise FederationFailedError(f"the aggregator exited:\n{self.log_tail('aggregator')}")

    def status(self, timeout: float = 10.0) -> list[RunStatus]:
        """The aggregator's Status of every run."""
        return status_of(f"{LOOPBACK}:{self.port}", self.tls, timeout=timeout)

    def wait_clients(self, timeout: float) -> None:
        """Wait for every client process to exit."""
        deadline = time.monotonic() + timeout
        for proc in self.clients.values():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def stop(self) -> None:
        """Terminate everything still running (gracefully, then by force), then the fork server."""
        _LIVE.discard(self)
        procs = [*self.clients.values(), *([self.aggregator] if self.aggregator else [])]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._forks is not None:
            self._forks.close()
            self._forks = None


# ------------------------------------------------------------------------------------------------ configs
def aggregator_settings(opts: LocalRunOptions | LocalPlan, state_dir: str,
                        tls: TlsConfig | None = None) -> AggregatorConfig:
    """The aggregator config of a local federation: the plan's runs, served on loopback (``tls``: its certificate,
    under mTLS, where the orchestrator reads every run's Status)."""
    p = opts if isinstance(opts, LocalPlan) else plan(opts)
    server = ServerConfig(listen=f"{LOOPBACK}:0", metrics_port=0, metrics_host=LOOPBACK, state_dir=state_dir, tls=tls,
                          operators=(OPERATOR_ORGANIZATION,) if tls is not None else ())
    return AggregatorConfig(runs=tuple(r.run for r in p.runs), server=server)


def aggregator_config(opts: LocalRunOptions | LocalPlan, state_dir: str, tls: TlsConfig | None = None) -> dict[str, Any]:
    """The aggregator's file of a local federation (``aggregator_settings``, less what its dataclasses default)."""
    return to_sparse_mapping(aggregator_settings(opts, state_dir, tls), ALWAYS_WRITTEN)


def artifacts_dir(run_id: str, organization: str) -> str:
    """Where a local run's client writes its snapshots, relative to the run's work directory."""
    return str(Path("artifacts") / run_id / organization)


def client_settings(opts: LocalRunOptions | LocalPlan, run_id: str, index: int, port: int,
                    tls: TlsConfig | None = None) -> ClientConfig:
    """The client config of organization ``index`` in run ``run_id``: the plan's, with the aggregator's port on
    loopback (``tls``: the organization's certificate, under mTLS)."""
    p = opts if isinstance(opts, LocalPlan) else plan(opts)
    r = next(r for r in p.runs if r.run_id == run_id)
    return dataclasses.replace(r.clients[index], aggregator=f"{LOOPBACK}:{port}", tls=tls)


def client_file(cfg: ClientConfig) -> dict[str, Any]:
    """A client config as its file carries it: what its dataclasses do not default, and ``ALWAYS_WRITTEN``."""
    return to_sparse_mapping(cfg, (*ALWAYS_WRITTEN, *(("privacy.noise_seed",) if cfg.privacy.enabled else ())))


def client_config(opts: LocalRunOptions | LocalPlan, run_id: str, index: int, port: int,
                  tls: TlsConfig | None = None) -> dict[str, Any]:
    """The file of organization ``index`` in run ``run_id`` (``client_settings``, as ``client_file`` writes it)."""
    return client_file(client_settings(opts, run_id, index, port, tls))


# ------------------------------------------------------------------------------------------------ results
# What a client under differential privacy adds to each round's reported figures -> the privacy summary's key.
PRIVACY_FIGURES = {"privacy_epsilon": "epsilon", "privacy_delta": "delta", "privacy_noise_multiplier": "noise_multiplier",
                   "privacy_clip_norm": "clip_norm"}


def privacy_summary(rounds: Sequence[Mapping[str, Any]], left: Sequence[str] = ()) -> dict[str, Any]:
    """A run's differential privacy: per organization its last reported ε, δ, σ and C, the largest ε of any
    organization (None without DP), and the organizations that left because their budget was spent."""
    orgs: dict[str, dict[str, float]] = {}
    for r in rounds:
        for org, m in r["per_organization"].items():
            if "privacy_epsilon" in m:
                orgs[org] = {key: float(m[source]) for source, key in PRIVACY_FIGURES.items() if source in m}
    return {
        "organizations": dict(sorted(orgs.items())),
        "epsilon_max": max((o["epsilon"] for o in orgs.values()), default=None),
        "budget_spent": sorted(left),
    }


def _weighted(reports: Mapping[str, EvalMetrics], figure: str, weight: str) -> float | str | None:
    """``figure`` averaged over the organizations that reported it, weighted by ``weight``; WITHHELD when every
    organization that reported withheld it; None without reports or weights."""
    shown = [m for m in reports.values() if m.figure(figure) is not None and m.figure(weight) is not None]
    n = sum(getattr(m, weight) for m in shown)
    if n:
        return sum(getattr(m, figure) * getattr(m, weight) for m in shown) / n
    return WITHHELD if reports and all(m.is_withheld(figure) for m in reports.values()) else None


def _shown(m: EvalMetrics) -> dict[str, Any]:
    """One organization's figures for results.json: a withheld one as WITHHELD."""
    fixed = {name: m.figure(name) for name in ("test_accuracy", "test_loss", "train_loss", "num_test_examples")}
    out: dict[str, Any] = {k: WITHHELD if v is None else (int(v) if k == "num_test_examples" else v)
                           for k, v in fixed.items()}
    return {**out, **dict(m.extra), **{name: WITHHELD for name in m.withheld if name not in out}}


def mean_over(orgs: Mapping[str, Mapping[str, Any]], key: str) -> float | str | None:
    """The mean of ``key`` over the organizations that show a number for it: WITHHELD when every organization
    withheld it, None when one lacks it."""
    if not orgs or any(key not in m for m in orgs.values()):
        return None
    values = [m[key] for m in orgs.values() if m[key] != WITHHELD]
    return sum(values) / len(values) if values else WITHHELD


def summarize_run(status: RunStatus, left: Sequence[str] = ()) -> dict[str, Any]:
    """Per-round results of a finished run and its final figures, as JSON-ready dicts (``left``: organizations
    that left it because their privacy budget was spent). A figure an organization withheld shows as
    ``"withheld"``; means leave those organizations out and name them (``withheld_by``)."""
    spec = get_spec(status.algorithm)
    rounds: list[dict[str, Any]] = []
    for rec in status.history:
        reports = rec.reports
        gaccs = [m.extra["global_test_accuracy"] for m in reports.values() if "global_test_accuracy" in m.extra]
        gwithheld = bool(reports) and all(m.is_withheld("global_test_accuracy") for m in reports.values())
        rounds.append({
            "round": rec.round,
            "clients": rec.clients,
            "duration_seconds": rec.duration_seconds,
            "test_accuracy": _weighted(reports, "test_accuracy", "num_test_examples"),
            "global_test_accuracy": sum(gaccs) / len(gaccs) if gaccs else (WITHHELD if gwithheld else None),
            "train_loss": _weighted(reports, "train_loss", "num_train_examples"),
            # Organizations whose accuracy the means leave out: they withheld it (docs/privacy.md).
            "withheld_by": sorted(org for org, m in reports.items() if m.is_withheld("test_accuracy")),
            "bytes_up": rec.bytes(Direction.UP),
            "bytes_down": rec.bytes(Direction.DOWN),
            "per_organization": {org: _shown(m) for org, m in sorted(reports.items())},
        })
    # The last round anyone reported: a run every organization left (their privacy budgets spent) ends on a round
    # nobody pushed.
    final = next((r for r in reversed(rounds) if r["per_organization"]), rounds[-1] if rounds else {})
    orgs = final.get("per_organization", {})
    train_rounds = [r for r in rounds if r["round"] >= 1][: status.total_rounds]
    total_up = sum(sum(r["bytes_up"].values()) for r in rounds)
    total_down = sum(sum(r["bytes_down"].values()) for r in rounds)
    figures = {f.key: mean_over(orgs, f.source) for f in spec.figures}
    return {
        "run": status.run_id,
        "algorithm": status.algorithm,
        "rounds": rounds,
        "final_test_accuracy": final.get("test_accuracy"),
        "final_global_test_accuracy": final.get("global_test_accuracy"),
        "final_withheld_by": final.get("withheld_by", []),
        # The algorithm's own figures (its spec's), means over organizations in the final report (over those
        # that did not withhold it).
        "final_figures": {k: v for k, v in figures.items() if v is not None},
        "figure_labels": {f.key: experiment(spec).label(f.key) for f in spec.figures},
        "bytes_up_total": total_up,
        "bytes_down_total": total_down,
        "bytes_per_train_round": (
            sum(sum(r["bytes_up"].values()) + sum(r["bytes_down"].values()) for r in train_rounds)
            / max(1, len(train_rounds))
        ),
        "privacy": privacy_summary(rounds, left),
    }


# An organization under [privacy] without an own record (its client had no output_dir): no own figures.
NO_OWN_RECORD = "no own record"


def own_final(summary: Mapping[str, Any], clients: Sequence[ClientConfig], workdir: Path) -> dict[str, Any]:
    """What a run's summary gains from the organizations' own records: ``own_final_test_accuracy``, the final
    test accuracy weighted by test examples, and under [privacy] ``own_final``, each organization's own final
    figures. A local run owns every organization, so it reads their records on this machine; the aggregator saw
    those figures withheld. Without [privacy] the uploads carried the exact figures: ``final_test_accuracy``."""
    if not any(c.privacy.enabled for c in clients):
        return {"own_final_test_accuracy": summary.get("final_test_accuracy")}
    reported = [r for r in summary.get("rounds", []) if r["per_organization"]]
    if not reported:
        return {"own_final_test_accuracy": None, "own_final": {}}
    final = reported[-1]
    dirs = {c.organization: c.output_dir for c in clients}
    figures: dict[str, Any] = {}
    for org in sorted(final["per_organization"]):
        # Clients run with the work directory as their current directory: a relative output_dir is under it.
        folder = dirs.get(org)
        record = read_own_record(workdir / folder / OWN_FIGURES) if folder else None
        entry = entry_at(record, final["round"]) if record is not None else None
        figures[org] = NO_OWN_RECORD if entry is None else entry
    entries = [e for e in figures.values() if e != NO_OWN_RECORD]
    n = sum(e["num_test_examples"] for e in entries)
    mean = sum(e["test_accuracy"] * e["num_test_examples"] for e in entries) / n if n else None
    return {"own_final_test_accuracy": None if len(entries) < len(figures) else mean, "own_final": figures}


def _pct(v: float | str | None) -> str:
    if v == WITHHELD:
        return WITHHELD
    return f"{100 * v:.2f}%" if isinstance(v, int | float) else "-"


TABLE_HEAD = ("algorithm", "own-test acc", "global-test acc", "bytes up", "bytes down", "bytes/round", "time",
              "ε", "figures")


def epsilon_cell(privacy: Mapping[str, Any] | None) -> str:
    """The table's ε: the largest any organization spent, and who left because its budget was spent; — without DP."""
    if not privacy:
        return "—"
    eps = privacy.get("epsilon_max")
    left = privacy.get("budget_spent") or []
    text = f"{eps:.2f}" if eps is not None else "—"
    return text + (f" ({', '.join(left)} left: budget spent)" if left else "")


def table_rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The final table's rows: accuracy, bytes and the algorithm's own figures per run."""
    rows: list[tuple[str, ...]] = []
    for r in results:
        figures = "  ".join(f"{r['figure_labels'][k]} {_pct(v)}" for k, v in r["final_figures"].items())
        own = _pct(r["final_test_accuracy"])
        withheld_by = r.get("final_withheld_by") or []
        if withheld_by and r["final_test_accuracy"] != WITHHELD:  # a mean that leaves organizations out says so
            own += f" ({len(withheld_by)} withheld)"
        rows.append((
            r["algorithm"], own, _pct(r["final_global_test_accuracy"]),
            fmt_bytes(r["bytes_up_total"]), fmt_bytes(r["bytes_down_total"]), fmt_bytes(r["bytes_per_train_round"]),
            f"{r.get('wall_seconds', 0):.0f}s", epsilon_cell(r.get("privacy")), figures or "-",
        ))
    return rows


# ------------------------------------------------------------------------------------------------ scraping
# ``--metrics-linger SECONDS``: every client serves /metrics on a loopback port, the run directory gets
# ``prometheus-targets.json`` (Prometheus ``file_sd_configs`` format), runs whose organizations share one
# architecture declare ``fedavg_model_bytes``, and every process keeps serving its final counts for SECONDS.
TARGETS_FILE = "prometheus-targets.json"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def write_targets(workdir: Path, aggregator_metrics_port: int, clients: dict[str, int]) -> Path:
    """Write the file_sd targets of a local federation atomically (``clients``: process name -> port)."""
    groups: list[dict[str, Any]] = [
        {"targets": [f"{LOOPBACK}:{aggregator_metrics_port}"], "labels": {"hetfed_component": "aggregator"}}
    ]
    groups += [{"targets": [f"{LOOPBACK}:{port}"], "labels": {"hetfed_component": "client", "hetfed_process": name}}
               for name, port in sorted(clients.items())]
    path = workdir / TARGETS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=1))
    tmp.replace(path)
    return path


def client_metrics(opts: LocalRunOptions, workdir: Path, aggregator_metrics_port: int,
                   names: list[str]) -> dict[str, dict[str, Any]]:
    """Per client process: the config fields that serve its metrics; also writes the targets file.

    Empty unless ``opts.metrics_linger`` > 0.
    """
    if opts.metrics_linger <= 0:
        return {}
    ports = {name: free_port() for name in names}
    write_targets(workdir, aggregator_metrics_port, ports)
    return {name: {"metrics_port": port, "metrics_host": LOOPBACK, "metrics_linger_seconds": opts.metrics_linger}
            for name, port in ports.items()}


# ------------------------------------------------------------------------------------------------ running
def settled_status(fed: LocalFederation, status: list[RunStatus], by_run: Mapping[str, Sequence[str]],
                   timeout: float = 30.0, poll: float = 0.1) -> list[RunStatus]:
    """The Status of every run once it is over, read again after the clients exited.

    The federation loop also ends once every client has exited, and a Status read just before the last round
    closed lacks that round's reports (seen at 1,400 rounds, where every final figure came back empty). The
    aggregator still serves: read it until each run is finished or all its organizations left it (privacy
    budgets spent), at most ``timeout`` seconds; then the last read stands.
    """
    def over(runs: list[RunStatus]) -> bool:
        gone = set(fed.left_clients())
        return all(s.finished or all(n in gone for n in by_run.get(s.run_id, ())) for s in runs)

    deadline = time.monotonic() + timeout
    while not over(status) and time.monotonic() < deadline:
        fed.raise_if_failed()
        status = fed.status()
        if not over(status):
            time.sleep(poll)
    return status


def federate(opts: LocalRunOptions | LocalPlan, workdir: Path,
             on_status: Callable[[LocalFederation, list[RunStatus]], None] | None = None) -> list[dict[str, Any]]:
    """Run every algorithm of ``opts`` on one local aggregator; returns each run's summary.

    ``on_status`` sees the federation and each Status it polls (benchmarks measure the processes with it).
    """
    from hetfed.cli.progress import Progress

    p = opts if isinstance(opts, LocalPlan) else plan(opts)
    o = p.opts
    certs = _make_certs(p.clients, workdir) if o.tls else None
    fed = LocalFederation(workdir, certs.client_tls(OPERATOR_ORGANIZATION) if certs else None,
                          warm=[to_sparse_mapping(p.data[0])])
    started = time.monotonic()
    state = workdir / "state"
    if state.exists():  # a local run is one-shot: an earlier run's state in the same directory is not resumed
        for run_dir in sorted(p for p in state.iterdir() if p.is_dir()):
            if (holder := holder_of(run_dir)) is not None:
                raise ConfigError(f"{run_dir} is in use by an aggregator still running ({holder}): stop it, or "
                                  "give this run another --output")
        shutil.rmtree(state)
    if (workdir / CLIENT_STATE).exists():  # nor are its clients' ledgers: ε of this run starts at zero
        shutil.rmtree(workdir / CLIENT_STATE)
    try:
        fed.start_aggregator(aggregator_config(p, str(state), certs.aggregator_tls() if certs else None))
        names = {(r.run_id, i): f"client-{r.run_id}-org-{i}" for r in p.runs for i in range(p.clients)}
        scrape = client_metrics(o, workdir, fed.metrics_port, list(names.values()))
        for (run_id, i), name in names.items():
            client_tls = certs.client_tls(f"org-{i}") if certs else None
            cfg = dataclasses.replace(client_settings(p, run_id, i, fed.port, client_tls), **scrape.get(name, {}))
            fed.start_client(name, client_file(cfg))
        by_run = {run_id: [name for (r, _), name in names.items() if r == run_id] for run_id in {r for r, _ in names}}
        # Organizations that left a run because their privacy budget was spent (their client exited
        # PRIVACY_BUDGET_SPENT): reported once each; the run goes on for the others under its quorum rules.
        left: dict[str, list[str]] = {run_id: [] for run_id in by_run}

        def departures(progress: Progress) -> None:
            gone = set(fed.left_clients())
            for (run_id, i), name in names.items():
                if name in gone and f"org-{i}" not in left[run_id]:
                    left[run_id].append(f"org-{i}")
                    progress.note(f"org-{i} left run {run_id}: its privacy budget is spent")

        with Progress(quiet=o.quiet) as progress:
            while True:
                fed.raise_if_failed()
                departures(progress)
                status = fed.status()
                if on_status is not None:
                    on_status(fed, status)
                progress.update(status)
                # A run is over when it finished, or when every one of its organizations left it (nobody is
                # left to push the round it waits for).
                if all(s.finished or all(fed.exited(n) for n in by_run[s.run_id]) for s in status):
                    break
                if time.monotonic() - started > o.timeout:
                    raise TimeoutError(f"the federation did not finish within {o.timeout}s")
                # Status carries every round's history: poll long runs (thousands of rounds) less often.
                time.sleep(0.25 if max(s.round for s in status) < 200 else 1.0)
        fed.wait_clients(timeout=60)
        departures(progress)  # those that left after the loop's last look
        status = settled_status(fed, status, by_run)
        wall = time.monotonic() - started
        results = []
        for s in status:
            summary = summarize_run(s, left.get(s.run_id, []))
            clients = next((r.clients for r in p.runs if r.run_id == s.run_id), ())
            summary.update(own_final(summary, clients, workdir))
            summary["wall_seconds"] = wall
            results.append(summary)
        return results
    finally:
        fed.stop()


def _make_certs(clients: int, workdir: Path) -> FederationCerts:
    """A fresh CA and certificates for this local federation (and the orchestrator) in ``workdir/certs``."""
    from hetfed.cli.certs import make_federation_certs

    orgs = [f"org-{i}" for i in range(clients)]
    # Absolute paths: the processes run with the work directory as their current directory.
    return make_federation_certs((workdir / "certs").resolve(), [*orgs, OPERATOR_ORGANIZATION], force=True)


def output_dir(path: str) -> Path:
    """``--output PATH`` as an absolute, writable directory (made when missing); ConfigError in one line when it
    cannot be, so a mistake surfaces before any process starts rather than as a traceback."""
    # Absolute: the processes it starts run inside it and are handed paths in it.
    workdir = Path(path).resolve()
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--output {path}: exists and is not a directory")
    blocker = next((a for a in workdir.parents if a.exists()), None)
    if not workdir.exists() and blocker is not None and not blocker.is_dir():
        raise ConfigError(f"--output {path}: cannot create the directory: {blocker} is a file")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output {path}: cannot create the directory: {exc.strerror or exc}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {path}: the directory is not writable")
    return workdir


def run_local(opts: LocalRunOptions) -> int:
    """The ``hetfed run`` command: validate, federate, print the table, write results.json when asked."""
    p = plan(opts)  # every user error surfaces here, before any process starts
    if opts.output:
        return _run_in(p, output_dir(opts.output))
    with tempfile.TemporaryDirectory(prefix="hetfed-run-") as tmp:
        return _run_in(p, Path(tmp))


def _run_in(p: LocalPlan, workdir: Path) -> int:
    from hetfed.cli.progress import print_table, say

    o = p.opts
    if not o.quiet:
        detail = "".join(f", {k}={getattr(p.data[0], k)}" for k in PARTITIONS[p.partition].parameters)
        rounds = ", ".join(f"{r.spec.name} {r.rounds}" for r in p.runs)
        say(f"hetfed run: {', '.join(o.algorithms)} with {p.clients} organizations on {o.dataset} "
            f"({p.partition}{detail}), rounds: {rounds}, seed {o.seed}")
    if p.privacy and not o.output:
        say("hetfed run: privacy ledgers are ephemeral (privacy.ephemeral_ledger): they end with this temporary "
            "run; give --output to keep them")
    results = federate(p, workdir)
    print_table(TABLE_HEAD, table_rows(results))
    if p.picture:
        for r in results:
            png = catalog.draw_picture(p.picture, workdir, r["run"], Path(o.output or "."))
            if png is not None:
                say(f"{r['algorithm']}: {png}")
    if o.output:
        out = {"options": to_mapping(dataclasses.replace(o, clients=p.clients)), "runs": results}
        (workdir / "results.json").write_text(json.dumps(out, indent=2, default=list))
        say(f"per-round results: {workdir / 'results.json'}")
        if o.report:
            private = any((r.get("privacy") or {}).get("epsilon_max") is not None for r in results)
            say(f"accuracy against bytes{' and ε' if private else ''}: "
                f"{write_report([workdir / 'results.json'], workdir)}")
    return 0
