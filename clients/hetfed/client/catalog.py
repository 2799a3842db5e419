"""What the client package offers to commands that plan or inspect federations without running a client.

``hetfed run`` and ``hetfed bench`` start client processes; they never run client code themselves. What they
must know before any process starts is declared here: the data sets, partitions, test splits and architectures
by name (registries as data, no torch), the settings a client will read (its ``ClientConfig`` and the data, model
and privacy tables in it), and the checks a plan runs so that a bad choice stops the command in one line. The
CLI imports this module and no other client module, but for ``hetfed client`` (the client's entry point) and the
fork server (which preloads the client runtime); an import-linter contract in pyproject.toml keeps it so.

Importing it loads no torch: the checks that build a model or load an organization's own data import what they
need when called, and the client config's dataclasses load on first use (they bring the gRPC transport's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfed.client.card import CARD_FILE, CARD_FORMAT, file_sha256
from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import DatasetUnavailableError
from hetfed.client.data.partitions import TEST_SPLITS
from hetfed.client.data.registry import DATASETS, DEFAULT_DATASET, FACTORY_DATASET, PARTITIONS, resolve
from hetfed.client.model_registry import MODELS, input_mismatch, is_reference, models_for
from hetfed.client.own_record import OWN_FIGURES, entry_at, read_own_record
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.wire.config import ConfigError

if TYPE_CHECKING:
    from hetfed.client.config import ClientConfig, ModelConfig, RetryConfig

# The client config file's dataclasses, loaded when first asked for (``catalog.ClientConfig``).
_CLIENT_CONFIG = ("ClientConfig", "ModelConfig", "RetryConfig")

__all__ = ["CARD_FILE", "CARD_FORMAT", "DATASETS", "DEFAULT_DATASET", "FACTORY_DATASET", "MODELS", "OWN_FIGURES",
           "PARTITIONS", "TEST_SPLITS", "ClientConfig", "DataConfig", "ModelConfig", "OwnData", "PrivacyConfig", "RetryConfig",
           "check_client_file", "check_dataset_available", "check_models", "check_own_data", "diagnostic",
           "draw_picture", "entry_at", "file_sha256", "input_mismatch", "is_reference", "model_bytes", "models_for",
           "read_own_record", "seed_set_summary"]


def __getattr__(name: str) -> Any:
    """``ClientConfig``, ``ModelConfig`` and ``RetryConfig``, imported on first use."""
    if name in _CLIENT_CONFIG:
        from hetfed.client import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class OwnData:
    """What the organizations' own data sets agree on (checked before any process starts)."""

    num_classes: int
    input_shape: tuple[int, ...]


def check_dataset_available(dataset: str) -> None:
    """Raise ConfigError (one line) when a data set that needs an optional download or package is missing."""
    check = DATASETS[dataset].check
    if check:
        try:
            resolve(check)()
        except DatasetUnavailableError as exc:
            raise ConfigError(str(exc)) from None


def seed_set_summary(cfg: DataConfig, clients: int) -> dict[str, Any]:
    """The shared seed set under ``cfg``'s partition as the aggregator checks it at Join: its id, SHA-256, size
    and each organization's part."""
    from hetfed.client.data import load_seed_set

    seeds = load_seed_set(cfg)
    assert seeds is not None
    return {"id": seeds.id, "sha256": seeds.sha256, "size": len(seeds),
            "parts": {f"org-{d}": list(r) for d, r in seeds.ranges().items() if d < clients}}


def check_own_data(configs: Sequence[DataConfig]) -> OwnData:
    """Load every organization's own data set (its files, or its data factory's) as its client will, so that a
    factory that cannot be imported or raises, labels out of range, an empty training set, an unreadable image
    or organizations that disagree on the label count or input shape stop the command in one line."""
    from hetfed.client.data import load_client_data

    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    for cfg in configs:
        try:
            data = load_client_data(cfg)
        except (ValueError, TypeError, ImportError) as exc:
            raise ConfigError(f"org-{cfg.client_index}'s data: {' '.join(str(exc).split())}") from None
        seen.setdefault((data.num_classes, data.input_shape), f"org-{cfg.client_index}")
    if len(seen) > 1:
        (k0, s0), (k1, s1) = list(seen)[:2]
        first, other = seen[(k0, s0)], seen[(k1, s1)]
        raise ConfigError(f"the organizations' data disagree: {first} has {k0} classes and inputs {s0}, {other} has "
                          f"{k1} classes and inputs {s1}")
    (k, shape), = seen
    return OwnData(k, shape)


def check_models(dataset: str, models: Sequence[str], latent: int | None, bounded: bool,
                 own: OwnData | None) -> None:
    """Build each architecture once on the data's input shape (an own builder that cannot be imported, raises,
    or does not map to (batch, latent_dim) stops the command in one line)."""
    from hetfed.client.models import build_model

    entry = DATASETS[dataset]
    if own is not None:
        shape, classes = own.input_shape, own.num_classes
    else:
        assert entry.input_shape is not None and entry.num_classes is not None
        shape, classes = entry.input_shape, entry.num_classes
    for m in dict.fromkeys(models):
        try:
            build_model(m, shape, classes, latent_dim=latent, bounded_latent=bounded)
        except (ValueError, ImportError) as exc:
            raise ConfigError(" ".join(str(exc).split())) from None


def model_bytes(cfg: DataConfig, model: str, latent_dim: int | None) -> int:
    """Bytes of a model's floating state in float32 on ``cfg``'s data: one whole-model message of it."""
    from hetfed.client.data import load_client_data
    from hetfed.client.models import build_model

    data = load_client_data(cfg)
    m = build_model(model, data.input_shape, data.num_classes, latent_dim=latent_dim)
    return sum(v.numel() * 4 for v in m.state_dict().values() if v.is_floating_point())


def draw_picture(picture: str, workdir: Path, run_id: str, out: Path) -> Path | None:
    """Draw a data set's picture of a finished run (its registry entry's ``picture``); the PNG's path or None."""
    png: Path | None = resolve(picture)(workdir, run_id, out)
    return png


def diagnostic(key: str, workdir: Path, summary: Mapping[str, Any], seed: int) -> float:
    """A diagnostic figure of a finished run, computed from its clients' snapshots (``hetfed.client.diagnostics``)."""
    from hetfed.client.diagnostics import DIAGNOSTICS

    return DIAGNOSTICS[key](workdir, dict(summary), seed)


def check_client_file(path: str) -> ClientConfig:
    """Read a client config file as the client will, and check its model name against the installed
    architectures; raises ConfigError naming the field."""
    from hetfed.client.config import load_client_config

    cfg = load_client_config(path)
    if not cfg.model.builder and cfg.model.reference not in MODELS:
        raise ConfigError(f"{path}: model.name {cfg.model.name!r} is not an available architecture "
                          f"({', '.join(sorted(MODELS))})")
    return cfg
