"""Aggregator configuration: the server section and the runs it hosts (TOML or JSON, validated on load)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo, SeedSetInfo
from hetfed.wire.config import ConfigError, check, dependent, from_mapping, load_file
from hetfed.wire.specs import AlgorithmSpec, TrainConfig, get_spec

if TYPE_CHECKING:
    from hetfed.wire.distributed import DistributedSum
from hetfed.wire.tls import TlsConfig
from hetfed.wire.windows import DEFAULT_WINDOW_BYTES

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Training rounds of a run that names none (``hetfed run`` too, unless a dataset or an algorithm sets its own).
DEFAULT_ROUNDS = 10


@dataclass(frozen=True)
class SeedSetConfig:
    """A data set every organization of a run must hold, named by id and SHA-256 (checked at Join).

    ``size`` and ``parts`` (organization -> [start, stop) of the examples it teaches on), when given, let the
    algorithm check every upload's indices against the seed set and the sender's own part.
    """

    id: str
    sha256: str
    size: int = 0
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(bool(self.id), "seed_set.id must not be empty")
        check(len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256),
              f"seed_set.sha256 must be 64 lowercase hex digits, got {self.sha256[:80]!r}")
        check(self.size >= 0, f"seed_set.size must be >= 0, got {self.size}")
        for org, r in self.parts.items():
            check(len(r) == 2 and 0 <= r[0] < r[1], f"seed_set.parts[{org}] must be [start, stop), got {list(r)}")
            check(not self.size or r[1] <= self.size,
                  f"seed_set.parts[{org}] = {list(r)} exceeds seed_set.size {self.size}")

    def info(self) -> SeedSetInfo:
        """What the algorithm's server half is told of the seed set."""
        return SeedSetInfo(self.id, self.size, dict(self.parts))


def _algorithm_config(value: Any, run: Mapping[str, Any], where: str) -> TrainConfig:
    """A run's ``algorithm_config`` table parsed by its algorithm's spec (presets first): once, on load."""
    return get_spec(run["algorithm"]).parse(value, where)


def _algorithm_defaults(run: Mapping[str, Any]) -> TrainConfig:
    """The config of a run whose table names none: its algorithm's defaults (presets included)."""
    return get_spec(run["algorithm"]).config()


