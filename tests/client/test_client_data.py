"""Tests for hetfed.client.data: pure partition functions, config validation and the dataset loaders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetfed.client.data import (
    ArrayDataset,
    ClientData,
    DataConfig,
    class_counts,
    class_proportions,
    dirichlet_partition,
    domain_partition,
    generate_synthetic,
    iid_partition,
    load_client_data,
    load_npz_dir,
    split_like,
    stratified_holdout,
    stratified_subsample,
)


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    assert joined.size == n, "parts overlap or miss indices"
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))


# ---------------------------------------------------------------- pure functions


def test_class_counts_exact() -> None:
    counts = class_counts(np.array([0, 2, 2, 3, 0, 2]), 5)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, [2, 0, 3, 1, 0])


def test_class_counts_rejects_out_of_range_label() -> None:
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        class_counts(np.array([0, 3]), 3)


def test_iid_partition_sizes_disjoint_and_seeded() -> None:
    parts = iid_partition(10, 4, seed=7)
    assert [p.size for p in parts] == [3, 3, 2, 2]
    assert_disjoint_cover(parts, 10)
    again = iid_partition(10, 4, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = iid_partition(10, 4, seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_partition_rejects_more_clients_than_examples() -> None:
    with pytest.raises(ValueError, match="3 examples among 4 clients"):
        iid_partition(3, 4, seed=0)


def test_stratified_holdout_exact_counts() -> None:
    labels = np.repeat(np.arange(3), [10, 20, 5])
    keep, hold = stratified_holdout(labels, 0.2, seed=3)
    np.testing.assert_array_equal(class_counts(labels[hold], 3), [2, 4, 1])
    np.testing.assert_array_equal(class_counts(labels[keep], 3), [8, 16, 4])
    assert_disjoint_cover([keep, hold], labels.size)
    _, hold2 = stratified_holdout(labels, 0.2, seed=3)
    np.testing.assert_array_equal(hold, hold2)
    _, hold3 = stratified_holdout(labels, 0.2, seed=4)
    assert not np.array_equal(hold, hold3)


def test_stratified_holdout_keeps_singletons_and_holds_one_of_two() -> None:
    labels = np.array([0, 1, 1])
    keep, hold = stratified_holdout(labels, 0.2, seed=0)
    np.testing.assert_array_equal(class_counts(labels[keep], 2), [1, 1])
    np.testing.assert_array_equal(class_counts(labels[hold], 2), [0, 1])


def test_dirichlet_partition_small_alpha_is_skewed_and_respects_minimum() -> None:
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_partition(labels, 5, alpha=0.1, min_per_client=10, seed=0)
    assert_disjoint_cover(parts, labels.size)
    assert min(p.size for p in parts) >= 10
    top_share = [class_counts(labels[p], 10).max() / p.size for p in parts]
    assert np.mean(top_share) > 0.5  # a few classes dominate each client


def test_dirichlet_partition_large_alpha_is_near_uniform() -> None:
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_partition(labels, 5, alpha=1000.0, min_per_client=10, seed=0)
    assert_disjoint_cover(parts, labels.size)
    for p in parts:
        shares = class_counts(labels[p], 10) / p.size
        assert shares.max() < 0.2


def test_dirichlet_partition_is_seeded() -> None:
    labels = np.repeat(np.arange(10), 50)
    a = dirichlet_partition(labels, 4, 0.5, 10, seed=11)
    b = dirichlet_partition(labels, 4, 0.5, 10, seed=11)
    c = dirichlet_partition(labels, 4, 0.5, 10, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_partition_gives_up_with_a_clear_error() -> None:
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(ValueError, match=r"in 3 draws; raise data\.alpha"):
        dirichlet_partition(labels, 10, alpha=0.001, min_per_client=10, seed=0, max_retries=3)
    with pytest.raises(ValueError, match="at least 20 of 100 examples"):
        dirichlet_partition(labels, 10, alpha=1.0, min_per_client=20, seed=0)


def test_dirichlet_partition_at_ratio_one_is_the_draw_it_was() -> None:
    """sampling_ratio = 1.0 drops nothing and consumes the generator as before: the counts recorded at 97e16a9."""
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_partition(labels, 5, 0.5, 10, seed=3, sampling_ratio=1.0)
    assert [class_counts(labels[p], 10).tolist() for p in parts] == [
        [41, 8, 10, 3, 16, 17, 0, 55, 6, 1], [0, 9, 24, 4, 13, 49, 56, 16, 1, 0],
        [38, 70, 1, 15, 7, 0, 14, 8, 34, 7], [4, 3, 61, 0, 42, 0, 29, 0, 0, 90],
        [17, 10, 4, 78, 22, 34, 1, 21, 59, 2]]
    default = dirichlet_partition(labels, 5, 0.5, 10, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, default, strict=True))


def test_dirichlet_partition_sampling_ratio_keeps_fedgens_per_class_counts() -> None:
    """FedGen's subsampling: class c keeps int(min(r·n/M, int(r·n_c))) examples; cap 0.5 · 180 / 3 = 30."""
    labels = np.repeat(np.arange(3), [100, 60, 20])
    parts = dirichlet_partition(labels, 3, 1000.0, 5, seed=0, sampling_ratio=0.5)
    kept = np.concatenate(parts)
    assert np.unique(kept).size == kept.size  # no index twice
    assert class_counts(labels[kept], 3).tolist() == [30, 30, 10]  # min(30, 50), min(30, 30), min(30, 10)
    assert [class_counts(labels[p], 3).tolist() for p in parts] == [[9, 10, 3], [10, 10, 3], [11, 10, 4]]
    # FedGen's Fashion-MNIST scale: 6,000 images a class, 20 users, ratio 0.5: 1,500 of each class, 15,000 in all.
    fmnist = np.repeat(np.arange(10), 6000)
    parts = dirichlet_partition(fmnist, 20, 0.05, 10, seed=0, sampling_ratio=0.5)
    assert class_counts(fmnist[np.concatenate(parts)], 10).tolist() == [1500] * 10
    assert min(p.size for p in parts) >= 10


