"""``hetfed run``'s plan: every default resolved and every choice validated before any process starts.

This module knows no algorithm and no dataset: what each needs comes from the registries
(``hetfed.wire.specs``, and the datasets, partitions and models of the client package's
``hetfed.client.catalog``) and the experiment side (``hetfed.cli.experiments``: defaults and labels by name).
Client code runs here only through the catalog: the client package's own checks of a plan.

Defaults are layered, the later winning: the command's own (``BASE``: models only; rounds: a run's, the
aggregator's ``DEFAULT_ROUNDS``), the dataset's, the algorithm's (for every dataset, then for this dataset), and
finally what the user gave on the command line. The training knobs have no default here: what no layer sets is
the algorithm's declared config (its dataclass defaults and its spec's presets), the very values a hand-written
aggregator file and the chart get. A knob the algorithm declares itself (a paper's schedule) keeps it under the
dataset's layer: each default is stated once.

Each setting is parsed once, here, into the typed configs themselves: one ``RunConfig`` per run (the
aggregator's) and one ``ClientConfig`` per organization of each run (``files`` writes them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetfed.aggregator.config import DEFAULT_ROUNDS, RunConfig, SeedSetConfig
from hetfed.cli import RUN_TIMEOUT_SECONDS
from hetfed.cli.experiments import DEFAULT_COMPARISON, LocalDefaults, dataset_defaults, experiment
from hetfed.client import catalog
from hetfed.client.catalog import (
    DATASETS,
    DEFAULT_DATASET,
    MODELS,
    PARTITIONS,
    ClientConfig,
    DataConfig,
    ModelConfig,
    PrivacyConfig,
    RetryConfig,
    input_mismatch,
    is_reference,
    models_for,
)
from hetfed.wire.config import ConfigError, from_mapping, to_mapping
from hetfed.wire.specs import SPECS, AlgorithmSpec, get_spec
from hetfed.wire.specs.base import SharedSpaceConfig, TrainConfig

# The command's own defaults, under every dataset's and algorithm's. No training knob: those are the algorithm's
# declared config (hetfed.wire.specs), which an aggregator file or the chart that leaves them out gets too.
BASE = LocalDefaults(models=("lenet",))

# Training knobs the command line sets for every run (--local-epochs, --lr, --momentum, --batch-size).
TRAIN_KNOBS = ("local_epochs", "lr", "momentum", "batch_size")

# Organizations when neither the user nor the partition says: the data's own default split.
DEFAULT_CLIENTS = DataConfig.num_clients

# A local client's own settings (a single thread each, giving up soon on an aggregator that went away).
CLIENT_THREADS = 1
CLIENT_GIVE_UP_SECONDS = 120.0

# The clients' state directories (under DP, their privacy ledgers) in a run's work directory, one per organization.
CLIENT_STATE = "client-state"

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
    # Sum the uploads under secure aggregation (docs/security.md); refused for an algorithm that cannot.
    secure_aggregation: bool = False
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
    # The algorithm's config, parsed once here (the command line's values included); ``run`` holds this object,
    # and the aggregator's file carries its mapping, which the aggregator reads back through the same dataclass.
    train: TrainConfig
    seed_set: SeedSetConfig | None
    # The aggregator's run, as its file carries it.
    run: RunConfig
    # Each organization's client config, as its file carries it but for the aggregator's address and the
    # organization's certificate (known once the aggregator listens, and the certificates exist: ``client_settings``).
    clients: tuple[ClientConfig, ...]

    @property
    def config(self) -> dict[str, Any]:
        """The algorithm's config as a mapping (every field, typed values)."""
        return dict(to_mapping(self.run.algorithm_config))


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
    if not spec.mixed_architectures and len(set(models)) > 1:
        private = ", ".join(s.name for s in SPECS.values() if s.mixed_architectures)
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
                        rounds=rounds, seed=opts.seed, algorithm_config=typed, seed_set=seed_set,
                        fedavg_model_bytes=reference,
                        # Every organization trains under differential privacy: the aggregator refuses an update
                        # that does not declare it. One whose budget is spent sends a leave notice and exits
                        # PRIVACY_BUDGET_SPENT; the aggregator stops waiting for it at once.
                        require_privacy=privacy.enabled, secure_aggregation=opts.secure_aggregation)
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


def artifacts_dir(run_id: str, organization: str) -> str:
    """Where a local run's client writes its snapshots, relative to the run's work directory."""
    return str(Path("artifacts") / run_id / organization)
