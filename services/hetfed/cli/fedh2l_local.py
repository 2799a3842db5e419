"""FedH2L in a local federation: the run's seed set fingerprint, its seed-set checks and its defaults.

The seed set is derived from the same data config the organizations use (numpy only, no torch), so the
aggregator config names exactly the seed set every client will hold: its id and SHA-256 (checked at
Join), its size and each organization's domain part (checked on every upload).
"""

from __future__ import annotations

from typing import Any

from hetfed.wire.config import ConfigError

# Heterogeneous private architectures assigned to organizations in turn when none are given.
DEFAULT_MODELS: tuple[str, ...] = ("lenet", "mlp", "fedgen_cnn", "lenet_wide")
# Generic SGD knobs of `hetfed run` that FedH2L does not take (it defaults to AMSGrad lr 1e-3; use --set).
_SGD_KNOBS = ("local_epochs", "lr", "momentum")


def seed_set_settings(dataset: str, clients: int, seed: int, public_fraction: float,
                      seed_set_path: str | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """(the run's ``seed_set`` {id, sha256}, the FedH2L config fields that describe it) for a rotated data config."""
    from hetfed.client.data import DataConfig
    from hetfed.client.rotated import load_seed_set

    cfg = DataConfig(dataset=dataset, partition="rotated", num_clients=clients, seed=seed,
                     public_fraction=public_fraction, seed_set_path=seed_set_path)
    seeds = load_seed_set(cfg)
    ranges = seeds.ranges()
    return {"id": seeds.id, "sha256": seeds.sha256}, {
        "seed_set_id": seeds.id,
        "seed_set_size": len(seeds),
        "teach_ranges": {f"org-{d}": list(r) for d, r in ranges.items() if d < clients},
    }


def apply_fedh2l(run: dict[str, Any], dataset: str, partition: str, clients: int, seed: int,
                 public_fraction: float, explicit: dict[str, Any]) -> None:
    """Complete a local run config for FedH2L: the seed set and FedH2L's own optimiser defaults."""
    if partition != "rotated":
        raise ConfigError(f"fedh2l needs a shared seed set: use --partition rotated (got {partition!r})")
    seed_set, fields = seed_set_settings(dataset, clients, seed, public_fraction)
    cfg = run["algorithm_config"]
    for knob in _SGD_KNOBS:
        if knob not in explicit:
            cfg.pop(knob, None)
    run["algorithm_config"] = {**cfg, **fields, **explicit}
    run["seed_set"] = seed_set
