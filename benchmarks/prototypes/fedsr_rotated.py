"""Prototype: FedSR's Rotated MNIST leave-one-domain-out protocol from MNIST-5k (numpy only).

Not the data package: hetfed.client.data.rotated is what runs. The protocol (FedSR §4.1-4.2, after DIVA and
DIRT): 1000 base images, 100 per class drawn from MNIST-5k with the data seed; domain M_a is every base
image rotated counter-clockwise by a degrees, a in (0, 15, 30, 45, 60, 75); so all six domains hold the
same 1000 digits. Leaving target M_t out, each other domain is an organization with a 90/10
train/validation split; the target's 1000 images are its test set and never train.

The validation split is drawn once per class (10 of each class's 100 base images) and is the same base
images in every source domain, so no validation digit is trained on in any rotation. (The target's
digits are, in the other rotations: that is the protocol.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetfed.client.data.images import load_mnist5k as _load_mnist5k
from hetfed.client.data.rotated import rotate_clockwise

__all__ = ["ANGLES", "PER_CLASS", "VAL_FRACTION", "Domain", "RotatedSplit", "build_fedsr_rotated"]

ANGLES: tuple[int, ...] = (0, 15, 30, 45, 60, 75)
PER_CLASS = 100
VAL_FRACTION = 0.10
_STREAM_BASE = 31  # np.random.default_rng((seed, stream)); distinct from data.py's and rotated.py's streams
_STREAM_VAL = 32


@dataclass(frozen=True)
class Domain:
    """One rotation of the base images: float32 pixels in [0, 1] of shape (N, 1, 28, 28) and int64 labels."""

    angle: int
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class RotatedSplit:
    """The sources' train and validation parts (one per organization, in angle order) and the target."""

    train: tuple[Domain, ...]
    val: tuple[Domain, ...]
    target: Domain
    base_index: np.ndarray  # rows of MNIST-5k used as base images, class by class


def _rotated(pixels: np.ndarray, angle: int) -> np.ndarray:
    # Counter-clockwise by `angle` (the paper's direction), rounded back to 8-bit like a stored image.
    rotated = np.clip(np.rint(rotate_clockwise(pixels, -float(angle))), 0, 255)
    return (rotated / 255.0).astype(np.float32)


def build_fedsr_rotated(seed: int, target_angle: int, *, angles: tuple[int, ...] = ANGLES,
                        per_class: int = PER_CLASS, val_fraction: float = VAL_FRACTION) -> RotatedSplit:
    """Leave-one-domain-out Rotated MNIST for target ``target_angle``; every random choice from ``seed``."""
    if target_angle not in angles:
        raise ValueError(f"target_angle {target_angle} is not one of the domains {angles}")
    if len(set(angles)) != len(angles) or len(angles) < 2:
        raise ValueError(f"angles must be at least two distinct values, got {angles}")
    n_val = int(np.floor(val_fraction * per_class + 0.5))
    if not 0 < n_val < per_class:
        raise ValueError(f"val_fraction={val_fraction} leaves no train or no validation image per class")
    x, y = _load_mnist5k()
    classes = int(y.max()) + 1
    rng = np.random.default_rng((seed, _STREAM_BASE))
    base = np.concatenate([np.sort(rng.choice(np.flatnonzero(y == c), per_class, replace=False))
                           for c in range(classes)])
    labels = y[base]
    val_rng = np.random.default_rng((seed, _STREAM_VAL))
    is_val = np.zeros(base.size, dtype=bool)
    for c in range(classes):
        is_val[val_rng.choice(np.flatnonzero(labels == c), n_val, replace=False)] = True
    pixels = np.rint(np.asarray(x[base], dtype=np.float64) * 255.0)  # MNIST-5k pixels are whole 0..255
    train: list[Domain] = []
    val: list[Domain] = []
    target: Domain | None = None
    for angle in angles:
        images = _rotated(pixels, angle)
        if angle == target_angle:
            target = Domain(angle, images, labels.copy())
        else:
            train.append(Domain(angle, images[~is_val], labels[~is_val]))
            val.append(Domain(angle, images[is_val], labels[is_val]))
    assert target is not None
    return RotatedSplit(tuple(train), tuple(val), target, base)
