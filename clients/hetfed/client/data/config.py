"""Which data set an organization trains on and how the federation's data is split (validated on load)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from hetfed.client.data.core import check_choice, check_float, check_int
from hetfed.client.data.partitions import TEST_SPLITS
from hetfed.client.data.registry import DATASETS, PARTITIONS, DatasetName, PartitionName

# Datasets that may be given a data.path without needing one (the data factory receives it as context.path).
_OPTIONAL_PATH = ("torch",)
# Built-in image datasets whose pixels (in [0, 1]) data.mean and data.std may normalise, as imagefolder's are.
NORMALISABLE = ("mnist5k", "fmnist")
# Built-in datasets whose training images data.train_size may subsample before the split.
SUBSAMPLED = ("mnist5k", "fmnist", "digits")
# How partitions "rotated" and "rotated_lodo" resample a rotated image (data.rotation).
ROTATIONS = ("bilinear", "nearest")
_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class DataConfig:
    """Which dataset an organization trains on and how the federation's data is split among clients."""

    dataset: DatasetName = "mnist5k"
    partition: PartitionName = "dirichlet"
    alpha: float = 0.5
    num_clients: int = 4
    client_index: int = 0
    min_per_client: int = 10
    seed: int = 0
    path: str | None = None
    synthetic_alpha: float = 0.5
    synthetic_beta: float = 0.5
    synthetic_samples: int = 5000
    test_split: Literal["proportional", "fedgen"] = "proportional"
    # Partition "rotated" (Rotated MNIST, see hetfed.client.data.rotated): the fraction alpha of each
    # domain that forms the shared seed set; whether this organization also trains on the whole seed set
    # (the AGG baseline); the seed set's .npz file when every organization mounts one (else it is derived).
    public_fraction: float = 0.1
    train_on_public: bool = False
    seed_set_path: str | None = None
    # Partition "rotated_lodo" (leave one domain out, see hetfed.client.data.rotated_lodo): the domain held out
    # of training (rotated by 15° × target_domain, 0 .. num_clients), evaluated by every organization.
    target_domain: int = 0
    # Partitions "rotated" and "rotated_lodo": how a rotated image is resampled. "bilinear" (hetfed's own, the
    # default) or "nearest": PIL's nearest-neighbour Image.rotate, what DIRT's loader does through torchvision's
    # rotate (atuannguyen/DIRT: domain_gen_rotatedmnist/mnist_loader.py:62-74, 161-162).
    rotation: Literal["bilinear", "nearest"] = "bilinear"
    # Label heterogeneity (partitions "iid" and "dirichlet", see hetfed.client.data.permuted): every
    # organization's labels go through its own permutation drawn from (seed, client_index).
    permute_labels: bool = False
    # With permute_labels: 0 gives every organization its own permutation; G >= 1 gives organization k the
    # permutation of group k mod G, drawn from (seed, k mod G), so the organizations of a group share one label
    # map (G = 2: two groups that name the classes differently, the clustered setting CFL separates).
    label_groups: int = 0
    # The seed of the data itself (generation, partition and split); None: the run's `seed`. A fixed value keeps
    # one data set while the training seed varies (the Ditto+MMD paper's protocol: one data set, seeds 2021-2023).
    data_seed: int | None = None
    # Partition "dirichlet": the share of the training set that is split at all. Below 1, class c contributes its
    # first int(min(r·n/M, int(r·n_c))) shuffled examples and each organization's re-balancing cap is r·n/M
    # (FedGen's sampling_ratio; data/Mnist/generate_niid_dirichlet.py:56-84 of zhuangdizhu/FedGen).
    sampling_ratio: float = 1.0
    # Built-in image datasets ("mnist5k", "fmnist", "digits") under "iid" or "dirichlet": train on a stratified
    # random subsample of this many training images, drawn from the data seed before the split (0: all of them).
    # hetfed's own, for a data set at another scale with everything else unchanged (simfed_fmnist: Fashion-MNIST at
    # MNIST-5k's 4,000 training images).
    train_size: int = 0
    # How `synthetic` holds out each organization's test rows: "stratified" 20% per class (hetfed's own choice),
    # or "random" 20% at random (FL4Health's split_data_and_targets). `validation_fraction` of the remaining rows
    # is then set aside unused (FL4Health: 0.2, so train/validation/test = 64/16/20; the paper evaluates the last
    # model, so the validation rows only shrink the training set as in the reference runs).
    split: Literal["stratified", "random"] = "stratified"
    validation_fraction: float = 0.0
    # Dataset "torch": the organization's data factory, "package.module:function" (hetfed.client.data.factory;
    # docs/data.md), and free-form settings handed to it as ``context.options``.
    factory: str = ""
    options: dict[str, str] = field(default_factory=dict)
    # Dataset "imagefolder": resize every image to image_size x image_size (0: keep the stored size, which must
    # then agree), read as channels 1 (grey) or 3 (RGB) (0: from the first image), normalise each channel by
    # (x - mean) / std after scaling to [0, 1] (empty: no normalisation), and open every file's header at load.
    image_size: int = 0
    channels: int = 0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    verify_images: bool = True
    # Datasets streamed from files ("imagefolder", "torch"): DataLoader worker processes, and pinned host
    # memory with non-blocking copies when the device is CUDA.
    num_workers: int = 0
    pin_memory: bool = True

    def __post_init__(self) -> None:
        check_choice("data.dataset", self.dataset, tuple(DATASETS))
        check_choice("data.partition", self.partition, tuple(PARTITIONS))
        check_choice("data.test_split", self.test_split, TEST_SPLITS)
        check_float("data.alpha", self.alpha, minimum=0.0, inclusive=False)
        check_int("data.num_clients", self.num_clients, minimum=1)
        check_int("data.client_index", self.client_index, minimum=0)
        if self.client_index >= self.num_clients:
            raise ValueError(
                f"data.client_index must be < data.num_clients ({self.num_clients}), got {self.client_index}"
            )
        check_int("data.min_per_client", self.min_per_client, minimum=0)
        check_int("data.seed", self.seed, minimum=0)
        check_float("data.synthetic_alpha", self.synthetic_alpha, minimum=0.0, inclusive=True)
        check_float("data.synthetic_beta", self.synthetic_beta, minimum=0.0, inclusive=True)
        check_int("data.synthetic_samples", self.synthetic_samples, minimum=10)
        entry = DATASETS[self.dataset]
        if entry.needs_path:
            if not isinstance(self.path, str) or not self.path:
                raise ValueError(f"data.path must name {entry.path_help} for dataset {self.dataset!r}, "
                                 f"got {self.path!r}")
        elif self.path is not None and self.dataset not in _OPTIONAL_PATH:
            with_path = sorted([*(n for n, e in DATASETS.items() if e.needs_path), *_OPTIONAL_PATH])
            raise ValueError(f"data.path is only used with dataset {' or '.join(map(repr, with_path))}, "
                             f"got {self.path!r} for dataset {self.dataset!r}")
        check_float("data.public_fraction", self.public_fraction, minimum=0.0, inclusive=False)
        if self.public_fraction >= 0.75:
            raise ValueError(f"data.public_fraction must be < 0.75, got {self.public_fraction:g}")
        supported = entry.partitions
        if self.partition not in supported:
            with_it = sorted(name for name, e in DATASETS.items() if self.partition in e.partitions)
            raise ValueError(
                f"data.partition {self.partition!r} is not available for dataset {self.dataset!r} "
                f"(it supports {', '.join(repr(p) for p in supported)}); partition {self.partition!r} "
                f"works with dataset {' or '.join(repr(d) for d in with_it)}"
                + (f" {PARTITIONS[self.partition].requirement}" if PARTITIONS[self.partition].requirement else "")
            )
        if self.data_seed is not None:
            check_int("data.data_seed", self.data_seed, minimum=0)
        check_float("data.sampling_ratio", self.sampling_ratio, minimum=0.0, inclusive=False)
        if self.sampling_ratio > 1:
            raise ValueError(f"data.sampling_ratio must be in (0, 1], got {self.sampling_ratio:g}")
        if self.sampling_ratio != 1 and self.partition != "dirichlet":
            raise ValueError(f"data.sampling_ratio applies to partition 'dirichlet' only, got {self.sampling_ratio:g} "
                             f"with partition {self.partition!r}")
        check_int("data.train_size", self.train_size, minimum=0)
        if self.train_size and (self.dataset not in SUBSAMPLED or self.partition not in ("iid", "dirichlet")):
            raise ValueError(f"data.train_size applies to dataset {' or '.join(map(repr, SUBSAMPLED))} under "
                             f"partition 'iid' or 'dirichlet', got {self.train_size} with dataset "
                             f"{self.dataset!r} and partition {self.partition!r}")
        check_choice("data.split", self.split, ("stratified", "random"))
        check_float("data.validation_fraction", self.validation_fraction, minimum=0.0, inclusive=True)
        if self.validation_fraction >= 0.9:
            raise ValueError(f"data.validation_fraction must be < 0.9, got {self.validation_fraction:g}")
        if self.dataset != "synthetic" and (self.split != "stratified" or self.validation_fraction != 0.0):
            raise ValueError(f"data.split and data.validation_fraction apply to dataset 'synthetic' only, got "
                             f"split {self.split!r}, validation_fraction {self.validation_fraction:g} for "
                             f"dataset {self.dataset!r}")
        check_int("data.target_domain", self.target_domain, minimum=0)
        if self.partition == "rotated_lodo":
            if self.target_domain > self.num_clients:
                raise ValueError(f"data.target_domain must be <= data.num_clients ({self.num_clients}): partition "
                                 f"'rotated_lodo' has num_clients + 1 domains, got {self.target_domain}")
        elif self.target_domain != 0:
            raise ValueError(f"data.target_domain is only used with partition 'rotated_lodo', got "
                             f"{self.target_domain} with partition {self.partition!r}")
        check_choice("data.rotation", self.rotation, ROTATIONS)
        if self.rotation != "bilinear" and self.partition not in ("rotated", "rotated_lodo"):
            raise ValueError(f"data.rotation applies to partition 'rotated' or 'rotated_lodo' only, got "
                             f"{self.rotation!r} with partition {self.partition!r}")
        if not isinstance(self.permute_labels, bool):
            raise ValueError(f"data.permute_labels must be true or false, got {self.permute_labels!r}")
        check_int("data.label_groups", self.label_groups, minimum=0)
        if self.label_groups and not self.permute_labels:
            raise ValueError(f"data.label_groups groups the label permutations: it needs data.permute_labels = true, "
                             f"got label_groups = {self.label_groups} without it")
        if self.permute_labels and not PARTITIONS[self.partition].permutable:
            allowed = sorted(p for p, info in PARTITIONS.items() if info.permutable)
            raise ValueError(f"data.permute_labels works with partition {' or '.join(map(repr, allowed))}, "
                             f"got partition {self.partition!r}")
        if (self.train_on_public or self.seed_set_path) and not supported[self.partition].seed_set:
            with_seeds = sorted(p for p, e in supported.items() if e.seed_set)
            raise ValueError("data.train_on_public and data.seed_set_path need a partition with a shared seed set "
                             f"({', '.join(map(repr, with_seeds)) or 'none for this dataset'})")
        self._check_own_data()

    def _check_own_data(self) -> None:
        """The fields of an organization's own data: its factory (dataset "torch") and its images ("imagefolder")."""
        if self.dataset == "torch":
            if not isinstance(self.factory, str) or not _FACTORY.fullmatch(self.factory):
                raise ValueError('data.factory must name the data factory as "package.module:function" for '
                                 f"dataset 'torch', got {self.factory!r}")
            if self.path is not None and (not isinstance(self.path, str) or not self.path):
                raise ValueError(f"data.path must be a non-empty string or absent, got {self.path!r}")
            if self.train_on_public:
                raise ValueError("data.train_on_public is not available with dataset 'torch': add the seed set to "
                                 "the train set in the data factory")
        elif self.factory != "" or self.options:
            given = ", ".join(f"{name} {value!r}" for name, value in (("factory", self.factory),
                                                                      ("options", self.options)) if value)
            raise ValueError(f"data.factory and data.options are only used with dataset 'torch', got {given} for "
                             f"dataset {self.dataset!r}")
        if not isinstance(self.options, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.options.items()):
            raise ValueError(f"data.options must map names to strings, got {self.options!r}")
        check_int("data.image_size", self.image_size, minimum=0)
        check_int("data.channels", self.channels, minimum=0)
        if self.channels not in (0, 1, 3):
            raise ValueError(f"data.channels must be 0 (from the first image), 1 or 3, got {self.channels}")
        for name, values in (("mean", self.mean), ("std", self.std)):
            if not isinstance(values, tuple | list):
                raise ValueError(f"data.{name} must be a list of numbers, got {values!r}")
            for v in values:
                check_float(f"data.{name}", v, minimum=0.0 if name == "std" else -math.inf, inclusive=name != "std")
        if len(self.mean) != len(self.std):
            raise ValueError(f"data.mean and data.std must have the same length, got {len(self.mean)} and "
                             f"{len(self.std)}")
        if self.mean and len(self.mean) not in ((self.channels,) if self.channels else (1, 3)):
            raise ValueError(f"data.mean and data.std need one value per channel ({self.channels or '1 or 3'}), "
                             f"got {len(self.mean)}")
        if not isinstance(self.verify_images, bool):
            raise ValueError(f"data.verify_images must be true or false, got {self.verify_images!r}")
        if self.dataset != "imagefolder":
            set_here = [f"{name} {value!r}" for name, value, default in (
                ("image_size", self.image_size, 0), ("channels", self.channels, 0),
                ("verify_images", self.verify_images, True)) if value != default]
            if set_here:
                raise ValueError(f"data.image_size, channels and verify_images apply to dataset 'imagefolder' only, "
                                 f"got {', '.join(set_here)} for dataset {self.dataset!r}")
            if self.mean and (self.dataset not in NORMALISABLE or self.partition not in ("iid", "dirichlet")):
                raise ValueError(f"data.mean and data.std apply to dataset 'imagefolder', and to "
                                 f"{' and '.join(map(repr, NORMALISABLE))} under partition 'iid' or 'dirichlet', "
                                 f"got dataset {self.dataset!r} with partition {self.partition!r}")
            if self.mean and len(self.mean) != 1:
                raise ValueError(f"data.mean and data.std need one value for the grey images of {self.dataset!r}, "
                                 f"got {len(self.mean)}")
        check_int("data.num_workers", self.num_workers, minimum=0)
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"data.pin_memory must be true or false, got {self.pin_memory!r}")
