"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package: the four idx files, checked, never downloaded.

The package installs ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``
and ``t10k-labels-idx1-ubyte.gz`` under ``/usr/share/datasets/fashion-mnist/`` (60,000 training and 10,000 test
images, 28×28, 10 classes). Gzipped and raw files are both accepted. The 60,000 training images are split among
the organizations (IID or Dirichlet); each organization's own test set is cut from the 10,000 test images the
same way as for mnist5k (``test_split``), and a balanced 1,000-image subset of them is the shared ``global_test``.
"""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import (
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
    train_subsample,
)

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
# Environment variable naming another directory holding the four files (tests, or a copy elsewhere).
DIR_ENV = "HETFED_FASHION_MNIST_DIR"
INSTALL_HINT = "apt-get install dataset-fashion-mnist"
IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
SIDE = 28
NUM_CLASSES = 10
# Images per class of the test set kept as the shared global_test (1,000 images: evaluated every round).
GLOBAL_TEST_PER_CLASS = 100
SPLITS = ("train", "t10k")


def data_dir() -> Path:
    """Where the idx files are read from: ``$HETFED_FASHION_MNIST_DIR``, else Debian's directory."""
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


def _find(directory: Path, name: str) -> Path:
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    if not directory.is_dir():
        raise DatasetUnavailableError(f"dataset 'fmnist': {directory} not found; install it with: {INSTALL_HINT}")
    raise DatasetUnavailableError(f"dataset 'fmnist': {directory / name}[.gz] not found; reinstall it with: "
                                  f"{INSTALL_HINT}")


def _read_bytes(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, OSError, gzip.BadGzipFile) as exc:
        raise DatasetUnavailableError(f"{path}: truncated or corrupt gzip file ({exc}); reinstall it with: "
                                      f"{INSTALL_HINT}") from exc


def read_idx(path: Path, magic: int) -> np.ndarray:
    """One idx file as a uint8 array of the shape its header declares; magic number and size checked."""
    raw = _read_bytes(path)
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetUnavailableError(f"{path}: truncated: {len(raw)} bytes, shorter than the {header}-byte header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise DatasetUnavailableError(f"{path}: magic number 0x{found:08x}, expected 0x{magic:08x}: not an idx file "
                                      "of this kind")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "too long"
        raise DatasetUnavailableError(f"{path}: {what}: {len(raw)} bytes, the header {list(shape)} needs "
                                      f"{expected}; reinstall it with: {INSTALL_HINT}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def read_split(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 28, 28], labels int64 [N]) of ``train`` or ``t10k``, checked against each other."""
    images_path = _find(directory, f"{split}-images-idx3-ubyte")
    labels_path = _find(directory, f"{split}-labels-idx1-ubyte")
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if images.shape[1:] != (SIDE, SIDE):
        raise DatasetUnavailableError(f"{images_path}: images of {list(images.shape[1:])}, expected [{SIDE}, {SIDE}]")
    if labels.shape[0] != images.shape[0]:
        raise DatasetUnavailableError(f"{labels_path}: {labels.shape[0]} labels for the {images.shape[0]} images "
                                      f"of {images_path}")
    if labels.size and labels.max() >= NUM_CLASSES:
        raise DatasetUnavailableError(f"{labels_path}: label {labels.max()} outside 0..{NUM_CLASSES - 1}")
    return images, labels.astype(np.int64)


@functools.lru_cache(maxsize=2)
def load_fashion_mnist(directory: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Both splits of the files in ``directory`` as uint8 images and int64 labels (read-only, cached)."""
    out = {}
    for split in SPLITS:
        x, y = read_split(Path(directory), split)
        x.flags.writeable = False
        y.flags.writeable = False
        out[split] = (x, y)
    return out


def check_available() -> None:
    """Raise DatasetUnavailableError (one line, with the install command) unless the four files are there."""
    directory = data_dir()
    for split in SPLITS:
        for kind in ("images-idx3", "labels-idx1"):
            _find(directory, f"{split}-{kind}-ubyte")


def _images(x: np.ndarray, idx: np.ndarray, y: np.ndarray) -> ArrayDataset:
    """The images at ``idx`` as float32 in [0, 1], one channel (only the chosen ones are converted)."""
    sel = x[idx].astype(np.float32) / np.float32(255.0)
    return ArrayDataset(sel.reshape(-1, 1, SIDE, SIDE), y[idx])


def global_test_indices(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """A balanced subset of the test images: ``per_class`` of each class (fewer if it has fewer), from the seed."""
    rng = np.random.default_rng((seed, STREAM_HOLDOUT))
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in range(NUM_CLASSES)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def load_fmnist(cfg: DataConfig) -> ClientData:
    """This organization's share of Fashion-MNIST under ``cfg``'s partition (``iid`` or ``dirichlet``)."""
    splits = load_fashion_mnist(str(data_dir()))
    (x_train, y_train), (x_test, y_test) = splits["train"], splits["t10k"]
    if cfg.train_size:
        keep = train_subsample(y_train, cfg.train_size, (cfg.seed, STREAM_SUBSAMPLE), "training images of 'fmnist'")
        x_train, y_train = x_train[keep], y_train[keep]
    m = cfg.num_clients
    if cfg.partition == "iid":
        if y_train.size < m * max(cfg.min_per_client, 1):
            raise ValueError(f"data.num_clients={m} with data.min_per_client={cfg.min_per_client} needs more than "
                             f"the {y_train.size} training images of 'fmnist'")
        parts = iid_partition(y_train.size, m, (cfg.seed, STREAM_PARTITION))
        test_parts = iid_partition(y_test.size, m, (cfg.seed, STREAM_TEST_SPLIT))
        detail = "iid"
    else:
        parts = dirichlet_partition(y_train, m, cfg.alpha, cfg.min_per_client, (cfg.seed, STREAM_PARTITION),
                                    sampling_ratio=cfg.sampling_ratio)
        props = class_proportions(y_train, parts, NUM_CLASSES)
        test_parts = split_like(y_test, props, (cfg.seed, STREAM_TEST_SPLIT), mode=cfg.test_split)
        detail = f"dirichlet alpha={cfg.alpha:g}" + (f" ratio={cfg.sampling_ratio:g}" if cfg.sampling_ratio < 1 else "")
    if cfg.train_size:
        detail += f", {cfg.train_size} training images"
    i = cfg.client_index
    return ClientData(
        train=_images(x_train, parts[i], y_train),
        test=_images(x_test, test_parts[i], y_test),
        global_test=_images(x_test, global_test_indices(y_test, GLOBAL_TEST_PER_CLASS, cfg.seed), y_test),
        num_classes=NUM_CLASSES,
        input_shape=(1, SIDE, SIDE),
        name=f"fmnist[{detail}, seed={cfg.seed}, client {i} of {m}]",
    )
