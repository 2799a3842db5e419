"""Permuted-label partitions for SimFed (paper 004 §3.2, §5.1): PROTOTYPE, to move into the data package later.

Label heterogeneity: organization k sees class c under the label ψ_k(c), a permutation of 0..C-1 drawn
from the run seed and k alone, so every organization derives its own permutation without anything
crossing the wire, and applies it to its train, own-test and global-test labels alike ("Permuted IID"
with partition "iid", "Permuted Non-IID" with partition "dirichlet", α = 0.5 in the paper).

The functions here are pure numpy except :func:`permuted_client_data`, which wraps the existing
``hetfed.client.data.load_client_data`` (numpy too) without changing it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetfed.client.data import ArrayDataset, ClientData, DataConfig, load_client_data

# Stream of the run seed that draws the label permutations (independent of the data package's streams 1-5).
PERMUTATION_STREAM = 0x5EF


def label_permutation(seed: int, organization: int, num_classes: int) -> np.ndarray:
    """ψ_k as an int64 array: class c is labelled ψ_k[c]; a function of (seed, organization) only."""
    if seed < 0 or organization < 0 or num_classes < 1:
        raise ValueError(
            f"need seed >= 0, organization >= 0, num_classes >= 1; got {seed}, {organization}, {num_classes}"
        )
    rng = np.random.default_rng([int(seed), PERMUTATION_STREAM, int(organization)])
    return rng.permutation(num_classes).astype(np.int64)


def permute_labels(labels: np.ndarray, permutation: np.ndarray) -> np.ndarray:
    """ψ(y) for every label y (a new int64 array); labels outside the permutation's range are an error."""
    y = np.asarray(labels)
    perm = np.asarray(permutation, dtype=np.int64)
    if perm.ndim != 1 or not np.array_equal(np.sort(perm), np.arange(perm.size)):
        raise ValueError("permutation must hold each of 0..C-1 exactly once")
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= perm.size):
        raise ValueError(f"labels must be integers in [0, {perm.size})")
    return perm[y.astype(np.int64)]


def _relabel(data: ArrayDataset, perm: np.ndarray) -> ArrayDataset:
    return ArrayDataset(data.x, permute_labels(data.y, perm), data.domain)


def permuted_client_data(cfg: DataConfig) -> ClientData:
    """``load_client_data(cfg)`` with this organization's labels permuted consistently in every split."""
    data = load_client_data(cfg)
    perm = label_permutation(cfg.seed, cfg.client_index, data.num_classes)
    return dataclasses.replace(
        data,
        train=_relabel(data.train, perm),
        test=_relabel(data.test, perm),
        global_test=None if data.global_test is None else _relabel(data.global_test, perm),
        name=f"{data.name} with permuted labels",
    )
