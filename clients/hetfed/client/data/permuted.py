"""Permuted labels (label heterogeneity, SimFed paper §3.2 and §5.1): each organization names the classes its own way.

Organization k sees class c under the label ψ_k(c), a permutation of 0..C-1 drawn from the data seed and k
alone, so every organization derives its own permutation and nothing about it crosses the wire. It is
applied to the organization's train set, own test set and every further held-out set alike (they are all
read through this organization's head). With partition "iid" this is the paper's "Permuted IID", with
"dirichlet" (α = 0.5) its "Permuted Non-IID". A federation that averages heads then mixes classifiers
that disagree on what each output means.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hetfed.client.data.core import ArrayDataset, ClientData, Examples, StreamedDataset

# Stream of the data seed that draws the label permutations (independent of the partition's streams).
STREAM_PERMUTATION = 0x5EF


def label_permutation(seed: int, organization: int, num_classes: int) -> np.ndarray:
    """ψ_k as an int64 array: class c is labelled ψ_k[c]; a function of (seed, organization) only."""
    if seed < 0 or organization < 0 or num_classes < 1:
        raise ValueError(
            f"need seed >= 0, organization >= 0, num_classes >= 1; got {seed}, {organization}, {num_classes}"
        )
    rng = np.random.default_rng([int(seed), STREAM_PERMUTATION, int(organization)])
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


class _Relabelled:
    """A streamed dataset whose labels go through ψ as each example is read (map-style)."""

    def __init__(self, dataset: Any, perm: np.ndarray) -> None:
        self.dataset, self.perm = dataset, perm
        self.targets = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        x, y = self.dataset[i]
        return x, int(self.perm[int(y)])


def _relabel(data: Examples, perm: np.ndarray) -> Examples:
    if isinstance(data, StreamedDataset):
        return StreamedDataset(_Relabelled(data.dataset, perm), permute_labels(data.y, perm), data.input_shape,
                               data.name, data.groups)
    return ArrayDataset(data.x, permute_labels(data.y, perm), data.domain, data.groups)


def permuted(data: ClientData, seed: int, organization: int) -> ClientData:
    """``data`` with organization ``organization``'s labels permuted consistently in every split it holds."""
    perm = label_permutation(seed, organization, data.num_classes)
    return dataclasses.replace(
        data,
        train=_relabel(data.train, perm),
        test=_relabel(data.test, perm),
        global_test=None if data.global_test is None else _relabel(data.global_test, perm),
        cross_test=None if data.cross_test is None else _relabel(data.cross_test, perm),
        extra_eval={name: _relabel(ds, perm) for name, ds in data.extra_eval.items()},
        name=f"{data.name}, labels permuted",
    )