def test_dirichlet_partition_sampling_ratio_is_checked() -> None:
    labels = np.repeat(np.arange(2), 50)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="sampling_ratio must be in"):
            dirichlet_partition(labels, 2, 1.0, 1, seed=0, sampling_ratio=bad)
    # 0.2 keeps int(min(0.2 · 100 / 5, int(0.2 · 50))) = 4 a class: 8 examples cannot give 5 clients 2 each.
    with pytest.raises(ValueError, match=r"at least 2 of 8 examples \(100 at sampling_ratio 0.2\)"):
        dirichlet_partition(labels, 5, 1.0, 2, seed=0, sampling_ratio=0.2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampling_ratio": 0.0}, r"data.sampling_ratio must be > 0"),
        ({"sampling_ratio": 1.5}, r"data.sampling_ratio must be in \(0, 1\], got 1.5"),
        ({"sampling_ratio": 0.5, "partition": "iid"}, r"applies to partition 'dirichlet' only, got 0.5 with "
                                                      r"partition 'iid'"),
        ({"mean": (0.5,), "std": (0.5,), "partition": "rotated"}, r"to 'mnist5k' and 'fmnist' under partition 'iid' "
                                                                  r"or 'dirichlet', got dataset 'mnist5k' with "
                                                                  r"partition 'rotated'"),
        ({"train_size": -1}, r"data.train_size must be >= 0"),
        ({"train_size": 100, "partition": "rotated"}, r"data.train_size applies to dataset 'mnist5k' or 'fmnist' or "
                                                      r"'digits' under partition 'iid' or 'dirichlet', got 100 with "
                                                      r"dataset 'mnist5k' and partition 'rotated'"),
        ({"train_size": 100, "dataset": "synthetic", "partition": "natural"}, r"got 100 with dataset 'synthetic'"),
        ({"mean": (0.5,), "std": (0.5,), "dataset": "digits"}, r"got dataset 'digits' with partition 'dirichlet'"),
        ({"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}, r"need one value for the grey images of 'mnist5k', got 3"),
    ],
)
def test_sampling_ratio_and_normalisation_fields_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)  # type: ignore[arg-type]


