"""An organization's data for hetfed: a Fashion-MNIST image tree on disk and the data factory that reads it.

:func:`write_fashion_folder` turns Debian's Fashion-MNIST idx files (``apt-get install dataset-fashion-mnist``)
into a directory of PNGs, ``OUT/train/<class>/<index>.png`` and ``OUT/test/<class>/<index>.png``, the layout
hetfed's built-in ``imagefolder`` dataset also reads. Class directories are named ``0-t_shirt_top`` ...
``9-ankle_boot`` so that sorting them gives Fashion-MNIST's label order.

:func:`fashion_folder` is the data factory (``--data factory=hetfed_example.data:fashion_folder --data
path=OUT``). It lists file names only; pixels are read one image at a time when hetfed's DataLoader asks.
Each organization keeps its share of the training files under a seeded Dirichlet(alpha) label skew, a test set
with the same label mix, and the shared seed set FedH2L needs. This module does not import hetfed except for
``SeedSet``, imported when the factory runs.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["CLASSES", "PngFolder", "fashion_folder", "read_idx", "write_fashion_folder"]

CLASSES = ("0-t_shirt_top", "1-trouser", "2-pullover", "3-dress", "4-coat", "5-sandal", "6-shirt", "7-sneaker",
           "8-bag", "9-ankle_boot")
"""Class directory names in Fashion-MNIST's label order (sorted, they give labels 0..9)."""

SOURCE_DIR = "/usr/share/datasets/fashion-mnist"
SOURCE_ENV = "HETFED_FASHION_MNIST_DIR"  # the same variable hetfed's built-in fmnist reads
INSTALL_HINT = "apt-get install dataset-fashion-mnist"
IDX_PREFIX = {"train": "train", "test": "t10k"}

# Factory options (context.options, strings) and their defaults.
DEFAULT_ALPHA = "0.5"  # Dirichlet concentration of the label skew: smaller is more skewed
DEFAULT_PUBLIC_PER_CLASS = "10"  # seed-set images per class, taken from the test tree
DEFAULT_MIN_PER_CLIENT = "10"  # least training images an organization may be dealt
_STREAM_PARTITION, _STREAM_TEST = 1, 2  # numpy streams: np.random.default_rng((seed, stream))
_MAX_DRAWS = 1000


def source_dir() -> Path:
    """Where the idx files are read from: ``$HETFED_FASHION_MNIST_DIR``, else Debian's directory."""
    return Path(os.environ.get(SOURCE_ENV) or SOURCE_DIR)


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzipped or not) as a uint8 array of the shape its header declares."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an idx file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    header = 4 + 4 * ndim
    if len(raw) != header + int(np.prod(shape)):
        raise ValueError(f"{path}: {len(raw)} bytes, but its header {list(shape)} needs {header + int(np.prod(shape))}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _idx_file(directory: Path, name: str) -> Path:
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{directory / name}[.gz] not found: Fashion-MNIST is not installed; install it with: "
                            f"{INSTALL_HINT} (or point ${SOURCE_ENV} at a directory holding the idx files)")


def write_fashion_folder(out_dir: str | Path, *, per_class: int | None = None,
                         splits: Sequence[str] = ("train", "test"), source: str | Path | None = None) -> dict[str, int]:
    """Write ``out_dir/<split>/<class>/<index>.png`` from the idx files; return the images written per split.

    ``per_class`` keeps the first N images of each class of each split (in file order, so the tree is the same
    every time); ``None`` writes them all. ``<index>`` is the image's position in its idx file.
    """
    from PIL import Image

    if per_class is not None and per_class < 1:
        raise ValueError(f"per_class must be at least 1, got {per_class}")
    directory = Path(source) if source is not None else source_dir()
    written: dict[str, int] = {}
    for split in splits:
        if split not in IDX_PREFIX:
            raise ValueError(f"split must be one of {', '.join(IDX_PREFIX)}, got {split!r}")
        images = read_idx(_idx_file(directory, f"{IDX_PREFIX[split]}-images-idx3-ubyte"))
        labels = read_idx(_idx_file(directory, f"{IDX_PREFIX[split]}-labels-idx1-ubyte"))
        if images.ndim != 3 or labels.shape != images.shape[:1]:
            raise ValueError(f"{directory}: {split} images {images.shape} and labels {labels.shape} do not match")
        count = 0
        for label, name in enumerate(CLASSES):
            target = Path(out_dir) / split / name
            target.mkdir(parents=True, exist_ok=True)
            for index in np.flatnonzero(labels == label)[:per_class]:
                Image.fromarray(images[index]).save(target / f"{index:05d}.png")
                count += 1
        written[split] = count
    return written


