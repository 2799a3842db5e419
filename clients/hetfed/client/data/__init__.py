"""Datasets and federated partitions for the client runtime (numpy only).

Every client of a run calls :func:`load_client_data` with the same :class:`DataConfig` except
``client_index``; each computes the same global partition from ``seed`` and keeps its own part, so no
data and no partition ever crosses the wire. All randomness comes from ``np.random.default_rng`` seeded
by explicit arguments; the global numpy RNG is never used. The datasets and partitions are listed in
:mod:`hetfed.client.data.registry`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetfed.client.data.config import NORMALISABLE, DataConfig
from hetfed.client.data.core import (
    HOLDOUT_FRACTION,
    ArrayDataset,
    ClientData,
    DatasetUnavailableError,
    Examples,
    Seed,
    StreamedDataset,
)
from hetfed.client.data.factory import DataContext, DataFactoryError
from hetfed.client.data.npz import load_npz_dir
from hetfed.client.data.partitions import (
    TEST_SPLITS,
    class_counts,
    class_proportions,
    dirichlet_partition,
    domain_partition,
    iid_partition,
    split_like,
    stratified_holdout,
    stratified_subsample,
)
from hetfed.client.data.permuted import label_permutation, permute_labels, permuted
from hetfed.client.data.registry import DATASETS, DEFAULT_DATASET, PARTITIONS, resolve
from hetfed.client.data.seedset import SeedSet
from hetfed.client.data.synthetic import generate_synthetic

__all__ = [
    "DATASETS",
    "DEFAULT_DATASET",
    "HOLDOUT_FRACTION",
    "PARTITIONS",
    "TEST_SPLITS",
    "ArrayDataset",
    "ClientData",
    "DataConfig",
    "DataContext",
    "DataFactoryError",
    "DatasetUnavailableError",
    "Examples",
    "Seed",
    "SeedSet",
    "StreamedDataset",
    "class_counts",
    "class_proportions",
    "dirichlet_partition",
    "domain_partition",
    "generate_synthetic",
    "iid_partition",
    "label_permutation",
    "load_client_data",
    "load_npz_dir",
    "load_seed_set",
    "normalised",
    "permute_labels",
    "permuted",
    "split_like",
    "stratified_holdout",
    "stratified_subsample",
]


def load_client_data(cfg: DataConfig) -> ClientData:
    """This organization's train set, own test set and further held-out sets, as ``cfg`` describes."""
    if cfg.data_seed is not None:  # one fixed data set whatever the run's (training) seed
        cfg = dataclasses.replace(cfg, seed=cfg.data_seed)
    data: ClientData = resolve(DATASETS[cfg.dataset].partitions[cfg.partition].loader)(cfg)
    if cfg.mean and cfg.dataset in NORMALISABLE:
        data = normalised(data, cfg.mean, cfg.std)
    if not cfg.permute_labels:
        return data
    return permuted(data, cfg.seed, cfg.client_index % cfg.label_groups if cfg.label_groups else cfg.client_index)


def normalised(data: ClientData, mean: tuple[float, ...], std: tuple[float, ...]) -> ClientData:
    """``data`` with every array set's images mapped to (x - mean) / std per channel (float32, as torchvision's
    ``Normalize``); FedGen's loaders use mean 0.5 and std 0.5, pixels in [-1, 1]."""
    m = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(-1, 1, 1)

    def one(ds: Examples) -> Examples:
        if not isinstance(ds, ArrayDataset):
            raise TypeError(f"data.mean and data.std normalise arrays here, got {type(ds).__name__}")
        return dataclasses.replace(ds, x=(ds.x - m) / s)

    return dataclasses.replace(
        data, train=one(data.train), test=one(data.test),
        global_test=None if data.global_test is None else one(data.global_test),
        cross_test=None if data.cross_test is None else one(data.cross_test),
        extra_eval={k: one(v) for k, v in data.extra_eval.items()})


def load_seed_set(cfg: DataConfig) -> SeedSet | None:
    """The shared seed set every organization holds under ``cfg``'s partition (None if it provides none)."""
    if cfg.data_seed is not None:
        cfg = dataclasses.replace(cfg, seed=cfg.data_seed)
    ref = DATASETS[cfg.dataset].partitions[cfg.partition].seed_set
    return resolve(ref)(cfg) if ref else None  # type: ignore[no-any-return]