@dataclass(frozen=True)
class RunConfig:
    """One federated run: its algorithm, participants, rounds, quorum and deadline."""

    id: str
    algorithm: str
    organizations: tuple[str, ...]
    rounds: int = DEFAULT_ROUNDS
    # Quorum to close a round at the deadline; 0 means every organization.
    min_clients: int = 0
    round_deadline_seconds: float = 600.0
    seed: int = 0
    # The algorithm's typed config, an instance of its spec's config type. A file's table is parsed by the spec
    # when the file is loaded, and what it leaves out takes the algorithm's defaults; in Python it is required.
    algorithm_config: TrainConfig = field(kw_only=True, metadata=dependent(_algorithm_config, _algorithm_defaults))
    seed_set: SeedSetConfig | None = None
    # Bytes of the float32 weights each organization would exchange under FedAvg with the same model; only the
    # dashboards' FedAvg comparison (hetfed_run_fedavg_reference_bytes_total) reads it. 0: not declared.
    fedavg_model_bytes: int = 0
    # Training examples one organization of this run may declare at Join, and claim in an update when it
    # declared none (also bounded by server.max_examples_per_organization). Example counts are aggregation
    # weights: this caps what one organization's claim can weigh against the others'.
    max_examples: int = 10_000_000
    # Aggregation weights: "claimed", the example count each update carries (within the declaration);
    # "declared", the count the organization declared at Join, whatever the update claims (one that declared
    # none is refused, invalid_value).
    example_weights: Literal["claimed", "declared"] = "claimed"
    # Reported figures in their domains: test accuracy in [0, 1], losses >= 0 (implausible_metric otherwise).
    check_metric_domains: bool = True
    # Differential privacy of every organization (docs/privacy.md): an update that declares none is refused
    # (privacy_required), and so is one declaring an ε below its organization's last accepted one (privacy_regressed,
    # checked whether or not this is set).
    require_privacy: bool = False
    # Refuse an update whose declaration says its organization's privacy ledger ends with its process
    # (privacy_ephemeral_ledger): a restart there would count ε from zero. hetfed run's temporary runs allow them.
    refuse_ephemeral_ledgers: bool = False
    # The largest ε an update may declare (privacy_epsilon_exceeded, and the organization stops); None: no limit.
    max_epsilon: float | None = None
    # Sum the uploads under secure aggregation (SecAgg+, docs/security.md): the aggregator learns only the sum of
    # the summed kinds (AlgorithmSpec.summed_upload). Refused for an algorithm that needs each organization's own.
    secure_aggregation: bool = False
    # The SecAgg+ neighbourhood graph's degree k (0: the complete graph, k = n - 1, the original SecAgg) and the
    # Shamir threshold t (0: floor(k/2) + 1; it must lie in (k/2, k]); docs/security.md gives their security
    # argument. A round with fewer members than the run's caps k at n - 1 (one less where n·k is odd) and t at k.
    secure_degree: int = 0
    secure_threshold: int = 0

    def _check_secure_graph(self) -> None:
        """``secure_degree`` and ``secure_threshold``: only under secure aggregation, and a graph SecAgg+ can use
        over the run's organizations (``hetfed.secagg``: 1 <= k <= n - 1 with n·k even, k/2 < t <= k)."""
        n, k, t = len(self.organizations), self.secure_degree, self.secure_threshold
        check(k >= 0 and t >= 0, f"secure_degree and secure_threshold must be >= 0 (0: the default), got {k}, {t}")
        check(self.secure_aggregation or not (k or t), "secure_degree and secure_threshold need secure_aggregation = true")
        if not self.secure_aggregation:
            return
        check(k <= n - 1, f"secure_degree {k} must be at most n - 1 = {n - 1} (the run's organizations)")
        check(not k or n * k % 2 == 0, f"secure_degree {k}: no {k}-regular graph on {n} organizations (n·k is odd)")
        degree = k or n - 1
        check(not t or degree / 2 < t <= degree,
              f"secure_threshold {t} must be in (k/2, k] = ({degree / 2:g}, {degree}] for secure_degree k = {degree}: "
              "a smaller t lets an aggregator that lies about dropouts ask for both shares of one organization")

    def __post_init__(self) -> None:
        check(bool(NAME_RE.match(self.id)), f"id {self.id!r} must match {NAME_RE.pattern}")
        check(self.max_examples >= 1, f"max_examples must be >= 1, got {self.max_examples}")
        check(len(self.organizations) >= 1, "organizations must name at least one organization")
        for org in self.organizations:
            check(bool(NAME_RE.match(org)), f"organization {org!r} must match {NAME_RE.pattern}")
        check(len(set(self.organizations)) == len(self.organizations), "organizations must be unique")
        check(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        check(
            0 <= self.min_clients <= len(self.organizations),
            f"min_clients must be in [0, {len(self.organizations)}], got {self.min_clients}",
        )
        check(self.round_deadline_seconds > 0, "round_deadline_seconds must be > 0")
        check(self.seed >= 0, "seed must be >= 0")
        check(self.fedavg_model_bytes >= 0, "fedavg_model_bytes must be >= 0")
        check(self.max_epsilon is None or (math.isfinite(self.max_epsilon) and self.max_epsilon > 0),
              f"max_epsilon must be a number > 0 (leave it out for no limit), got {self.max_epsilon!r}")
        spec = self.spec
        refusal = spec.secure_aggregation_refusal()
        check(not (self.secure_aggregation and refusal),
              f"secure_aggregation: {refusal}")
        self._check_secure_graph()
        check(type(self.algorithm_config) is spec.config_type,
              f"algorithm_config must be a {spec.config_type.__name__} (algorithm {self.algorithm!r}'s config), "
              f"got {type(self.algorithm_config).__name__}")
        self._check_distributed()
        if spec.needs_seed_set:
            check(self.seed_set is not None, f"algorithm {self.algorithm!r} needs the run's seed_set "
                                             "({id, sha256}, and size and parts to check uploads)")
        if self.seed_set is not None:
            unknown = sorted(set(self.seed_set.parts) - set(self.organizations))
            check(not unknown, f"seed_set.parts names organizations not in the run: {unknown}")
        if self.secure_aggregation:  # a config option under which the half needs each update (a median)
            half = make_server_half(spec, self.algorithm_config, self.run_info())
            why = half.secure_aggregation_refusal()
            check(not why, f"secure_aggregation: algorithm {self.algorithm!r} cannot run with "
                           f"secure_aggregation = true: {why}")

    def _check_distributed(self) -> None:
        """Distributed DP (``TrainConfig.distributed_sum``) runs under secure aggregation only, and its plan must
        exist for this run's organizations and rounds: refused in one line otherwise."""
        from hetfed.wire.errors import WireError

        try:
            planned = self.algorithm_config.distributed_sum(len(self.organizations), self.rounds)
        except WireError as exc:
            check(False, f"algorithm_config: {exc.message}")
        else:
            check(planned is None or self.secure_aggregation, "algorithm_config plans distributed DP (ddp_epsilon), "
                  "which needs secure_aggregation = true: without it the aggregator would see each organization's "
                  "share of the noise alone")
            n = len(self.organizations)
            check(planned is None or self.secure_degree in (0, n - 1),
                  f"algorithm_config plans distributed DP (ddp_epsilon), which assumes the complete graph: "
                  f"secure_degree {self.secure_degree} < n - 1 = {n - 1} lets colluding organizations cut the graph "
                  "and give the aggregator partial sums with fewer honest shares than the accountant counts")
            if self.secure_aggregation:
                self.__dict__["distributed_sum"] = planned

    @functools.cached_property
    def distributed_sum(self) -> DistributedSum | None:
        """The summed kind that goes through distributed DP in this run's secure rounds (None: none)."""
        return self.algorithm_config.distributed_sum(len(self.organizations), self.rounds) \
            if self.secure_aggregation else None

    @property
    def quorum(self) -> int:
        """Clients needed to close a round at its deadline."""
        return self.min_clients or len(self.organizations)

    @property
    def spec(self) -> AlgorithmSpec:
        """The algorithm's spec."""
        try:
            return get_spec(self.algorithm)
        except ValueError as exc:
            raise ConfigError(f"runs[{self.id}].algorithm: {exc}") from None

    def run_info(self) -> RunInfo:
        """What the run's server half is told besides its config."""
        return RunInfo(self.seed, self.organizations, self.seed_set.info() if self.seed_set else None)


@dataclass(frozen=True)
class ServerConfig:
    """Where the aggregator listens, where it keeps state and which limits it enforces."""

    listen: str = "0.0.0.0:50051"
    # Prometheus /metrics port; 0 picks a free port, -1 disables the endpoint.
    metrics_port: int = 9090
    metrics_host: str = "0.0.0.0"
    # A plaintext address serving only the gRPC health service (kubelet probes under mTLS); "" for none.
    health_listen: str = ""
    # The health listener answers NOT_SERVING once the loop serving the clients has not run for this long.
    health_stall_seconds: float = 10.0
    state_dir: str = "hetfed-state"
    max_update_bytes: int = 4 << 30
    max_tensor_elements: int = 1 << 31
    chunk_bytes: int = 1 << 20
    max_pull_wait_seconds: float = 30.0
    # Most RPCs per second one organization may make (0 = unlimited).
    max_requests_per_second: float = 0.0
    tls: TlsConfig | None = None
    # Certificate names (under mTLS) allowed to read every run's full Status; organizations see only their own.
    operators: tuple[str, ...] = ()
    # Threads for blocking work (disk writes, decoding, aggregation); waiting clients hold none.
    worker_threads: int = 4
    # Pushes one organization may have in flight, and the bytes their first chunks announce, together.
    max_pushes_per_organization: int = 2
    # Updates reassembled at once across all organizations (admission control: the aggregator's memory does
    # not grow with the federation); a push waits for a slot at most reassembly_wait_seconds, and a stream may
    # go without a chunk at most push_idle_seconds (so a stalled sender cannot keep a slot).
    max_concurrent_reassemblies: int = 4
    # The HTTP/2 receive window of each stream. A push the aggregator does not read yet (one waiting for
    # admission) gets about two windows into its buffers before flow control stops it. A push moves about half
    # a window per round trip: 4 MiB moves a 1 Gbit/s link at 20 ms at its rate, 16 MiB one at 100 ms
    # (benchmarks/window_throughput.py); 64 KiB moved one 1 MiB chunk per round trip. 0: gRPC's adaptive
    # windows (BDP probing: at least 4 MiB each, growing with the link without a bound). Socket reads are
    # capped at 64 KiB whatever the window (an idle connection keeps little).
    stream_window_bytes: int = DEFAULT_WINDOW_BYTES
    reassembly_wait_seconds: float = 30.0
    push_idle_seconds: float = 30.0
    max_buffered_bytes_per_organization: int = 4 << 30
    # A push cut mid-stream is kept in the spool (under state_dir) for its sender to resume, at most this long,
    # and all such partial pushes together at most this many bytes (the oldest dropped first).
    partial_push_seconds: float = 600.0
    max_partial_push_bytes: int = 8 << 30
    # Bound on the training examples an organization declares at Join (its declaration bounds its updates'
    # counts; without one, this bounds them).
    max_examples_per_organization: int = 1_000_000_000
    # Named figures (EvalMetrics.extra) in one report; characters in any name a client chooses.
    max_metrics_per_report: int = 64
    max_name_chars: int = 128
    # Tensors one organization may declare at Join.
    max_declared_tensors: int = 10_000

    def __post_init__(self) -> None:
        check(self.metrics_port >= -1, "metrics_port must be >= -1")
        check(self.max_update_bytes > 0, "max_update_bytes must be > 0")
        check(self.max_tensor_elements > 0, "max_tensor_elements must be > 0")
        check(1024 <= self.chunk_bytes <= 16 << 20, "chunk_bytes must be in [1 KiB, 16 MiB]")
        check(math.isfinite(self.health_stall_seconds) and self.health_stall_seconds > 0,
              "health_stall_seconds must be a positive number")
        check(self.max_pull_wait_seconds > 0, "max_pull_wait_seconds must be > 0")
        check(self.max_requests_per_second >= 0, "max_requests_per_second must be >= 0")
        check(1 <= self.worker_threads <= 256, "worker_threads must be in [1, 256]")
        check(self.max_pushes_per_organization >= 1, "max_pushes_per_organization must be >= 1")
        check(1 <= self.max_concurrent_reassemblies <= 4096, "max_concurrent_reassemblies must be in [1, 4096]")
        check(self.stream_window_bytes == 0 or 64 << 10 <= self.stream_window_bytes <= 1 << 30,
              "stream_window_bytes must be 0 (gRPC's adaptive windows) or in [64 KiB, 1 GiB]")
        for name in ("reassembly_wait_seconds", "push_idle_seconds", "partial_push_seconds"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, f"{name} must be a positive number")
        check(self.max_buffered_bytes_per_organization > 0, "max_buffered_bytes_per_organization must be > 0")
        check(self.max_partial_push_bytes >= 0, "max_partial_push_bytes must be >= 0")
        check(self.max_examples_per_organization >= 1, "max_examples_per_organization must be >= 1")
        check(self.max_metrics_per_report >= 0, "max_metrics_per_report must be >= 0")
        check(16 <= self.max_name_chars <= 4096, "max_name_chars must be in [16, 4096]")
        check(self.max_declared_tensors >= 1, "max_declared_tensors must be >= 1")


@dataclass(frozen=True)
class AggregatorConfig:
    """The whole aggregator configuration file."""

    runs: tuple[RunConfig, ...]
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        ids = [r.id for r in self.runs]
        check(len(ids) >= 1, "runs must define at least one run")
        check(len(set(ids)) == len(ids), f"run ids must be unique, got {ids}")


def load_aggregator_config(path: str | Path) -> AggregatorConfig:
    """Load and validate an aggregator config file."""
    return load_file(AggregatorConfig, path)


def aggregator_config_from_mapping(data: dict[str, Any]) -> AggregatorConfig:
    """Validate an aggregator config given as a mapping."""
    return from_mapping(AggregatorConfig, data, "aggregator")