def test_mnist5k_normalised_and_subsampled_as_fedgen_loads_it() -> None:
    """FedGen's Normalize((0.5,), (0.5,)) maps the [0, 1] pixels to [-1, 1]; the split is the ratio's."""
    plain = load_client_data(DataConfig(num_clients=4, client_index=1, alpha=0.5, seed=2))
    norm = load_client_data(DataConfig(num_clients=4, client_index=1, alpha=0.5, seed=2, mean=(0.5,), std=(0.5,)))
    for a, b in ((plain.train, norm.train), (plain.test, norm.test), (plain.global_test, norm.global_test)):
        assert isinstance(a, ArrayDataset) and isinstance(b, ArrayDataset)
        np.testing.assert_array_equal(b.y, a.y)
        assert b.x.dtype == np.float32
        np.testing.assert_array_equal(b.x, (a.x - np.float32(0.5)) / np.float32(0.5))
    assert float(norm.train.x.min()) == -1.0 and float(norm.train.x.max()) == 1.0
    half = load_client_data(DataConfig(num_clients=4, client_index=1, alpha=0.5, seed=2, sampling_ratio=0.5))
    assert "ratio=0.5" in half.name
    # 4,000 training images (500 a class less the 20% held out): each class keeps int(min(500, 200)) = 200 in all.
    sizes = [len(load_client_data(DataConfig(num_clients=4, client_index=i, alpha=0.5, seed=2,
                                             sampling_ratio=0.5)).train) for i in range(4)]
    assert sum(sizes) == 2000


def test_stratified_subsample_keeps_the_class_shares_exactly() -> None:
    """n · n_c / N of each class, largest remainders: 20 of (60, 30, 10) is (12, 6, 2); 7 of them is (4, 2, 1)."""
    labels = np.repeat(np.arange(3), [60, 30, 10])
    picked = stratified_subsample(labels, 20, seed=(4, 6))
    assert picked.dtype == np.int64 and np.all(np.diff(picked) > 0)  # sorted, no index twice
    assert class_counts(labels[picked], 3).tolist() == [12, 6, 2]
    # 7 · (0.6, 0.3, 0.1) = (4.2, 2.1, 0.7) floors to (4, 2, 0); the last one goes to the largest remainder (0.7).
    assert class_counts(labels[stratified_subsample(labels, 7, seed=0)], 3).tolist() == [4, 2, 1]
    assert np.array_equal(stratified_subsample(labels, 20, seed=(4, 6)), picked)  # the seed decides
    assert not np.array_equal(stratified_subsample(labels, 20, seed=(5, 6)), picked)
    assert stratified_subsample(labels, 100, seed=0).tolist() == list(range(100))  # all of them
    # 5 · (0.3, 0.3, 0.2, 0.2) = (1.5, 1.5, 1, 1): the leftover one goes to the lower of the tied classes.
    tied = np.repeat(np.arange(4), [3, 3, 2, 2])
    assert class_counts(tied[stratified_subsample(tied, 5, seed=0)], 4).tolist() == [2, 1, 1, 1]
    for bad in (0, 101):
        with pytest.raises(ValueError, match=r"needs 1 <= n <= 100"):
            stratified_subsample(labels, bad, seed=0)


