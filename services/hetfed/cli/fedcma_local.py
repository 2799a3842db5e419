"""What ``hetfed run`` fills in for Fed-CMA (its run and client config defaults).

Fed-CMA needs one latent width d_e and one label space across organizations, and its point is that
encoders may differ: unless ``--models`` is given, organizations on image data alternate between a CNN
and an MLP (flat data such as the 2-D toy only fits the MLP), all mapping into [0, 1]^d_e. This module is imported by the
CLI without torch; the gauss4 picture is drawn by :mod:`hetfed.client.diagnostics`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetfed.cli.localrun import LocalRunOptions

# Encoder architectures cycled across organizations when --models is not given.
DEFAULT_MODELS: dict[str, tuple[str, ...]] = {"image": ("fedgen_cnn", "mlp"), "flat": ("mlp",)}
# d_e when neither --latent-dim nor --set fedcma.latent_dim is given (2 on the toy: the latent space is drawn).
DEFAULT_LATENT_DIM = {"gauss4": 2}
DEFAULT_LATENT_DIM_OTHER = 32
NUM_CLASSES = {"mnist5k": 10, "digits": 10, "synthetic": 10, "gauss4": 4}
FLAT_DATASETS = ("synthetic", "gauss4")
ARTIFACTS = "artifacts"


def latent_dim(opts: LocalRunOptions) -> int:
    """d_e of a local Fed-CMA run: --set fedcma.latent_dim, else --latent-dim, else the dataset's default."""
    explicit = opts.extra_algorithm_config.get("fedcma", {}).get("latent_dim")
    if explicit:
        return int(explicit)
    return opts.latent_dim or DEFAULT_LATENT_DIM.get(opts.dataset, DEFAULT_LATENT_DIM_OTHER)


def default_models(dataset: str) -> tuple[str, ...]:
    """Architectures alternated across organizations when --models is not given."""
    return DEFAULT_MODELS["flat" if dataset in FLAT_DATASETS else "image"]


def fedcma_run_defaults(run: dict[str, Any], opts: LocalRunOptions) -> None:
    """Fill the run's latent_dim and num_classes (explicit --set values win)."""
    cfg = run["algorithm_config"]
    cfg.setdefault("latent_dim", latent_dim(opts))
    if opts.dataset in NUM_CLASSES:
        cfg.setdefault("num_classes", NUM_CLASSES[opts.dataset])


def fedcma_client_defaults(cfg: dict[str, Any], opts: LocalRunOptions, index: int) -> None:
    """Heterogeneous encoders by default, and the run's common latent width."""
    if not opts.models:
        models = default_models(opts.dataset)
        cfg["model"]["name"] = models[index % len(models)]
    cfg["model"]["latent_dim"] = latent_dim(opts)


def artifacts_dir(run_id: str, organization: str) -> str:
    """Where a local run's client writes its snapshots, relative to the run's work directory."""
    return str(Path(ARTIFACTS) / run_id / organization)
