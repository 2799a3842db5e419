"""The containers every loader fills, and the helpers they share (numpy only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetfed.client.data.seedset import SeedSet

Seed = int | tuple[int, ...]
"""Anything ``np.random.default_rng`` accepts as an entropy source: a non-negative int or a tuple of them."""

HOLDOUT_FRACTION = 0.2
"""Fraction of each class held out as test images (built-in image datasets, synthetic, npz without test.npz)."""

# Independent random streams derived from DataConfig.seed: np.random.default_rng((seed, stream, ...)).
STREAM_HOLDOUT = 1
STREAM_PARTITION = 2
STREAM_TEST_SPLIT = 3
STREAM_SYNTHETIC = 4
STREAM_SYNTHETIC_SPLIT = 5
STREAM_SUBSAMPLE = 6


class DatasetUnavailableError(RuntimeError):
    """A built-in dataset's files or package are not present in this environment."""


def as_groups(groups: object, n: int, what: str) -> np.ndarray:
    """``groups`` checked as one integer group id per example (a patient, a device, a site), as int64."""
    if hasattr(groups, "detach"):  # a torch tensor, without importing torch here
        groups = groups.detach().cpu().numpy()  # type: ignore[attr-defined]
    g = np.asarray(groups)
    if g.shape != (n,):
        raise ValueError(f"{what} must hold one group id per example, shape ({n},), got {g.shape}")
    if g.size and g.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {g.dtype}")
    return g.astype(np.int64)


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Examples as arrays: ``x`` float32 (images NxCxHxW, tabular NxF), ``y`` int64 labels, optional int64 domains
    and optional int64 group ids (``privacy.unit = "group"``: the examples of one patient, device or site)."""

    x: np.ndarray
    y: np.ndarray
    domain: np.ndarray | None = None
    groups: np.ndarray | None = None

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
        if self.groups is not None:
            object.__setattr__(self, "groups", as_groups(self.groups, y.shape[0], "ArrayDataset.groups"))

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
        groups = None if self.groups is None else self.groups[idx]
        return ArrayDataset(self.x[idx], self.y[idx], domain, groups)


@dataclass(frozen=True, eq=False)
class StreamedDataset:
    """Examples read one at a time from a map-style ``torch.utils.data.Dataset`` (an organization's own files).

    The client never holds the whole set: training and evaluation stream batches of it through a DataLoader
    (:mod:`hetfed.client.training`). ``y`` holds every example's label, known up front (a dataset's
    ``targets``, or read once), so that partitions, class counts and per-class draws need no example's
    input. ``dataset[i]`` returns ``(x, label)`` with ``x`` a float tensor of ``input_shape``. ``groups``, when
    given, holds every example's group id (``privacy.unit = "group"``).
    """

    dataset: Any
    y: np.ndarray
    input_shape: tuple[int, ...]
    name: str = ""
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        y = np.asarray(self.y, dtype=np.int64)
        if y.ndim != 1 or y.shape[0] != len(self.dataset):
            raise ValueError(f"StreamedDataset.y must have shape ({len(self.dataset)},), got {y.shape}")
        object.__setattr__(self, "y", y)
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        if self.groups is not None:
            object.__setattr__(self, "groups", as_groups(self.groups, y.shape[0], "StreamedDataset.groups"))

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray | Sequence[int]) -> StreamedDataset:
        """The examples at ``indices`` (in that order), still read on demand."""
        from torch.utils.data import Subset

        idx = np.asarray(indices, dtype=np.int64)
        groups = None if self.groups is None else self.groups[idx]
        return StreamedDataset(Subset(self.dataset, idx.tolist()), self.y[idx], self.input_shape, self.name, groups)


Examples = ArrayDataset | StreamedDataset
"""A data set as an algorithm sees it: arrays in memory, or a dataset streamed from the organization's files."""


@dataclass(frozen=True)
class ClientData:
    """One organization's share: its train set, its own test set, and the further held-out sets it evaluates on.

    ``global_test`` is a federation-wide test set (balanced, or every domain's); ``cross_test`` the other
    organizations' domains' test data (partitions with domains). ``public`` is the shared seed set every
    organization holds (partitions that provide one) and ``domain`` this organization's domain.
    """

    train: Examples
    test: Examples
    global_test: Examples | None
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    cross_test: Examples | None = None
    public: SeedSet | None = None
    domain: int = -1
    # Further named held-out sets (for example a held-out target domain), evaluated as ``<name>_accuracy``.
    extra_eval: dict[str, Examples] = field(default_factory=dict)
    # The held-out set whose latents local snapshots record (a name of ``eval_sets()`` or "test"; empty:
    # ``global_test`` when present, else ``test``).
    probe: str = ""

    @property
    def seed_set(self) -> tuple[str, str] | None:
        """(id, SHA-256) of the seed set this organization holds, sent when it joins a run."""
        return None if self.public is None else (self.public.id, self.public.sha256)

    def eval_sets(self) -> dict[str, Examples]:
        """Every held-out set besides the own test set, by name (reported as ``<name>_accuracy``)."""
        out = {"global_test": self.global_test, "cross_test": self.cross_test, **self.extra_eval}
        return {k: v for k, v in out.items() if v is not None}

    def probe_set(self) -> tuple[str, Examples]:
        """(name, set) of the held-out images local snapshots embed (see ``probe``)."""
        if self.probe:
            sets = {"test": self.test, **self.eval_sets()}
            if self.probe not in sets:
                raise ValueError(f"probe set {self.probe!r} is not among this organization's sets ({', '.join(sets)})")
            return self.probe, sets[self.probe]
        return ("global_test", self.global_test) if self.global_test is not None else ("test", self.test)


def as_labels(labels: np.ndarray, what: str = "labels") -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {y.shape}")
    if y.size and y.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise ValueError(f"{what} must be >= 0, found {y.min()}")
    return y.astype(np.int64)


def sorted_concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(parts)).astype(np.int64)


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_float(name: str, value: object, *, minimum: float, inclusive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    if v < minimum or (not inclusive and v == minimum):
        raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {minimum:g}, got {value:g}")
