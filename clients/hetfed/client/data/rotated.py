"""Rotated MNIST from MNIST-5k (FedH2L's protocol, Li et al. §IV-A), with the shared seed set (numpy only).

The basic view M0 is 100 images of each class drawn from MNIST-5k with the data seed; domain d is M0
rotated clockwise by d × 20° (M0, M20, M40, M60 for four organizations), and organization d holds
domain d. Each base image has one role in every domain, drawn per class: an α fraction is public
(the seed set D_pub), 15% test, 10% validation (held out, unused) and the rest private, the paper's
[65, 10, 10, 15] split at α = 10%. So no test image is seen in any rotation during training.

D_pub is every domain's public part, grouped by domain; organization d teaches on part d. Test sets:
the own domain's (WDP), the other organizations' domains' (CDP) and all domains' (ACC).

``data.rotation`` picks the resampling: "bilinear" (:func:`rotate_clockwise`, numpy) or "nearest" (PIL's
nearest-neighbour rotate, :func:`rotate_nearest`, the resampling of DIRT's loader).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.data.images import load_mnist5k
from hetfed.client.data.seedset import SeedSet

PER_CLASS = 100
ROTATION_STEP = 20.0
TEST_FRACTION = 0.15
VAL_FRACTION = 0.10
_STREAM_BASE = 11  # np.random.default_rng((seed, stream)) streams, distinct from data.py's
_STREAM_ROLES = 12
_PRIVATE, _PUBLIC, _TEST, _VAL = 0, 1, 2, 3


def rotate_clockwise(images: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate (N, C, H, W) images clockwise about their centre, bilinear, zero outside (float64 out)."""
    x = np.asarray(images, dtype=np.float64)
    if degrees % 360 == 0:
        return x.copy()
    h, w = x.shape[-2:]
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    t = math.radians(degrees)
    cos, sin = math.cos(t), math.sin(t)
    rr, cc = np.meshgrid(np.arange(h, dtype=np.float64) - cy, np.arange(w, dtype=np.float64) - cx, indexing="ij")
    # Output pixel (y, x) shows the source pixel rotated back counter-clockwise (y points down).
    sx = cos * cc + sin * rr + cx
    sy = -sin * cc + cos * rr + cy
    x0, y0 = np.floor(sx).astype(np.int64), np.floor(sy).astype(np.int64)
    fx, fy = sx - x0, sy - y0
    out = np.zeros_like(x)
    for dy, dx, wgt in ((0, 0, (1 - fy) * (1 - fx)), (0, 1, (1 - fy) * fx), (1, 0, fy * (1 - fx)), (1, 1, fy * fx)):
        yy, xx = y0 + dy, x0 + dx
        ok = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
        out[..., ok] += x[..., yy[ok], xx[ok]] * wgt[ok]
    return out


def rotate_nearest(images: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate (N, C, H, W) 8-bit images counter-clockwise about their centre, nearest-neighbour, zero outside.

    Each channel goes through PIL's ``Image.rotate(degrees, resample=NEAREST)`` as an 8-bit grey image: what
    torchvision's ``rotate`` does to a PIL image with its defaults (nearest, no expansion, the image's centre,
    fill 0), and so what DIRT's loader computes (atuannguyen/DIRT: domain_gen_rotatedmnist/mnist_loader.py:62-74).
    Returns uint8 of the same shape.
    """
    from PIL import Image

    x = np.asarray(images)
    if x.ndim != 4 or x.dtype != np.uint8:
        raise ValueError(f"rotate_nearest needs uint8 images (N, C, H, W), got {x.dtype} {x.shape}")
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            img = Image.fromarray(np.ascontiguousarray(x[i, c]), mode="L")
            out[i, c] = np.asarray(img.rotate(float(degrees), resample=Image.Resampling.NEAREST))
    return out


def rotate_stored(pixels: np.ndarray, degrees: float, rotation: str) -> np.ndarray:
    """Whole 0..255 pixel values (N, C, H, W) rotated counter-clockwise by ``degrees`` and stored as uint8:
    bilinear (:func:`rotate_clockwise`, rounded back to 8 bits) or nearest (:func:`rotate_nearest`)."""
    if rotation == "nearest":
        return rotate_nearest(np.asarray(pixels).astype(np.uint8), degrees)
    if rotation != "bilinear":
        raise ValueError(f"rotation must be 'bilinear' or 'nearest', got {rotation!r}")
    return np.clip(np.rint(rotate_clockwise(pixels, -degrees)), 0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=4)
def _domains(seed: int, num_domains: int, public_fraction: float,
             rotation: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images uint8 [D, n, 1, 28, 28], labels [n], roles [n]) of every domain; same base image order in each."""
    x, y = load_mnist5k()
    rng = np.random.default_rng((seed, _STREAM_BASE))
    base = np.concatenate([np.sort(rng.choice(np.flatnonzero(y == c), PER_CLASS, replace=False))
                           for c in range(int(y.max()) + 1)])
    n_pub = max(1, math.floor(public_fraction * PER_CLASS + 0.5))
    n_test = math.floor(TEST_FRACTION * PER_CLASS + 0.5)
    n_val = math.floor(VAL_FRACTION * PER_CLASS + 0.5)
    if n_pub + n_test + n_val >= PER_CLASS:
        raise ValueError(f"data.public_fraction={public_fraction:g} leaves no private images per class")
    role_rng = np.random.default_rng((seed, _STREAM_ROLES))
    roles = np.full(base.size, _PRIVATE, dtype=np.int64)
    for c in range(int(y.max()) + 1):
        idx = role_rng.permutation(np.arange(c * PER_CLASS, (c + 1) * PER_CLASS))
        roles[idx[:n_pub]] = _PUBLIC
        roles[idx[n_pub : n_pub + n_test]] = _TEST
        roles[idx[n_pub + n_test : n_pub + n_test + n_val]] = _VAL
    pixels = np.rint(x[base] * 255.0)  # MNIST-5k pixels are whole numbers 0..255
    images = np.stack([rotate_stored(pixels, -d * ROTATION_STEP, rotation) for d in range(num_domains)])
    for a in (images, roles):
        a.flags.writeable = False
    return images, y[base], roles


