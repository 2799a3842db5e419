"""An organization's own images: a directory per class, read through Pillow one image at a time.

``data.path`` holds either ``train/<class>/…`` (and optionally ``test/<class>/…``) or ``<class>/…``
directly. Listing the tree reads file names (and, with ``verify_images``, each file's header), never
pixels: training streams batches through a DataLoader (:mod:`hetfed.client.training`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import (
    HOLDOUT_FRACTION,
    STREAM_HOLDOUT,
    STREAM_PARTITION,
    STREAM_TEST_SPLIT,
    ClientData,
    DatasetUnavailableError,
    StreamedDataset,
)
from hetfed.client.data.factory import DataFactoryError, describe_exception
from hetfed.client.data.partitions import (
    class_proportions,
    dirichlet_partition,
    iid_partition,
    split_like,
    stratified_holdout,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
"""File name endings read as images (compared in lower case); other files are ignored."""

# Pillow modes read as one channel when data.channels is 0; every other mode is read as RGB.
_GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})
# Modes holding more than 8 bits per pixel: scaled by 65535 (Pillow's conversion to "L" would clip them).
_WIDE_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


class ImageFolderError(DataFactoryError):
    """An organization's image directory cannot be used (the message names the directory or file)."""


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """Images under ``root/<class>/`` as float32 tensors (C, H, W) in [0, 1], normalised when asked, with their labels.

    Classes are the sorted names of ``root``'s directories (labels 0..K-1), or ``classes`` when given, which
    the directories must then match. ``targets``, ``classes`` and ``files`` are known after listing alone.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        classes: Sequence[str] | None = None,
        channels: int = 0,
        image_size: int = 0,
        mean: Sequence[float] = (),
        std: Sequence[float] = (),
        verify: bool = True,
    ) -> None:
        self.root = Path(root)
        self.classes, self.files, self.targets = list_images(self.root, classes)
        self.image_size = int(image_size)
        self.channels = channels or _channels_of(self.files[0])
        if len(mean) != len(std) or (mean and len(mean) != self.channels):
            raise ImageFolderError(f"{self.root}: data.mean and data.std need one value per channel "
                                   f"({self.channels}), got {len(mean)} and {len(std)}")
        self.mean = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(std, dtype=np.float32).reshape(-1, 1, 1)
        if verify:
            _verify_headers(self.files, same_size=not self.image_size)
        self.input_shape: tuple[int, ...] = ()
        self.input_shape = tuple(int(s) for s in self._read(0).shape)

    def __len__(self) -> int:
        """Number of images."""
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Image ``index`` as a float32 tensor (C, H, W) and its label."""
        x = self._read(index)
        if x.shape != self.input_shape:
            raise ImageFolderError(f"{self.files[index]}: read as shape {x.shape} but {self.files[0]} as "
                                   f"{self.input_shape}; set data.image_size to resize every image")
        return torch.from_numpy(x), int(self.targets[index])

    def _read(self, index: int) -> np.ndarray:
        from PIL import Image

        file = self.files[index]
        try:
            with Image.open(file) as im:
                if im.mode in _WIDE_MODES:
                    planes = [np.clip(np.asarray(im, dtype=np.float32) / np.float32(65535.0), 0.0, 1.0)]
                    planes = [self._resized_plane(p) for p in planes] * self.channels
                    x = np.stack(planes)
                else:
                    img = im.convert("L" if self.channels == 1 else "RGB")
                    if self.image_size:
                        img = img.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
                    a = np.asarray(img, dtype=np.float32) / np.float32(255.0)
                    x = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
            raise ImageFolderError(f"{file}: cannot decode image ({describe_exception(exc)})") from exc
        if self.mean.size:
            x = (x - self.mean) / self.std
        return np.ascontiguousarray(x, dtype=np.float32)

    def _resized_plane(self, plane: np.ndarray) -> np.ndarray:
        from PIL import Image

        if not self.image_size:
            return plane
        img = Image.fromarray(plane).resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        return np.asarray(img, dtype=np.float32)


def list_images(root: Path, classes: Sequence[str] | None = None) -> tuple[list[str], list[str], np.ndarray]:
    """(classes, files, labels) of the images under ``root/<class>/`` (sorted; subdirectories included)."""
    if not root.is_dir():
        raise ImageFolderError(f"{root}: not a directory; data.path should hold a directory per class "
                               "(or train/ and test/ holding them)")
    found = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not found:
        raise ImageFolderError(f"{root}: no class directories (expected {root}/<class>/<image>.png)")
    if classes is not None and found != list(classes):
        missing = sorted(set(classes) - set(found))
        extra = sorted(set(found) - set(classes))
        raise ImageFolderError(f"{root}: class directories differ from the training set's: "
                               f"missing {missing or 'none'}, extra {extra or 'none'}")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(found):
        images = _images_under(root / name)
        if not images:
            raise ImageFolderError(f"{root / name}: class directory holds no images "
                                   f"({', '.join(IMAGE_SUFFIXES)})")
        files.extend(images)
        labels.extend([label] * len(images))
    return found, files, np.asarray(labels, dtype=np.int64)


