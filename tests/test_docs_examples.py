"""The documented example configuration files load and validate."""

from __future__ import annotations

from pathlib import Path

from hetfed.aggregator.config import load_aggregator_config
from hetfed.client.config import load_client_config

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_example_aggregator_config_loads() -> None:
    cfg = load_aggregator_config(EXAMPLES / "aggregator.toml")
    assert [r.id for r in cfg.runs] == ["mnist-fedavg", "mnist-local"]
    assert cfg.runs[0].quorum == 2 and cfg.runs[0].algorithm_config.momentum == 0.9


def test_example_client_config_loads() -> None:
    cfg = load_client_config(EXAMPLES / "client.toml")
    assert (cfg.organization, cfg.data.dataset, cfg.model.name) == ("hospital-a", "npz", "lenet")
