"""The Fed-CMA 2-D toy ``gauss4``: four Gaussian classes, one dominant class per client, one scarce client.

Class k is N(μ_k, 0.8·I) with μ_k one of (2, 2), (-2, 2), (-2, -2), (2, -2). Client c holds 80% of its
examples from class c mod 4 and 20% spread evenly over the other classes (the paper's Fig. 4 setting,
ALGORITHMS.md §6); the last client is scarce: it holds a tenth of the others' training examples. Each
client's own test set follows its own label mix; the shared ``global_test`` set is balanced.
"""

from __future__ import annotations

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import ArrayDataset, ClientData

GAUSS4_MEANS = np.array([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])
GAUSS4_VARIANCE = 0.8
GAUSS4_CLASSES = 4
GAUSS4_TRAIN = 200  # training examples of an ordinary client
GAUSS4_SCARCE = 20  # training examples of the scarce (last) client
GAUSS4_TEST = 100  # own test examples of every client
GAUSS4_GLOBAL_TEST = 100  # global test examples per class
DOMINANT_SHARE = 0.8
# Independent random streams of DataConfig.seed.
_STREAM_TRAIN, _STREAM_TEST, _STREAM_GLOBAL = 11, 12, 13


def gauss4_label_mix(client_index: int) -> np.ndarray:
    """Class proportions of a client: 80% its dominant class (index mod 4), 20% over the other three."""
    mix = np.full(GAUSS4_CLASSES, (1 - DOMINANT_SHARE) / (GAUSS4_CLASSES - 1))
    mix[client_index % GAUSS4_CLASSES] = DOMINANT_SHARE
    return mix


def sample_gauss4(counts: np.ndarray, rng: np.random.Generator) -> ArrayDataset:
    """``counts[k]`` points of each class k, in a seeded random order."""
    y = np.repeat(np.arange(GAUSS4_CLASSES), counts)
    x = GAUSS4_MEANS[y] + rng.standard_normal((y.size, 2)) * np.sqrt(GAUSS4_VARIANCE)
    order = rng.permutation(y.size)
    return ArrayDataset(x[order].astype(np.float32), y[order].astype(np.int64))


def _counts(total: int, mix: np.ndarray) -> np.ndarray:
    counts = np.floor(mix * total).astype(np.int64)
    counts[int(np.argmax(mix))] += total - int(counts.sum())
    return counts


def load_gauss4(cfg: DataConfig) -> ClientData:
    """Organization ``cfg.client_index``'s share of the toy (the last of ``cfg.num_clients`` is the scarce one)."""
    return gauss4_share(cfg.num_clients, cfg.client_index, cfg.seed)


def gauss4_share(num_clients: int, client_index: int, seed: int) -> ClientData:
    """Client ``client_index``'s share of the gauss4 toy (the last of ``num_clients`` is the scarce one)."""
    scarce = num_clients > 1 and client_index == num_clients - 1
    mix = gauss4_label_mix(client_index)
    n_train = GAUSS4_SCARCE if scarce else GAUSS4_TRAIN
    train = sample_gauss4(_counts(n_train, mix), np.random.default_rng((seed, _STREAM_TRAIN, client_index)))
    test = sample_gauss4(_counts(GAUSS4_TEST, mix), np.random.default_rng((seed, _STREAM_TEST, client_index)))
    global_test = sample_gauss4(np.full(GAUSS4_CLASSES, GAUSS4_GLOBAL_TEST),
                                np.random.default_rng((seed, _STREAM_GLOBAL)))
    return ClientData(
        train=train,
        test=test,
        global_test=global_test,
        num_classes=GAUSS4_CLASSES,
        input_shape=(2,),
        name=f"gauss4[seed={seed}, client {client_index} of {num_clients}{', scarce' if scarce else ''}]",
    )
