"""FedProx-style Synthetic(α, β) data (Li et al. 2020, Appendix; ALGORITHMS.md §2): generated, never downloaded."""

from __future__ import annotations

import math

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import STREAM_SYNTHETIC, STREAM_SYNTHETIC_SPLIT, ArrayDataset, ClientData, Seed
from hetfed.client.data.partitions import stratified_holdout

SYNTHETIC_FEATURES = 60
SYNTHETIC_CLASSES = 10
SYNTHETIC_HIDDEN = 20
SYNTHETIC_TEMPERATURE = 2.0
HOLDOUT_FRACTION = 0.2


def generate_synthetic(num_samples: int, alpha: float, beta: float, seed: Seed) -> ArrayDataset:
    """One client's FedProx-style Synthetic(alpha, beta) data with the two-layer labelling network (60 → 20 → 10).

    B ~ N(0, beta), v_j ~ N(B, 1), x ~ N(v, Σ) with Σ_jj = j^-1.2; u1, u2 ~ N(0, alpha),
    W1, b1 ~ N(u1, 1), W2, b2 ~ N(u2, 1); y = argmax softmax(W2 ((W1 x + b1) / T) + b2) with T = 2.
    alpha and beta are standard deviations, as in the FedProx and FL4Health code.
    """
    rng = np.random.default_rng(seed)
    big_b = rng.normal(0.0, beta)
    v = rng.normal(big_b, 1.0, size=SYNTHETIC_FEATURES)
    u1 = rng.normal(0.0, alpha)
    u2 = rng.normal(0.0, alpha)
    w1 = rng.normal(u1, 1.0, size=(SYNTHETIC_HIDDEN, SYNTHETIC_FEATURES))
    b1 = rng.normal(u1, 1.0, size=SYNTHETIC_HIDDEN)
    w2 = rng.normal(u2, 1.0, size=(SYNTHETIC_CLASSES, SYNTHETIC_HIDDEN))
    b2 = rng.normal(u2, 1.0, size=SYNTHETIC_CLASSES)
    std = np.arange(1, SYNTHETIC_FEATURES + 1, dtype=np.float64) ** -0.6  # sqrt of j^-1.2
    x = v + rng.standard_normal((num_samples, SYNTHETIC_FEATURES)) * std
    hidden = (x @ w1.T + b1) / SYNTHETIC_TEMPERATURE
    logits = hidden @ w2.T + b2
    y = np.argmax(logits, axis=1)  # argmax of the softmax is the argmax of the logits
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64))


def random_holdout(n: int, fraction: float, seed: Seed) -> tuple[np.ndarray, np.ndarray]:
    """Split indices 0..n−1 into (kept, held_out), holding out round(fraction·n) rows drawn at random."""
    order = np.random.default_rng(seed).permutation(n)
    n_hold = math.floor(fraction * n + 0.5)
    return np.sort(order[n_hold:]).astype(np.int64), np.sort(order[:n_hold]).astype(np.int64)


def load_synthetic(cfg: DataConfig) -> ClientData:
    """One organization's Synthetic(α, β) data, its test rows held out as ``cfg.split`` says."""
    i = cfg.client_index
    data = generate_synthetic(
        cfg.synthetic_samples, cfg.synthetic_alpha, cfg.synthetic_beta, (cfg.seed, STREAM_SYNTHETIC, i)
    )
    split_seed = (cfg.seed, STREAM_SYNTHETIC_SPLIT, i)
    if cfg.split == "stratified":
        keep, hold = stratified_holdout(data.y, HOLDOUT_FRACTION, split_seed)
    else:
        keep, hold = random_holdout(len(data.y), HOLDOUT_FRACTION, split_seed)
    if cfg.validation_fraction > 0.0:  # set aside, unused: the training set shrinks as in the reference runs
        n_val = math.floor(cfg.validation_fraction * keep.size + 0.5)
        order = np.random.default_rng((*split_seed, 1)).permutation(keep.size)
        keep = np.sort(keep[order[n_val:]])
    return ClientData(
        train=data.subset(keep),
        test=data.subset(hold),
        global_test=None,
        num_classes=SYNTHETIC_CLASSES,
        input_shape=(SYNTHETIC_FEATURES,),
        name=(
            f"synthetic[alpha={cfg.synthetic_alpha:g}, beta={cfg.synthetic_beta:g}, seed={cfg.seed}, "
            f"client {i} of {cfg.num_clients}]"
        ),
    )
