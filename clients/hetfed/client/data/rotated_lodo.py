"""Leave-one-domain-out Rotated MNIST from MNIST-5k (the protocol of DIVA, DIRT and FedSR §4.1-4.2; numpy only).

1000 base images, 100 per class, are drawn from MNIST-5k with the data seed. Domain d is every base image
rotated counter-clockwise by d × 15°, d = 0 .. ``num_clients`` (five organizations: the paper's six
domains M0, M15, M30, M45, M60, M75), so every domain holds the same 1000 digits. ``target_domain`` is
held out: it never trains, and every organization evaluates on its 1000 images (``target_test``). Each
other domain, in angle order, is one organization's, split 90/10 into train and validation; the
validation images are the same 10 base images of each class in every source domain, so no validation
digit is trained on in any rotation. The organization's own test set is its validation split (the source
validation that settings are chosen on). Every organization computes the same split from the seed: no
image, label or index crosses the wire. ``data.rotation`` picks the resampling: "bilinear" (the default) or
"nearest", PIL's nearest-neighbour rotate as DIRT's loader does (atuannguyen/DIRT:
domain_gen_rotatedmnist/mnist_loader.py:62-74, 161-162); nearest keeps every pixel an original 8-bit value.
"""

from __future__ import annotations

import functools

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.data.images import load_mnist5k
from hetfed.client.data.rotated import rotate_stored

PER_CLASS = 100
ROTATION_STEP = 15.0
VAL_PER_CLASS = 10
TARGET_SET = "target_test"
_STREAM_BASE = 31  # np.random.default_rng((seed, stream)); distinct from the other loaders' streams
_STREAM_VAL = 32


def angle_of(domain: int) -> float:
    """The counter-clockwise rotation of domain ``domain`` in degrees."""
    return domain * ROTATION_STEP


def source_domains(cfg: DataConfig) -> list[int]:
    """The domains that train, in angle order: organization i holds the i-th."""
    return [d for d in range(cfg.num_clients + 1) if d != cfg.target_domain]


@functools.lru_cache(maxsize=2)
def _domains(seed: int, num_domains: int, rotation: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images uint8 [D, 1000, 1, 28, 28], labels [1000], validation mask [1000]); same base order in each."""
    x, y = load_mnist5k()
    classes = int(y.max()) + 1
    rng = np.random.default_rng((seed, _STREAM_BASE))
    base = np.concatenate([np.sort(rng.choice(np.flatnonzero(y == c), PER_CLASS, replace=False))
                           for c in range(classes)])
    labels = y[base]
    val_rng = np.random.default_rng((seed, _STREAM_VAL))
    is_val = np.zeros(base.size, dtype=bool)
    for c in range(classes):
        is_val[val_rng.choice(np.flatnonzero(labels == c), VAL_PER_CLASS, replace=False)] = True
    pixels = np.rint(np.asarray(x[base], dtype=np.float64) * 255.0)  # MNIST-5k pixels are whole 0..255
    # Counter-clockwise (the paper's direction), stored as 8-bit images (bilinear values rounded back).
    images = np.stack([rotate_stored(pixels, angle_of(d), rotation) for d in range(num_domains)])
    for a in (images, labels, is_val):
        a.flags.writeable = False
    return images, labels, is_val


def _part(images: np.ndarray, labels: np.ndarray, mask: np.ndarray, domain: int) -> ArrayDataset:
    idx = np.flatnonzero(mask)
    x = images[domain, idx].astype(np.float32) / np.float32(255.0)
    return ArrayDataset(x, labels[idx], np.full(idx.size, domain, dtype=np.int64))


def load_rotated_lodo(cfg: DataConfig) -> ClientData:
    """Organization ``client_index``'s source domain (train, validation as its test set) and the held-out target."""
    images, labels, is_val = _domains(cfg.seed, cfg.num_clients + 1, cfg.rotation)
    domain = source_domains(cfg)[cfg.client_index]
    everything = np.ones(labels.size, dtype=bool)
    nearest = ", nearest" if cfg.rotation == "nearest" else ""
    return ClientData(
        train=_part(images, labels, ~is_val, domain),
        test=_part(images, labels, is_val, domain),
        global_test=None,
        num_classes=int(labels.max()) + 1,
        input_shape=tuple(int(s) for s in images.shape[2:]),
        name=f"mnist5k[rotated_lodo M{angle_of(domain):g}{nearest}, target M{angle_of(cfg.target_domain):g} "
             f"held out, seed={cfg.seed}, client {cfg.client_index} of {cfg.num_clients}]",
        domain=domain,
        extra_eval={TARGET_SET: _part(images, labels, everything, cfg.target_domain)},
        probe=TARGET_SET,
    )