class PngFolder(Dataset[tuple[torch.Tensor, int]]):
    """Image files and their labels; ``ds[i]`` reads file i as a float32 tensor (C, H, W) in [0, 1]."""

    def __init__(self, files: Sequence[str], targets: np.ndarray, mode: str) -> None:
        self.files = list(files)
        self.targets = np.asarray(targets, dtype=np.int64)  # all labels, so hetfed need not read the images
        self.mode = mode  # Pillow mode: "L" (one channel) or "RGB"

    def __len__(self) -> int:
        """Number of images."""
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Image ``index`` and its label."""
        return torch.from_numpy(self.pixels(index).astype(np.float32) / np.float32(255.0)), int(self.targets[index])

    def pixels(self, index: int) -> np.ndarray:
        """Image ``index`` as uint8 (C, H, W)."""
        from PIL import Image

        with Image.open(self.files[index]) as im:
            a = np.asarray(im.convert(self.mode), dtype=np.uint8)
        return np.ascontiguousarray(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))


def _list(root: Path) -> tuple[list[str], list[list[str]]]:
    """(class names, sorted files of each class) under ``root/<class>/``."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (write the tree with: python -m "
                                "hetfed_example.write_folder OUT)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    files = [sorted(str(root / c / f) for f in os.listdir(root / c) if f.lower().endswith(".png")) for c in classes]
    empty = [c for c, fs in zip(classes, files, strict=True) if not fs]
    if not classes or empty:
        raise ValueError(f"{root}: needs a directory of PNGs per class; empty: {empty or 'no class directories'}")
    return classes, files


def dirichlet_split(labels: np.ndarray, parts: int, alpha: float, min_size: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of ``labels`` dealt to ``parts`` owners: per class, shares drawn from Dirichlet(alpha), redrawn
    until every owner holds at least ``min_size``. Disjoint and covering; sorted within each part."""
    for _ in range(_MAX_DRAWS):
        owned: list[list[np.ndarray]] = [[] for _ in range(parts)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = np.round(np.cumsum(rng.dirichlet(np.full(parts, alpha)))[:-1] * idx.size).astype(int)
            for owner, chunk in enumerate(np.split(idx, cuts)):
                owned[owner].append(chunk)
        out = [np.sort(np.concatenate(o)) for o in owned]
        if min(o.size for o in out) >= min_size:
            return out
    raise ValueError(f"no Dirichlet(alpha={alpha:g}) split of {labels.size} images among {parts} organizations gives "
                     f"each at least {min_size}: write more images per class or lower min_per_client")


def _split_like(labels: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of ``labels`` dealt to owners so that owner i gets share ``shares[i, c]`` of class c."""
    owned: list[list[np.ndarray]] = [[] for _ in range(shares.shape[0])]
    for c in range(shares.shape[1]):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.round(np.cumsum(shares[:, c])[:-1] * idx.size).astype(int)
        for owner, chunk in enumerate(np.split(idx, cuts)):
            owned[owner].append(chunk)
    return [np.sort(np.concatenate(o)) for o in owned]


def _rotate(items: list[np.ndarray], k: int) -> list[np.ndarray]:
    """``items`` rotated right by ``k`` places."""
    k %= len(items)
    return items[len(items) - k:] + items[:len(items) - k]


def _option(options: Mapping[str, str], name: str, default: str, kind: type) -> Any:
    raw = options.get(name, default)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"data option {name}={raw!r} is not a {kind.__name__}") from None