def seed_set_id(cfg: DataConfig) -> str:
    """The id of the seed set a rotated data config derives."""
    nearest = "-nearest" if cfg.rotation == "nearest" else ""
    return f"rotated-mnist5k-d{cfg.num_clients}-a{cfg.public_fraction:g}-s{cfg.seed}{nearest}"


def build_seed_set(cfg: DataConfig) -> SeedSet:
    """D_pub of a rotated data config: every domain's public part, grouped by domain."""
    images, labels, roles = _domains(cfg.seed, cfg.num_clients, cfg.public_fraction, cfg.rotation)
    pub = np.flatnonzero(roles == _PUBLIC)
    d = cfg.num_clients
    return SeedSet(
        seed_set_id(cfg),
        images[:, pub].reshape(d * pub.size, *images.shape[2:]),
        np.tile(labels[pub], d),
        np.repeat(np.arange(d, dtype=np.int64), pub.size),
    )


def load_seed_set(cfg: DataConfig) -> SeedSet:
    """The seed set this organization holds: the mounted file when ``seed_set_path`` is set, else derived."""
    return SeedSet.load(cfg.seed_set_path) if cfg.seed_set_path else build_seed_set(cfg)


def _part(images: np.ndarray, labels: np.ndarray, roles: np.ndarray, domain: int, role: int) -> ArrayDataset:
    idx = np.flatnonzero(roles == role)
    x = images[domain, idx].astype(np.float32) / np.float32(255.0)
    return ArrayDataset(x, labels[idx], np.full(idx.size, domain, dtype=np.int64))


def _concat(parts: list[ArrayDataset]) -> ArrayDataset:
    domains = [p.domain for p in parts if p.domain is not None]
    return ArrayDataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                        np.concatenate(domains) if len(domains) == len(parts) else None)


def load_rotated(cfg: DataConfig) -> ClientData:
    """Organization ``client_index``'s rotated domain: private train set, test sets per domain, seed set."""
    images, labels, roles = _domains(cfg.seed, cfg.num_clients, cfg.public_fraction, cfg.rotation)
    i = cfg.client_index
    public = load_seed_set(cfg)
    tests = [_part(images, labels, roles, d, _TEST) for d in range(cfg.num_clients)]
    train = _part(images, labels, roles, i, _PRIVATE)
    if cfg.train_on_public:  # the AGG baseline: own private data plus the whole seed set
        train = _concat([train, ArrayDataset(public.features(), public.y, public.domain)])
    others = [t for d, t in enumerate(tests) if d != i]
    angle = i * ROTATION_STEP
    return ClientData(
        train=train,
        test=tests[i],
        global_test=_concat(tests),
        num_classes=int(labels.max()) + 1,
        input_shape=tuple(int(s) for s in images.shape[2:]),
        name=f"mnist5k[rotated M{angle:g}{', nearest' if cfg.rotation == 'nearest' else ''}, "
             f"alpha={cfg.public_fraction:g}, seed={cfg.seed}, "
             f"client {i} of {cfg.num_clients}{', + seed set' if cfg.train_on_public else ''}]",
        cross_test=_concat(others) if others else None,
        public=public,
        domain=i,
    )
