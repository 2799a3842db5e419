"""Pure partition functions: which examples each organization holds (numpy only, seeded)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetfed.client.data.core import Seed, as_labels, check_choice, sorted_concat

TEST_SPLITS: tuple[str, ...] = ("proportional", "fedgen")


def class_counts(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Number of examples of each class 0..num_classes-1, as int64."""
    labels = np.asarray(y)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    return np.bincount(labels.astype(np.int64), minlength=num_classes).astype(np.int64)


def stratified_holdout(labels: np.ndarray, fraction: float, seed: Seed) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (kept, held_out), holding out round(fraction x n_c) random examples of each class c."""
    y = as_labels(labels)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    kept: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_hold = math.floor(fraction * idx.size + 0.5)
        if fraction > 0.0 and idx.size >= 2:
            n_hold = min(max(n_hold, 1), idx.size - 1)  # keep at least one example on each side
        held.append(idx[:n_hold])
        kept.append(idx[n_hold:])
    return sorted_concat(kept), sorted_concat(held)


def stratified_subsample(labels: np.ndarray, n: int, seed: Seed) -> np.ndarray:
    """Sorted indices of ``n`` examples keeping the classes' shares: class c gives floor(n · n_c / N) of its
    examples, and the examples left over go one each to the largest remainders (ties to the lower class); which
    examples of a class is drawn at random from the seed."""
    y = as_labels(labels)
    if not 1 <= n <= y.size:
        raise ValueError(f"a subsample of {n} examples needs 1 <= n <= {y.size} (the examples there are)")
    classes, counts = np.unique(y, return_counts=True)
    quota = n * counts / y.size
    take = np.floor(quota).astype(np.int64)
    take[np.argsort(-(quota - take), kind="stable")[: n - int(take.sum())]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(y == c))[: int(k)] for c, k in zip(classes, take, strict=True)]
    return sorted_concat(chosen)


def train_subsample(labels: np.ndarray, train_size: int, seed: Seed, what: str) -> np.ndarray:
    """``data.train_size``'s subsample of a training split (:func:`stratified_subsample`); ``what`` names the split
    in the error when it holds fewer than ``train_size`` ("training images of 'fmnist'")."""
    y = as_labels(labels)
    if train_size > y.size:
        raise ValueError(f"data.train_size={train_size} is more than the {y.size} {what}")
    return stratified_subsample(y, train_size, seed)


def iid_partition(n: int, num_clients: int, seed: Seed) -> list[np.ndarray]:
    """Shuffle indices 0..n-1 and split them into num_clients near-equal sorted parts."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if n < num_clients:
        raise ValueError(f"cannot split {n} examples among {num_clients} clients")
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_clients)]


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    min_per_client: int,
    seed: Seed,
    *,
    sampling_ratio: float = 1.0,
    max_retries: int = 10_000,
) -> list[np.ndarray]:
    """Split indices among clients with per-class proportions drawn from Dir(alpha) (FedGen / NIID-bench style).

    Classes are visited in a random order; for each, proportions p ~ Dir(alpha·1) over clients are drawn,
    clients that already hold at least cap = sampling_ratio · n / num_clients examples get p = 0 (the usual
    re-balancing), and the class's shuffled indices are cut at the cumulative proportions. The whole draw is
    repeated until every client holds at least ``min_per_client`` examples, at most ``max_retries`` times.

    ``sampling_ratio`` < 1 is FedGen's subsampling (``devide_train_data`` in
    data/Mnist/generate_niid_dirichlet.py:56-84 of zhuangdizhu/FedGen): only the first
    int(min(cap, int(sampling_ratio · n_c))) shuffled examples of class c are split, the rest are held by no
    client. At 1.0 nothing is dropped and the draw is the same as without the argument.
    """
    y = as_labels(labels)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not (0 < sampling_ratio <= 1):
        raise ValueError(f"sampling_ratio must be in (0, 1], got {sampling_ratio}")
    n = int(y.size)
    cap = sampling_ratio * n / num_clients
    kept = n if sampling_ratio == 1 else sum(
        int(min(cap, int(sampling_ratio * int(c)))) for c in np.bincount(y) if c)
    if kept < num_clients * max(min_per_client, 1):
        raise ValueError(
            f"cannot give each of {num_clients} clients at least {max(min_per_client, 1)} of {kept} examples"
            + (f" ({n} at sampling_ratio {sampling_ratio:g})" if kept != n else "")
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    by_class = {int(c): np.flatnonzero(y == c) for c in classes}
    for _ in range(max_retries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        counts = np.zeros(num_clients, dtype=np.int64)
        for c in rng.permutation(classes):
            idx = rng.permutation(by_class[int(c)])
            if sampling_ratio < 1:
                idx = idx[: int(min(cap, int(sampling_ratio * idx.size)))]
            p = np.nan_to_num(rng.dirichlet(np.full(num_clients, alpha)))
            open_ = counts < cap
            p = p * open_
            total = p.sum()
            p = p / total if total > 0 else open_ / open_.sum()
            cuts = (np.cumsum(p) * idx.size).astype(np.int64)[:-1]
            for i, part in enumerate(np.split(idx, cuts)):
                chunks[i].append(part)
                counts[i] += part.size
        if counts.min() >= min_per_client:
            return [sorted_concat(parts) for parts in chunks]
    raise ValueError(
        f"dirichlet_partition: no split of {n} examples among {num_clients} clients with alpha={alpha} gave every "
        f"client at least {min_per_client} examples in {max_retries} draws; raise data.alpha, or lower "
        "data.min_per_client or data.num_clients"
    )


def domain_partition(domain: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Give client i every index whose domain is i; domains >= num_clients are left out (e.g. a held-out target)."""
    d = as_labels(domain, what="domain")
    parts = [np.flatnonzero(d == i).astype(np.int64) for i in range(num_clients)]
    empty = [i for i, p in enumerate(parts) if p.size == 0]
    if empty:
        present = sorted(int(v) for v in np.unique(d))
        raise ValueError(f"domain partition: no examples with domain {empty} (domains present: {present})")
    return parts


def class_proportions(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Matrix P (num_classes x clients): the share of class k's examples that client i holds (rows sum to 1 or 0)."""
    y = as_labels(labels)
    counts = np.stack([class_counts(y[np.asarray(p, dtype=np.int64)], num_classes) for p in parts], axis=1)
    totals = counts.sum(axis=1, keepdims=True)
    props = np.zeros(counts.shape, dtype=np.float64)
    np.divide(counts, totals, out=props, where=totals > 0)
    return props


def split_like(
    pool_labels: np.ndarray, proportions: np.ndarray, seed: Seed, *, mode: str = "proportional"
) -> list[np.ndarray]:
    """Split a labelled pool (e.g. held-out test images) among clients following class→client proportions.

    ``proportions`` is a (num_classes x clients) matrix such as :func:`class_proportions` returns. In mode
    ``"proportional"`` client i receives about P[k, i] of the pool's class-k examples, and at least one whenever
    P[k, i] > 0 and the pool has enough of class k, so each client's test labels have the same support as its
    train labels. In mode ``"fedgen"`` (FedGen's reference code) every client with P[k, i] > 0 receives
    floor(n_k / clients) examples of class k. Pool examples of a class that no client holds are left out.
    """
    y = as_labels(pool_labels)
    p = np.asarray(proportions, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"proportions must be a (num_classes, num_clients) matrix, got shape {p.shape}")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("proportions must be finite and non-negative")
    check_choice("mode", mode, TEST_SPLITS)
    num_classes, num_clients = p.shape
    if y.size and y.max() >= num_classes:
        raise ValueError(f"pool label {y.max()} has no row in proportions of shape {p.shape}")
    rng = np.random.default_rng(seed)
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k in range(num_classes):
        idx = rng.permutation(np.flatnonzero(y == k))
        if idx.size == 0:
            continue
        if mode == "fedgen":
            counts = np.where(p[k] > 0, idx.size // num_clients, 0)
        else:
            counts = _allocate(idx.size, p[k])
        start = 0
        for i, c in enumerate(counts):
            chunks[i].append(idx[start : start + int(c)])
            start += int(c)
    return [sorted_concat(parts) for parts in chunks]


def _allocate(n: int, weights: np.ndarray) -> np.ndarray:
    """Integer counts summing to n (or 0 if no weight), about proportional to weights, >= 1 on the support if n allows."""
    support = weights > 0
    s = int(support.sum())
    if s == 0:
        return np.zeros(weights.size, dtype=np.int64)
    base = support.astype(np.int64) if s <= n else np.zeros(weights.size, dtype=np.int64)
    rest = n - int(base.sum())
    quota = weights / weights.sum() * rest
    floor = np.floor(quota).astype(np.int64)
    short = rest - int(floor.sum())
    # Largest remainders first; ties go to the lower client index (stable sort).
    order = np.argsort(-(quota - floor), kind="stable")
    floor[order[:short]] += 1
    counts: np.ndarray = base + floor
    return counts