def fashion_folder(context: Any) -> dict[str, Any]:
    """hetfed data factory: this organization's share of the tree at ``context.path`` (train/ and test/).

    ``context.options``: ``alpha`` (Dirichlet label skew, default 0.5), ``public_per_class`` (seed-set images
    per class from the test tree, default 10), ``min_per_client`` (default 10), ``full_test`` ("1": also
    evaluate on every test image outside the seed set, reported as ``full_test_accuracy``; default "0").
    Returns the train and test sets (the test set with the train set's label mix), the FedH2L seed set and
    ``domain``.
    """
    from hetfed.client.data import SeedSet

    if not context.path:
        raise ValueError("fashion_folder needs data.path: the directory holding train/ and test/")
    root, i, m = Path(context.path), int(context.client_index), int(context.num_clients)
    alpha = _option(context.options, "alpha", DEFAULT_ALPHA, float)
    per_class = _option(context.options, "public_per_class", DEFAULT_PUBLIC_PER_CLASS, int)
    min_size = _option(context.options, "min_per_client", DEFAULT_MIN_PER_CLIENT, int)
    if alpha <= 0 or per_class < 1:
        raise ValueError(f"fashion_folder needs alpha > 0 and public_per_class >= 1, got {alpha} and {per_class}")
    classes, train_files = _list(root / "train")
    test_classes, test_files = _list(root / "test")
    if test_classes != classes:
        raise ValueError(f"{root}: test/ has classes {test_classes}, train/ has {classes}")
    if min(len(fs) for fs in test_files) <= per_class:
        raise ValueError(f"{root / 'test'}: every class needs more than public_per_class={per_class} images")
    first = train_files[0][0]
    from PIL import Image

    with Image.open(first) as im:
        mode = "L" if im.mode in ("1", "L", "LA", "I", "I;16") else "RGB"
    # The seed set: the first public_per_class test images of each class, dealt out in equal parts to the
    # organizations (part d holds a slice of every class; the larger slices rotate) and stored grouped by part.
    chunks = [_rotate(np.array_split(np.array(fs[:per_class]), m), c) for c, fs in enumerate(test_files)]
    public_files = [str(f) for d in range(m) for c in range(len(classes)) for f in chunks[c][d]]
    public_labels = np.array([c for d in range(m) for c in range(len(classes)) for _ in chunks[c][d]], dtype=np.int64)
    domains = np.array([d for d in range(m) for c in range(len(classes)) for _ in chunks[c][d]], dtype=np.int64)
    if np.unique(domains).size != m:
        raise ValueError(f"public_per_class={per_class} x {len(classes)} classes is too few for {m} organizations")
    public = PngFolder(public_files, public_labels, mode)
    seed_set = SeedSet(f"fashion_folder[{root.name}, {per_class} per class, {m} parts]",
                       np.stack([public.pixels(j) for j in range(len(public))]), public_labels, domains)
    # Training files: a Dirichlet label skew, the same draw in every organization (same seed), this one's part.
    train = PngFolder([f for fs in train_files for f in fs],
                      np.concatenate([np.full(len(fs), c) for c, fs in enumerate(train_files)]), mode)
    parts = dirichlet_split(train.targets, m, alpha, min_size, np.random.default_rng((context.seed, _STREAM_PARTITION)))
    # Test files (seed set left out): each class dealt in the organizations' shares of that class's training data.
    test = PngFolder([f for fs in test_files for f in fs[per_class:]],
                     np.concatenate([np.full(len(fs) - per_class, c) for c, fs in enumerate(test_files)]), mode)
    counts = np.stack([np.bincount(train.targets[p], minlength=len(classes)) for p in parts]).astype(np.float64)
    shares = counts / np.maximum(counts.sum(axis=0, keepdims=True), 1)
    test_parts = _split_like(test.targets, shares, np.random.default_rng((context.seed, _STREAM_TEST)))
    if test_parts[i].size == 0:
        raise ValueError(f"organization {i}'s label mix leaves it no test images: write more test images per class")
    full_test = _option(context.options, "full_test", "0", int)
    return {
        "train": PngFolder([train.files[j] for j in parts[i]], train.targets[parts[i]], mode),
        "test": PngFolder([test.files[j] for j in test_parts[i]], test.targets[test_parts[i]], mode),
        "eval": {"full_test": test} if full_test else {},
        "num_classes": len(classes),
        "seed_set": seed_set,
        "domain": i,
        "name": f"fashion_folder[{root.name}, dirichlet alpha={alpha:g}, seed={context.seed}, org {i} of {m}]",
    }