def test_train_size_subsamples_mnist5k_before_the_split() -> None:
    """1,000 of MNIST-5k's 4,000 training images, split among 4; the test sets are the full run's."""
    full = [load_client_data(DataConfig(num_clients=4, client_index=i, alpha=0.5, seed=2)) for i in range(4)]
    small = [load_client_data(DataConfig(num_clients=4, client_index=i, alpha=0.5, seed=2, train_size=1000))
             for i in range(4)]
    assert sum(len(d.train) for d in small) == 1000
    assert "1000 training images" in small[0].name
    all_train = np.concatenate([d.train.y for d in full])
    small_train = np.concatenate([d.train.y for d in small])
    # Each class keeps a quarter of its training images, to within the one the rounding moves.
    assert np.abs(class_counts(small_train, 10) - class_counts(all_train, 10) / 4).max() <= 1
    assert isinstance(small[0].global_test, ArrayDataset) and isinstance(full[0].global_test, ArrayDataset)
    np.testing.assert_array_equal(small[0].global_test.y, full[0].global_test.y)
    # Every image an organization trains on is one of the full training set's.
    whole = np.concatenate([d.train.x.reshape(len(d.train), -1) for d in full])
    rows = {r.tobytes() for r in whole}
    assert all(r.tobytes() in rows for d in small for r in d.train.x.reshape(len(d.train), -1))
    with pytest.raises(ValueError, match=r"data.train_size=4001 is more than the 4000 training examples of 'mnist5k'"):
        load_client_data(DataConfig(num_clients=4, train_size=4001))


def test_class_proportions_exact() -> None:
    labels = np.array([0, 0, 1, 1, 1, 2])
    props = class_proportions(labels, [np.array([0, 2]), np.array([1, 3, 4, 5])], 4)
    np.testing.assert_allclose(props, [[0.5, 0.5], [1 / 3, 2 / 3], [0.0, 1.0], [0.0, 0.0]])


def test_split_like_exact_counts() -> None:
    pool = np.repeat(np.arange(2), 10)
    props = np.array([[0.75, 0.25, 0.0], [0.0, 0.0, 1.0]])
    parts = split_like(pool, props, seed=0)
    assert [class_counts(pool[p], 2).tolist() for p in parts] == [[7, 0], [3, 0], [0, 10]]
    assert_disjoint_cover(parts, pool.size)


def test_split_like_gives_tiny_shares_at_least_one() -> None:
    pool = np.zeros(10, dtype=np.int64)
    parts = split_like(pool, np.array([[0.99, 0.01]]), seed=0)
    assert [p.size for p in parts] == [9, 1]


def test_split_like_fedgen_mode_gives_equal_shares_on_support() -> None:
    pool = np.zeros(10, dtype=np.int64)
    parts = split_like(pool, np.array([[0.9, 0.1, 0.0]]), seed=0, mode="fedgen")
    assert [p.size for p in parts] == [3, 3, 0]


def test_split_like_follows_train_support_of_a_dirichlet_partition() -> None:
    labels = np.repeat(np.arange(10), 80)
    pool = np.repeat(np.arange(10), 20)
    parts = dirichlet_partition(labels, 6, alpha=0.2, min_per_client=10, seed=5)
    test_parts = split_like(pool, class_proportions(labels, parts, 10), seed=5)
    for train_idx, test_idx in zip(parts, test_parts, strict=True):
        train_support = class_counts(labels[train_idx], 10) > 0
        test_support = class_counts(pool[test_idx], 10) > 0
        np.testing.assert_array_equal(train_support, test_support)
    assert_disjoint_cover(test_parts, pool.size)


def test_domain_partition_and_missing_domain() -> None:
    domain = np.array([2, 0, 1, 0, 2, 1])
    parts = domain_partition(domain, 2)
    assert [p.tolist() for p in parts] == [[1, 3], [2, 5]]  # domain 2 stays out (a held-out target)
    with pytest.raises(ValueError, match=r"no examples with domain \[3\]"):
        domain_partition(domain, 4)


