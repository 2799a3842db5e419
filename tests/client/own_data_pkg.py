"""Data factories from outside the package (``data.factory = "own_data_pkg:make"``): a good one and broken ones."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from hetfed.client.data import DataContext, SeedSet

CALLS: list[DataContext] = []


class Pairs(Dataset[tuple[torch.Tensor, int]]):
    """``len(labels)`` examples of shape ``shape``: example i is filled with i (a float64 numpy array)."""

    def __init__(self, labels: list[int], shape: tuple[int, ...] = (1, 2, 2), *, with_targets: bool = True) -> None:
        self.labels = labels
        self.shape = shape
        if with_targets:
            self.targets = torch.tensor(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return np.full(self.shape, float(i)), self.labels[i]


class Stream(IterableDataset[tuple[torch.Tensor, int]]):
    def __iter__(self) -> Any:
        yield torch.zeros(2), 0


def make(context: DataContext) -> dict[str, Any]:
    """8 training and 4 test examples (the test set without ``targets``), an eval set, 3 classes."""
    CALLS.append(context)
    return {
        "train": Pairs([0, 1, 2, 0, 1, 2, 0, 1]),
        "test": Pairs([2, 1, 0, 0], with_targets=False),
        "num_classes": 3,
        "eval": {"night": Pairs([1, 1])},
        "domain": context.client_index,
        "name": f"own[{context.options.get('site', '?')}]",
    }


def with_seed_set(context: DataContext) -> dict[str, Any]:
    """``make``'s data with a shared seed set of two examples per domain."""
    seed = SeedSet("own-seed", np.arange(16, dtype=np.uint8).reshape(4, 1, 2, 2), np.array([0, 1, 2, 0]),
                   np.array([0, 0, 1, 1]))
    return {"train": Pairs([0, 1]), "test": Pairs([1]), "num_classes": 3, "seed_set": seed, "domain": 1}


def raises(context: DataContext) -> dict[str, Any]:
    raise RuntimeError("disk /data/xray\nnot mounted")


def returns_list(context: DataContext) -> Any:
    return [Pairs([0]), Pairs([0])]


def lacks_test(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "num_classes": 1}


def misspelled(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0]), "tests": Pairs([0]), "num_classes": 1}


def iterable_train(context: DataContext) -> dict[str, Any]:
    return {"train": Stream(), "test": Pairs([0]), "num_classes": 1}


def number_test(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": 5, "num_classes": 1}


def zero_classes(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0]), "num_classes": 0}


def float_classes(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0]), "num_classes": 2.0}


def labels_out_of_range(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0, 1]), "test": Pairs([0, 3, 3, 5, -1], with_targets=False), "num_classes": 3}


def empty_train(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([]), "test": Pairs([0]), "num_classes": 1}


def shapes_differ(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0], (3, 2, 2)), "num_classes": 1}


def eval_shape_differs(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0]), "eval": {"far": Pairs([0], (2,))}, "num_classes": 1}


def eval_named_test(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0]), "eval": {"test": Pairs([0])}, "num_classes": 1}


def with_global_test(context: DataContext) -> dict[str, Any]:
    return {"train": Pairs([0]), "test": Pairs([0]), "eval": {"global_test": Pairs([0, 0]), "far": Pairs([0])},
            "num_classes": 1}


def not_pairs(context: DataContext) -> dict[str, Any]:
    return {"train": [torch.zeros(2)], "test": Pairs([0]), "num_classes": 1}


def float_labels(context: DataContext) -> dict[str, Any]:
    return {"train": [(torch.zeros(2), 0.5)], "test": Pairs([0]), "num_classes": 1}


def seed_set_shape_differs(context: DataContext) -> dict[str, Any]:
    seed = SeedSet("s", np.zeros((1, 3), dtype=np.uint8), np.array([0]), np.array([0]))
    return {"train": Pairs([0]), "test": Pairs([0]), "num_classes": 1, "seed_set": seed}


NOT_A_FUNCTION = 3


def ragged(context: DataContext) -> dict[str, Any]:
    """Example 1's input has another shape than example 0's (found when it is read)."""
    return {"train": [(torch.zeros(2), 0), (torch.zeros(3), 0)], "test": [(torch.zeros(2), 0)], "num_classes": 1}


class Faulty(Pairs):
    def __getitem__(self, i: int) -> tuple[Any, int]:
        if i == 2:
            raise OSError(f"cannot read /data/{i}.png")
        return super().__getitem__(i)


def faulty(context: DataContext) -> dict[str, Any]:
    return {"train": Faulty([0, 0, 0], with_targets=False), "test": Pairs([0]), "num_classes": 1}


def with_groups(context: DataContext) -> dict[str, Any]:
    """The training set of ``make`` with a ``groups`` attribute: 3 patients of 3, 3 and 2 examples."""
    train = Pairs([0, 1, 2, 0, 1, 2, 0, 1])
    train.groups = torch.tensor([10, 10, 10, 20, 20, 20, 30, 30])  # type: ignore[attr-defined]
    return {"train": train, "test": Pairs([0]), "num_classes": 3}


def groups_too_short(context: DataContext) -> dict[str, Any]:
    train = Pairs([0, 1, 2])
    train.groups = [1, 2]  # type: ignore[attr-defined]
    return {"train": train, "test": Pairs([0]), "num_classes": 3}


def float_groups(context: DataContext) -> dict[str, Any]:
    train = Pairs([0, 1])
    train.groups = np.array([0.5, 1.0])  # type: ignore[attr-defined]
    return {"train": train, "test": Pairs([0]), "num_classes": 3}
