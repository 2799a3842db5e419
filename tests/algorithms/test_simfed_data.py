"""The permuted-label prototype (benchmarks/prototypes/simfed_data.py): seeded, consistent across splits."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from hetfed.client.data import DataConfig, load_client_data

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "prototypes" / "simfed_data.py"


def _module() -> ModuleType:
    if "simfed_data" not in sys.modules:
        spec = importlib.util.spec_from_file_location("simfed_data", _PATH)
        assert spec is not None and spec.loader is not None
        sys.modules["simfed_data"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["simfed_data"])
    return sys.modules["simfed_data"]


def test_label_permutations_are_seeded_per_organization() -> None:
    m = _module()
    p = m.label_permutation(0, 3, 10)
    assert sorted(p.tolist()) == list(range(10))
    assert np.array_equal(p, m.label_permutation(0, 3, 10))
    assert not np.array_equal(p, m.label_permutation(0, 4, 10))
    assert not np.array_equal(p, m.label_permutation(1, 3, 10))
    np.testing.assert_array_equal(m.permute_labels(np.array([0, 2, 2, 1]), np.array([2, 0, 1])), [2, 1, 1, 0])
    with pytest.raises(ValueError, match="exactly once"):
        m.permute_labels(np.array([0]), np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="labels must be integers"):
        m.permute_labels(np.array([3]), np.array([2, 0, 1]))


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_permuted_client_data_relabels_every_split_alike(partition: str) -> None:
    m = _module()
    for k in (0, 1):
        cfg = DataConfig(
            dataset="digits", partition=partition, alpha=0.5, num_clients=4, client_index=k, seed=5
        )
        plain, permuted = load_client_data(cfg), m.permuted_client_data(cfg)
        perm = m.label_permutation(5, k, plain.num_classes)
        for a, b in (
            (plain.train, permuted.train),
            (plain.test, permuted.test),
            (plain.global_test, permuted.global_test),
        ):
            assert a is not None and b is not None
            np.testing.assert_array_equal(b.x, a.x)
            np.testing.assert_array_equal(b.y, perm[a.y])