def test_array_dataset_coerces_and_subsets() -> None:
    ds = ArrayDataset(np.arange(12).reshape(6, 2), np.array([0, 1, 0, 1, 2, 2]), np.arange(6))
    assert ds.x.dtype == np.float32
    assert ds.y.dtype == np.int64
    sub = ds.subset([4, 0])
    assert len(sub) == 2
    np.testing.assert_array_equal(sub.x, [[8, 9], [0, 1]])
    np.testing.assert_array_equal(sub.y, [2, 0])
    assert sub.domain is not None
    np.testing.assert_array_equal(sub.domain, [4, 0])
    with pytest.raises(ValueError, match=r"ArrayDataset\.y must have shape \(6,\)"):
        ArrayDataset(np.zeros((6, 2)), np.zeros(5))


def test_array_dataset_group_ids_are_checked_and_follow_a_subset() -> None:
    """Group ids (a patient per example): integers, one per example, kept by ``subset`` for the rows it keeps."""
    ds = ArrayDataset(np.zeros((5, 2)), np.zeros(5), groups=np.array([7, 7, 3, 9, 3], dtype=np.int32))
    assert ds.groups is not None and ds.groups.dtype == np.int64
    sub = ds.subset([4, 0, 3])
    assert sub.groups is not None
    np.testing.assert_array_equal(sub.groups, [3, 7, 9])
    assert ArrayDataset(np.zeros((5, 2)), np.zeros(5)).subset([1]).groups is None
    with pytest.raises(ValueError, match=r"ArrayDataset\.groups must hold one group id per example, shape \(5,\), "
                                         r"got \(4,\)"):
        ArrayDataset(np.zeros((5, 2)), np.zeros(5), groups=np.arange(4))
    with pytest.raises(ValueError, match=r"ArrayDataset\.groups must be integers, got dtype float64"):
        ArrayDataset(np.zeros((5, 2)), np.zeros(5), groups=np.array([0.0, 1.0, 1.5, 2.0, 3.0]))


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": -1}, "data.alpha must be > 0, got -1"),
        ({"alpha": float("nan")}, "data.alpha must be finite"),
        ({"dataset": "cifar"}, "data.dataset must be one of"),
        ({"partition": "shards"}, "data.partition must be one of"),
        ({"num_clients": 0}, "data.num_clients must be >= 1, got 0"),
        ({"num_clients": True}, "data.num_clients must be an integer"),
        ({"client_index": 4}, r"data.client_index must be < data.num_clients \(4\), got 4"),
        ({"min_per_client": -1}, "data.min_per_client must be >= 0"),
        ({"seed": -3}, "data.seed must be >= 0"),
        ({"synthetic_alpha": -0.5}, "data.synthetic_alpha must be >= 0"),
        ({"synthetic_beta": "x"}, "data.synthetic_beta must be a number"),
        ({"synthetic_samples": 5}, "data.synthetic_samples must be >= 10"),
        ({"test_split": "equal"}, "data.test_split must be one of"),
        ({"path": "/data"}, "data.path is only used with dataset 'imagefolder' or 'npz' or 'torch'"),
        ({"dataset": "npz", "partition": "natural"}, "data.path must name a directory"),
        ({"partition": "domain"}, "partition 'domain' is not available for dataset 'mnist5k'.*'npz'"),
        ({"dataset": "synthetic"}, "partition 'dirichlet' is not available for dataset 'synthetic'"),
        (
            {"dataset": "npz", "partition": "iid", "path": "/d"},
            "partition 'iid' is not available for dataset 'npz'",
        ),
    ],
)
def test_data_config_rejects_bad_fields(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- built-in datasets


def _all_clients(cfg: DataConfig) -> list[ClientData]:
    return [
        load_client_data(DataConfig(**{**cfg.__dict__, "client_index": i})) for i in range(cfg.num_clients)
    ]


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_mnist5k_real_images_partitioned(partition: str) -> None:
    clients = _all_clients(DataConfig(dataset="mnist5k", partition=partition, num_clients=4, seed=0))
    first = clients[0]
    assert first.input_shape == (1, 28, 28)
    assert first.num_classes == 10
    assert first.train.x.shape[1:] == (1, 28, 28)
    assert first.train.x.dtype == np.float32
    assert first.global_test is not None
    g = first.global_test
    assert len(g) == 1000
    np.testing.assert_array_equal(class_counts(g.y, 10), np.full(10, 100))
    assert float(g.x.min()) == 0.0
    assert float(g.x.max()) == 1.0
    # 4000 training images among the clients, plus the 1000 held out: 500 real images per class
    assert sum(len(c.train) for c in clients) == 4000
    train_counts = sum(class_counts(c.train.y, 10) for c in clients)
    np.testing.assert_array_equal(train_counts, np.full(10, 400))
    assert sum(len(c.test) for c in clients) == 1000
    # pixels are real digits: a typical image is mostly black with some ink
    ink = (first.train.x > 0.5).mean()
    assert 0.05 < ink < 0.3
    for c in clients:
        assert len(c.train) >= 10
        if partition == "dirichlet":
            np.testing.assert_array_equal(class_counts(c.train.y, 10) > 0, class_counts(c.test.y, 10) > 0)
        else:
            assert len(c.train) == 1000
            assert len(c.test) == 250


def test_mnist5k_partition_depends_only_on_seed() -> None:
    a = load_client_data(DataConfig(dataset="mnist5k", client_index=1, seed=4))
    b = load_client_data(DataConfig(dataset="mnist5k", client_index=1, seed=4))
    c = load_client_data(DataConfig(dataset="mnist5k", client_index=1, seed=5))
    np.testing.assert_array_equal(a.train.x, b.train.x)
    np.testing.assert_array_equal(a.test.y, b.test.y)
    assert len(a.train) != len(c.train) or not np.array_equal(a.train.y, c.train.y)


def test_mnist5k_small_alpha_twenty_clients() -> None:
    cfg = DataConfig(dataset="mnist5k", num_clients=20, alpha=0.05, min_per_client=10, client_index=7)
    data = load_client_data(cfg)
    assert len(data.train) >= 10
    assert np.count_nonzero(class_counts(data.train.y, 10)) <= 5


def test_digits_loads_and_holds_out_a_fifth() -> None:
    clients = _all_clients(DataConfig(dataset="digits", partition="iid", num_clients=3))
    first = clients[0]
    assert first.input_shape == (1, 8, 8)
    assert first.global_test is not None
    total = sum(len(c.train) for c in clients) + len(first.global_test)
    assert total == 1797
    assert 355 <= len(first.global_test) <= 365
    assert float(first.train.x.min()) >= 0.0
    assert float(first.train.x.max()) == 1.0


def test_synthetic_shape_and_determinism() -> None:
    cfg = DataConfig(
        dataset="synthetic", partition="natural", num_clients=8, client_index=2, synthetic_samples=500
    )
    a = load_client_data(cfg)
    b = load_client_data(cfg)
    other = load_client_data(DataConfig(**{**cfg.__dict__, "client_index": 3}))
    assert a.input_shape == (60,)
    assert a.num_classes == 10
    assert a.global_test is None
    assert a.train.x.shape[1] == 60
    assert len(a.train) + len(a.test) == 500
    assert 95 <= len(a.test) <= 105
    np.testing.assert_array_equal(a.train.x, b.train.x)
    np.testing.assert_array_equal(a.test.y, b.test.y)
    assert not np.array_equal(a.train.x[:10], other.train.x[:10])


def test_generate_synthetic_feature_covariance() -> None:
    data = generate_synthetic(20_000, alpha=0.5, beta=0.5, seed=(0, 1))
    assert data.x.shape == (20_000, 60)
    assert data.y.min() >= 0
    assert data.y.max() <= 9
    expected_var = np.arange(1, 61, dtype=np.float64) ** -1.2
    np.testing.assert_allclose(data.x.astype(np.float64).var(axis=0), expected_var, rtol=0.06)


# ---------------------------------------------------------------- npz directories


def _write(path: Path, **arrays: np.ndarray) -> None:
    np.savez(path, **arrays)  # type: ignore[arg-type]


def test_npz_round_trip_with_test_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.random((12, 1, 4, 4), dtype=np.float32)
    y = np.arange(12) % 3
    _write(tmp_path / "train.npz", x=x, y=y)
    _write(tmp_path / "test.npz", x=x[:4], y=np.array([0, 1, 2, 4]))
    data = load_client_data(DataConfig(dataset="npz", partition="natural", path=str(tmp_path)))
    np.testing.assert_array_equal(data.train.x, x)
    np.testing.assert_array_equal(data.train.y, y)
    np.testing.assert_array_equal(data.test.y, [0, 1, 2, 4])
    assert data.num_classes == 5
    assert data.input_shape == (1, 4, 4)
    assert data.global_test is None


def test_npz_without_test_file_holds_out_a_fifth_and_scales_uint8(tmp_path: Path) -> None:
    x = np.full((20, 5, 5), 255, dtype=np.uint8)
    _write(tmp_path / "train.npz", x=x, y=np.repeat([0, 1], 10))
    data = load_client_data(DataConfig(dataset="npz", partition="natural", path=str(tmp_path), seed=2))
    assert data.input_shape == (1, 5, 5)
    assert len(data.train) == 16
    np.testing.assert_array_equal(class_counts(data.test.y, 2), [2, 2])
    assert float(data.train.x.max()) == 1.0


def test_npz_group_array_gives_group_ids_and_survives_the_holdout(tmp_path: Path) -> None:
    """train.npz's optional ``group`` array: one group id per example; the held-out fifth takes its rows' ids."""
    x = np.arange(20, dtype=np.float32).reshape(20, 1)
    group = np.arange(20) // 4  # 5 patients of 4 examples; x[i] = i says which rows each side kept
    _write(tmp_path / "train.npz", x=x, y=np.repeat([0, 1], 10), group=group)
    data = load_client_data(DataConfig(dataset="npz", partition="natural", path=str(tmp_path), seed=2))
    assert data.train.groups is not None and data.test.groups is not None
    np.testing.assert_array_equal(data.train.groups, data.train.x[:, 0].astype(np.int64) // 4)
    np.testing.assert_array_equal(data.test.groups, data.test.x[:, 0].astype(np.int64) // 4)
    _write(tmp_path / "train.npz", x=x, y=np.repeat([0, 1], 10), group=np.full(20, 0.5))
    with pytest.raises(ValueError, match=r"train\.npz: array 'group' must hold whole numbers"):
        load_client_data(DataConfig(dataset="npz", partition="natural", path=str(tmp_path), seed=3))


def test_npz_domain_partition(tmp_path: Path) -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    domain = np.array([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    _write(tmp_path / "train.npz", x=x, y=np.zeros(10, dtype=np.int64), domain=domain)
    _write(tmp_path / "test.npz", x=x[:4], y=np.zeros(4, dtype=np.int64), domain=domain[:4])
    cfg = DataConfig(dataset="npz", partition="domain", path=str(tmp_path), num_clients=2, client_index=1)
    data = load_client_data(cfg)
    np.testing.assert_array_equal(data.train.x[:, 0], [3, 9, 15, 21, 27])
    assert data.train.domain is not None
    assert set(data.train.domain.tolist()) == {1}
    np.testing.assert_array_equal(data.test.x[:, 0], [3, 9])


def test_npz_declares_the_organizations_domain(tmp_path: Path) -> None:
    x = np.zeros((6, 3), dtype=np.float32)
    y = np.array([0, 1, 0, 1, 0, 1])
    for domain, expected in ((np.full(6, 3), 3), (np.array([3, 3, 3, 3, 3, 2]), -1), (None, -1)):
        arrays = {"x": x, "y": y} if domain is None else {"x": x, "y": y, "domain": domain}
        _write(tmp_path / "train.npz", **arrays)
        data = load_client_data(DataConfig(dataset="npz", partition="natural", path=str(tmp_path)))
        assert data.domain == expected, domain
    # Under the domain partition organization i holds domain i.
    _write(tmp_path / "train.npz", x=x, y=y, domain=np.array([0, 1, 0, 1, 0, 1]))
    data = load_client_data(DataConfig(dataset="npz", partition="domain", path=str(tmp_path), num_clients=2,
                                       client_index=1))
    assert data.domain == 1


def test_npz_domain_partition_needs_domain_array(tmp_path: Path) -> None:
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    cfg = DataConfig(dataset="npz", partition="domain", path=str(tmp_path), num_clients=1)
    with pytest.raises(ValueError, match=r"train\.npz: partition 'domain' needs an array 'domain'"):
        load_client_data(cfg)


def test_npz_errors_name_the_file_and_array(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_npz_dir(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"train\.npz: not found"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"train\.npz: missing array 'y' \(found: x\)"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match=r"train\.npz: array 'y' must have shape \(4,\)"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.zeros(4), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match=r"train\.npz: array 'x' must be \(N, features\)"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.array([0.0, 0.5, 1.0, 2.0]))
    with pytest.raises(ValueError, match="array 'y' must hold whole numbers"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.full((4, 2), np.nan), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="array 'x' contains NaN"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.array([None] * 4, dtype=object))
    with pytest.raises(ValueError, match=r"train\.npz: array 'y' cannot be read"):
        load_npz_dir(tmp_path)
    _write(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    _write(tmp_path / "test.npz", x=np.zeros((4, 3)), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match=r"test\.npz: array 'x' has examples of shape \(3,\)"):
        load_npz_dir(tmp_path)
    (tmp_path / "test.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"test\.npz: not a readable \.npz archive"):
        load_npz_dir(tmp_path)


def test_data_seed_fixes_the_data_set_whatever_the_run_seed() -> None:
    base = {"dataset": "synthetic", "partition": "natural", "num_clients": 8, "client_index": 3, "data_seed": 11}
    a = load_client_data(DataConfig(seed=1, **base))
    b = load_client_data(DataConfig(seed=2, **base))
    c = load_client_data(DataConfig(seed=11, dataset="synthetic", partition="natural", num_clients=8, client_index=3))
    for d in (b, c):
        assert np.array_equal(a.train.x, d.train.x) and np.array_equal(a.test.y, d.test.y)


def test_synthetic_random_split_is_fl4health_64_16_20() -> None:
    cfg = DataConfig(dataset="synthetic", partition="natural", num_clients=8, client_index=0, seed=4,
                     split="random", validation_fraction=0.2)
    data = load_client_data(cfg)
    assert (len(data.train), len(data.test)) == (3200, 1000)  # 5,000 rows: 20% test, then 20% of 4,000 aside
    full = load_client_data(DataConfig(dataset="synthetic", partition="natural", num_clients=8, client_index=0,
                                       seed=4, split="random"))
    assert len(full.train) == 4000 and np.array_equal(full.test.x, data.test.x)
    rows = {r.tobytes() for r in full.train.x}
    assert all(r.tobytes() in rows for r in data.train.x)  # the training rows are a subset; the test rows are kept
    with pytest.raises(ValueError, match="synthetic"):
        DataConfig(dataset="digits", split="random")
    with pytest.raises(ValueError, match="validation_fraction"):
        DataConfig(dataset="synthetic", partition="natural", validation_fraction=0.95)
