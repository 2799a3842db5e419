"""The experiment side names only what exists: registered algorithms, their figures, datasets, models."""

from __future__ import annotations

from pathlib import Path

from hetfed.cli.experiments import (
    DATASET_DEFAULTS,
    DEFAULT_COMPARISON,
    EXPERIMENTS,
    bytes_reference,
    docs_page,
    experiment,
)
from hetfed.client.data import DATASETS, PARTITIONS
from hetfed.client.model_registry import MODELS
from hetfed.wire.specs import SPECS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_entry_is_a_registered_algorithm_and_labels_only_its_figures() -> None:
    assert set(EXPERIMENTS) <= set(SPECS) and set(DEFAULT_COMPARISON) <= set(SPECS)
    for name, entry in EXPERIMENTS.items():
        assert set(entry.labels) <= {f.key for f in SPECS[name].figures}, name
        for dataset, d in entry.defaults.items():
            assert dataset == "*" or dataset in DATASETS, (name, dataset)
            assert set(d.models) <= set(MODELS) and (d.partition is None or d.partition in PARTITIONS), name
            assert set(d.config) <= set(SPECS[name].config_type.__dataclass_fields__), name


def test_dataset_defaults_name_datasets_partitions_and_models() -> None:
    assert set(DATASET_DEFAULTS) == set(DATASETS)
    for name, d in DATASET_DEFAULTS.items():
        assert d.partition in DATASETS[name].partitions and set(d.models) <= set(MODELS), name


def test_presets_share_their_algorithms_entry_and_page() -> None:
    for name, spec in SPECS.items():
        # An algorithm with an entry has a page of its own (the others are documented in configuration.md).
        assert not experiment(spec).docs or (DOCS / docs_page(spec)).exists(), name
        if spec.preset_of:
            assert experiment(spec) is experiment(SPECS[spec.preset_of]), name
    # Labels: the spec's figure key when the experiment side gives none.
    assert experiment(SPECS["fedh2l"]).label("wdp") == "WDP" and experiment(SPECS["fedavg"]).label("x") == "x"


def test_one_algorithm_is_the_reports_bytes_reference() -> None:
    """``hetfed report`` compares bytes per round with the one algorithm whose entry declares it, by name."""
    refs = [name for name, entry in EXPERIMENTS.items() if entry.bytes_reference]
    assert len(refs) == 1 and refs[0] in SPECS
    assert bytes_reference() == (refs[0], EXPERIMENTS[refs[0]].bytes_reference)
