"""Organization (client) configuration: identity, aggregator, data, private model, device (validated on load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetfed.client.data import DataConfig
from hetfed.client.model_registry import DEFAULT_MODEL
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.wire.config import check, load_file
from hetfed.wire.tls import TlsConfig


@dataclass(frozen=True)
class ModelConfig:
    """The organization's private architecture (it never leaves the organization under model-private algorithms).

    Exactly one of ``name`` (a built-in architecture, ``hetfed run --help`` lists them) and ``builder`` (the
    organization's own encoder builder, ``"package.module:function"``; docs/models.md); neither: ``lenet``.
    """

    name: str = ""
    builder: str = ""
    # Width of the latent space z (0: the architecture's default).
    latent_dim: int = 0

    def __post_init__(self) -> None:
        check(self.latent_dim >= 0, f"latent_dim must be >= 0, got {self.latent_dim}")
        check(not (self.name and self.builder),
              f"model.name ({self.name!r}) and model.builder ({self.builder!r}) exclude each other: set one")
        if self.builder:
            module, sep, func = self.builder.partition(":")
            check(bool(sep and module and func and func.isidentifier()),
                  f"model.builder must be 'package.module:function', got {self.builder!r}")

    @property
    def reference(self) -> str:
        """The architecture as ``build_model`` takes it: the builder reference, else the registry name."""
        return self.builder or self.name or DEFAULT_MODEL


@dataclass(frozen=True)
class RetryConfig:
    """Exponential backoff with full jitter while the aggregator is unavailable."""

    initial_backoff_seconds: float = 0.2
    max_backoff_seconds: float = 10.0
    multiplier: float = 2.0
    # Give up after this long without reaching the aggregator.
    give_up_after_seconds: float = 600.0

    def __post_init__(self) -> None:
        check(self.initial_backoff_seconds > 0, "initial_backoff_seconds must be > 0")
        check(self.max_backoff_seconds >= self.initial_backoff_seconds, "max_backoff_seconds must be >= initial")
        check(self.multiplier >= 1, "multiplier must be >= 1")
        check(self.give_up_after_seconds > 0, "give_up_after_seconds must be > 0")


@dataclass(frozen=True)
class ClientConfig:
    """The whole client configuration file of one organization."""

    organization: str
    run: str
    aggregator: str = "localhost:50051"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # "auto" picks CUDA when present, else CPU; or "cpu", "cuda", "cuda:N".
    device: str = "auto"
    # torch intra-op threads (0: torch's default).
    threads: int = 0
    # Prometheus /metrics port; 0 picks a free port, -1 disables the endpoint.
    metrics_port: int = -1
    metrics_host: str = "0.0.0.0"
    # Keep serving /metrics this long after the run finishes, so a scraper collects the final counts.
    metrics_linger_seconds: float = 0.0
    pull_wait_seconds: float = 20.0
    tls: TlsConfig | None = None
    retry: RetryConfig = field(default_factory=RetryConfig)
    # Where this client writes local artifacts for its operator (model snapshots, probe latents;
    # hetfed.client.artifacts). Under [privacy] also own-figures.json: the organization's own exact figures per
    # round, which its uploads withhold (hetfed.client.own_record). Nothing written here is ever sent. None:
    # write nothing.
    output_dir: str | None = None
    # Where this client keeps its private state across restarts (private encoders and heads, personal
    # models, optimizer state, the round it last finished), written atomically after each round and
    # resumed from at start. None: every start is fresh. Under [privacy] the privacy ledger lives here too, so
    # [privacy] needs it (unless privacy.ephemeral_ledger).
    state_dir: str | None = None
    # With state_dir: an update of at least this many bytes is kept there until the aggregator acknowledges it,
    # so that a client restarted in the middle of its push resumes it (hetfed.client.pending) instead of working
    # the round again; 0 keeps every one. Under [privacy] every update is kept, whatever its size: a round worked
    # again would be charged to the budget again.
    keep_push_from_bytes: int = 64 << 20
    # Add the process's CPU and wall seconds spent in local work (cumulative) to each round's reported
    # figures (train_cpu_seconds, train_wall_seconds, process_cpu_seconds); benchmarks use them. Withheld under
    # [privacy]: the time a round takes grows with the organization's data.
    report_timing: bool = False
    # Differential privacy of everything this organization sends (docs/privacy.md); off unless set.
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        check(bool(self.organization), "organization must not be empty")
        check(bool(self.run), "run must not be empty")
        check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        check(self.threads >= 0, "threads must be >= 0")
        check(self.metrics_port >= -1, "metrics_port must be >= -1")
        check(self.metrics_linger_seconds >= 0, "metrics_linger_seconds must be >= 0")
        check(self.pull_wait_seconds > 0, "pull_wait_seconds must be > 0")
        check(self.keep_push_from_bytes >= 0, "keep_push_from_bytes must be >= 0")
        # A ledger that ends with the process lets a restart count ε from zero: DP needs the ledger on disk.
        check(not self.privacy.enabled or bool(self.state_dir) or self.privacy.ephemeral_ledger,
              "[privacy] needs state_dir: the privacy ledger is kept there, and without it a restarted client would "
              "count ε from zero; set state_dir (or privacy.ephemeral_ledger = true for an experiment)")


def load_client_config(path: str | Path) -> ClientConfig:
    """Load and validate a client config file."""
    return load_file(ClientConfig, path)
