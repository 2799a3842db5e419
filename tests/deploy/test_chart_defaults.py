"""One set of defaults: the chart's default federation, ``hetfed run`` and a hand-written aggregator file that
leaves the training fields out all train with the algorithm's declared config, field by field."""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any

import pytest

from hetfed.aggregator.config import RunConfig, aggregator_config_from_mapping
from hetfed.cli.localrun import LocalRunOptions, aggregator_settings, plan
from hetfed.wire.config import to_sparse_mapping
from hetfed.wire.specs import SPECS, TrainConfig
from tests.deploy.conftest import Helm, by_kind

# The chart's demo run: its data set is the built-in one its clients are rendered with.
CHART_ALGORITHM, CHART_DATASET = "fedavg", "mnist5k"


def fields(config: TrainConfig) -> dict[str, Any]:
    """Every field of a config by name: a difference names the field."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def chart_objects(helm: Helm) -> list[dict[str, Any]]:
    """The chart's default federation, rendered by real Helm."""
    return helm.objects(sets=("organizations={north,south}",))


def aggregator_file(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregator file among the rendered objects, as TOML it holds."""
    (cm,) = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == "fl-hetfed-aggregator"]
    return tomllib.loads(cm["data"]["aggregator.toml"])


def chart_run(helm: Helm) -> RunConfig:
    """The chart's default federation's run, parsed as the aggregator parses its file."""
    objects = chart_objects(helm)
    clients = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == "fl-hetfed-north"]
    (client,) = [tomllib.loads(text) for c in clients for text in c["data"].values()]
    assert client["data"]["dataset"] == CHART_DATASET
    (run,) = aggregator_config_from_mapping(aggregator_file(objects)).runs
    assert run.algorithm == CHART_ALGORITHM
    return run


def local_run(algorithm: str, dataset: str) -> RunConfig:
    """The run ``hetfed run --algorithm ALGORITHM --dataset DATASET`` hands its aggregator, read back from the
    file it writes, as the aggregator reads it."""
    p = plan(LocalRunOptions(algorithms=(algorithm,), dataset=dataset))
    written = to_sparse_mapping(aggregator_settings(p, "state"))
    (run,) = aggregator_config_from_mapping(written).runs
    return run


def test_the_charts_default_federation_trains_as_hetfed_run_does(helm: Helm) -> None:
    chart = fields(chart_run(helm).algorithm_config)
    local = fields(local_run(CHART_ALGORITHM, CHART_DATASET).algorithm_config)
    assert chart == local
    # ... which is the algorithm's declared config: neither writes numbers of its own.
    assert chart == fields(SPECS[CHART_ALGORITHM].config())
    assert (chart["lr"], chart["momentum"], chart["local_epochs"], chart["batch_size"]) == (0.01, 0.9, 2, 32)


def test_the_chart_writes_no_training_field(helm: Helm) -> None:
    (run,) = aggregator_file(chart_objects(helm))["runs"]
    assert run["algorithm"] == CHART_ALGORITHM and "algorithm_config" not in run


# Every algorithm hetfed run offers on MNIST-5k whose run-wide widths it does not set from the data.
WIDTHS = {"latent_dim", "num_classes", "wire_dtype"}


@pytest.mark.parametrize("algorithm", sorted(SPECS))
def test_a_hand_written_file_that_leaves_the_fields_out_trains_as_hetfed_run(algorithm: str) -> None:
    """On the default data set: what ``hetfed run`` resolves for the training knobs is what an aggregator file
    naming only the algorithm gets (the data set's and the command's layers add nothing there)."""
    run: dict[str, Any] = {"id": "r", "algorithm": algorithm, "organizations": ["a", "b"], "rounds": 3}
    if SPECS[algorithm].needs_seed_set:
        run["seed_set"] = {"id": "seeds", "sha256": "0" * 64}
    hand = {"runs": [run]}
    (written,) = aggregator_config_from_mapping(hand).runs
    local = fields(local_run(algorithm, CHART_DATASET).algorithm_config)
    own = fields(written.algorithm_config)
    differ = {k: (own[k], local[k]) for k in own if own[k] != local[k] and k not in WIDTHS}
    assert differ == {}