def load_imagefolder(cfg: DataConfig) -> ClientData:
    """This organization's images from ``cfg.path``, whole (partition natural) or its share (iid, dirichlet)."""
    if importlib.util.find_spec("PIL") is None:
        raise DatasetUnavailableError("dataset 'imagefolder' reads images with Pillow, which is not installed; "
                                      "install the client extra: pip install 'hetfed[client]'")
    assert cfg.path is not None  # guaranteed by DataConfig
    root = Path(cfg.path)
    train_dir, test_dir = _layout(root)
    train_set = ImageFolder(train_dir, channels=cfg.channels, image_size=cfg.image_size, mean=cfg.mean,
                            std=cfg.std, verify=cfg.verify_images)
    shape = train_set.input_shape
    train = StreamedDataset(train_set, train_set.targets, shape, name=f"imagefolder[{train_dir}]")
    test: StreamedDataset | None = None
    if test_dir is not None:
        test_set = ImageFolder(test_dir, classes=train_set.classes, channels=train_set.channels,
                               image_size=cfg.image_size, mean=cfg.mean, std=cfg.std, verify=cfg.verify_images)
        if test_set.input_shape != shape:
            raise ImageFolderError(f"{test_dir}: images read as shape {test_set.input_shape} but {train_dir}'s as "
                                   f"{shape}; set data.image_size to resize every image")
        test = StreamedDataset(test_set, test_set.targets, shape, name=f"imagefolder[{test_dir}]")
    num_classes = len(train_set.classes)
    i, m = cfg.client_index, cfg.num_clients
    if cfg.partition == "natural":
        if test is None:
            keep, hold = stratified_holdout(train.y, HOLDOUT_FRACTION, (cfg.seed, STREAM_HOLDOUT, i))
            train, test = train.subset(keep), _nonempty(train.subset(hold), root)
        return ClientData(train=train, test=test, global_test=None, num_classes=num_classes, input_shape=shape,
                          name=f"imagefolder[{root.name}]")
    if test is None:  # one pool held out for the whole federation, as for the built-in image sets
        keep, hold = stratified_holdout(train.y, HOLDOUT_FRACTION, (cfg.seed, STREAM_HOLDOUT))
        train, test = train.subset(keep), _nonempty(train.subset(hold), root)
    if cfg.partition == "iid":
        if len(train) < m * max(cfg.min_per_client, 1) or len(test) < m:
            raise ImageFolderError(f"{root}: data.num_clients={m} with data.min_per_client={cfg.min_per_client} "
                                   f"needs more than {len(train)} training and {len(test)} test images")
        parts = iid_partition(len(train), m, (cfg.seed, STREAM_PARTITION))
        test_parts = iid_partition(len(test), m, (cfg.seed, STREAM_TEST_SPLIT))
        detail = "iid"
    else:
        parts = dirichlet_partition(train.y, m, cfg.alpha, cfg.min_per_client, (cfg.seed, STREAM_PARTITION),
                                    sampling_ratio=cfg.sampling_ratio)
        props = class_proportions(train.y, parts, num_classes)
        test_parts = split_like(test.y, props, (cfg.seed, STREAM_TEST_SPLIT), mode=cfg.test_split)
        detail = f"dirichlet alpha={cfg.alpha:g}" + (f" ratio={cfg.sampling_ratio:g}" if cfg.sampling_ratio < 1 else "")
    return ClientData(
        train=train.subset(parts[i]),
        test=test.subset(test_parts[i]),
        global_test=test,
        num_classes=num_classes,
        input_shape=shape,
        name=f"imagefolder[{root.name}, {detail}, seed={cfg.seed}, client {i} of {m}]",
    )


def _layout(root: Path) -> tuple[Path, Path | None]:
    """(train directory, test directory or None): ``root/train`` and ``root/test`` when ``train`` exists."""
    train = root / "train"
    if not train.is_dir():
        return root, None
    test = root / "test"
    return train, test if test.is_dir() else None


def _images_under(directory: Path) -> list[str]:
    out: list[str] = []
    for top, dirs, names in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(os.path.join(top, n) for n in sorted(names)
                   if not n.startswith(".") and n.lower().endswith(IMAGE_SUFFIXES))
    return out


def _channels_of(file: str) -> int:
    from PIL import Image

    try:
        with Image.open(file) as im:
            mode = im.mode
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise ImageFolderError(f"{file}: not a readable image ({describe_exception(exc)})") from exc
    return 1 if mode in _GREY_MODES else 3


def _verify_headers(files: Sequence[str], *, same_size: bool) -> None:
    """Open every file's header (no pixels decoded); with ``same_size`` every image must have the first's size."""
    from PIL import Image

    first: tuple[int, int] | None = None
    for file in files:
        try:
            with Image.open(file) as im:
                size = im.size
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
            raise ImageFolderError(f"{file}: not a readable image ({describe_exception(exc)})") from exc
        if first is None:
            first = size
        elif same_size and size != first:
            raise ImageFolderError(f"{file}: {size[0]}x{size[1]} pixels but {files[0]} has {first[0]}x{first[1]}; "
                                   "set data.image_size to resize every image")


def _nonempty(test: StreamedDataset, root: Path) -> StreamedDataset:
    if len(test) == 0:
        raise ImageFolderError(f"{root}: too few images per class to hold out a test set; add {root}/test/<class>/")
    return test

