"""Permuted labels (data.permute_labels): seeded per organization, applied to every split alike, validated."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.client.data import DataConfig, label_permutation, load_client_data, permute_labels


def test_label_permutations_are_seeded_per_organization() -> None:
    p = label_permutation(0, 3, 10)
    assert sorted(p.tolist()) == list(range(10))
    assert np.array_equal(p, label_permutation(0, 3, 10))
    assert not np.array_equal(p, label_permutation(0, 4, 10))
    assert not np.array_equal(p, label_permutation(1, 3, 10))
    np.testing.assert_array_equal(permute_labels(np.array([0, 2, 2, 1]), np.array([2, 0, 1])), [2, 1, 1, 0])
    with pytest.raises(ValueError, match="exactly once"):
        permute_labels(np.array([0]), np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="labels must be integers"):
        permute_labels(np.array([3]), np.array([2, 0, 1]))


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_permuted_data_relabels_every_split_alike(partition: str) -> None:
    for k in (0, 1):
        cfg = DataConfig(dataset="digits", partition=partition, alpha=0.5, num_clients=4, client_index=k, seed=5)
        plain = load_client_data(cfg)
        permuted = load_client_data(DataConfig(**{**cfg.__dict__, "permute_labels": True}))
        perm = label_permutation(5, k, plain.num_classes)
        assert sorted(perm.tolist()) == list(range(10)) and not np.array_equal(perm, np.arange(10))
        for a, b in ((plain.train, permuted.train), (plain.test, permuted.test),
                     (plain.global_test, permuted.global_test)):
            assert a is not None and b is not None
            np.testing.assert_array_equal(b.x, a.x)
            np.testing.assert_array_equal(b.y, perm[a.y])
        assert permuted.num_classes == plain.num_classes


def test_permute_labels_is_refused_where_it_does_not_apply() -> None:
    with pytest.raises(ValueError, match=r"data\.permute_labels works with partition 'dirichlet' or 'iid'"):
        DataConfig(dataset="synthetic", partition="natural", permute_labels=True)
    with pytest.raises(ValueError, match=r"data\.permute_labels must be true or false"):
        DataConfig(dataset="digits", partition="iid", permute_labels="yes")  # type: ignore[arg-type]


def test_label_groups_share_one_permutation_per_group() -> None:
    base = {"dataset": "digits", "partition": "iid", "num_clients": 4, "seed": 5, "permute_labels": True,
            "label_groups": 2}
    plain = [load_client_data(DataConfig(**{**base, "client_index": k, "permute_labels": False, "label_groups": 0}))
             for k in range(4)]
    grouped = [load_client_data(DataConfig(**{**base, "client_index": k})) for k in range(4)]
    for k in range(4):  # organization k relabels by group k mod 2's permutation, the one organization k mod 2 has
        perm = label_permutation(5, k % 2, 10)
        np.testing.assert_array_equal(grouped[k].train.y, perm[plain[k].train.y])
        np.testing.assert_array_equal(grouped[k].train.x, plain[k].train.x)
    assert not np.array_equal(label_permutation(5, 0, 10), label_permutation(5, 1, 10))
    with pytest.raises(ValueError, match=r"data\.label_groups groups the label permutations"):
        DataConfig(dataset="digits", partition="iid", label_groups=2)
    with pytest.raises(ValueError, match=r"data\.label_groups"):
        DataConfig(dataset="digits", partition="iid", permute_labels=True, label_groups=-1)
