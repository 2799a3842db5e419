"""SimFed (similarity-matched knowledge reflection with factorised layers, paper 004): the spec and its config.

Every organization's encoder is factorised (W = u × v ⊕ μ per layer, μ a sparse mask kept sparse by an L1
term); after local training it uploads its factors (u, v and the mask entries above a threshold) and its
embeddings of criteria inputs derived from the run seed. The aggregator matches organizations by the
cosine similarity of those embeddings and sends each one its own reflection of the similar organizations'
factors (eq. 8). Heads, dense weights and the criteria inputs never leave an organization.

A mask travels sparse, as flat indices and values (``FactorizedLayer``); ``decode_mask`` turns it back into
the dense mask, on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import DTypeLike

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, Figure, TrainConfig


@dataclass(frozen=True)
class SimFedConfig(TrainConfig):
    """SimFed: similarity threshold τ, reflection scale α, mask sparsity λ₁, and how masks travel.

    The training defaults are the paper's (§5.1): SGD, lr 5e-2, weight decay 1e-4, batch 128. The paper gives
    neither momentum nor local epochs: plain SGD, as it says, and hetfed's 5 epochs a round, so that 20 rounds
    train MNIST-5k's small organizations about as far as the tuning runs needed (docs/algorithms/simfed.md).
    """

    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 1e-4
    batch_size: int = 128
    local_epochs: int = 5
    # τ: organization j is in k's similarity set J_k when σ_kj = cos(z_N,k, z_N,j) ≥ τ (k always is).
    # Paper §5.1: τ = 0.9. The authors' code (wyjeong/Factorized-FL main.py) uses τ = 0 for permuted labels.
    tau: float = 0.9
    # α: reflection weights softmax_{j∈J_k}(α·σ_kj) (eq. 8). Paper §5.1: 30; authors' code (permuted): 1.
    alpha: float = 30.0
    # m: J_k holds at least the m organizations of highest σ_kj (k first, σ_kk = 1), even below τ. The
    # paper has no such floor (1: J_k = {j : σ_kj ≥ τ}); the authors' server.py takes the top
    # max(|{σ ≥ τ}|, minimum_aggr) by σ, with minimum_aggr = 10 of 20 clients for permuted labels (main.py).
    min_similarity_set: int = 1
    # Which factors are reflected, so which travel: "u", "uv" or "uvm" (u, v and the mask). Eq. 8 reflects
    # every factor θ (paper); the authors' code shares u only (--aggr u, "uvm" for the "plus" model).
    # Unshared factors stay the organization's own and are not sent.
    shared_factors: Literal["u", "uv", "uvm"] = "uvm"
    # λ₁: weight of the mask sparsity term λ₁·Σ‖μ‖₁ in the local objective (eq. 7).
    lambda1: float = 1e-4
    # Mask entries with |μ| ≤ mask_threshold are not sent (the rest travel as indices and values); the
    # organization keeps every entry: unsent ones are added back to the mask it receives.
    mask_threshold: float = 3e-3
    # How masks start (the paper gives no initial values). "reference": every encoder mask at zero, as the
    # authors' encoder starts (ResNet-9, only convolutions, whose masks start at zero: Factorized-FL
    # modules/layers.py:87-89, modules/nets.py:23-44; their one drawn dense mask is their head's, layers.py:29-30,
    # which hetfed never factorises). "zero" is the same start, named for what it does. "dense": the masks of
    # dense layers drawn in full (layers.py:29-30 applied to the encoder's dense layers), convolution masks zero
    # (what hetfed first called "reference", kept so earlier results can be rerun). "sparse": a share
    # mask_init_density non-zero, every layer.
    mask_init: Literal["reference", "dense", "sparse", "zero"] = "reference"
    # Share of each mask's entries that start non-zero under mask_init = "sparse".
    mask_init_density: float = 0.1
    # False: W = u × v only (the paper's "w/o masks" ablation, Table 4).
    masks: bool = True
    # Keep each organization's optimiser (its SGD momentum) from round to round; the authors' client
    # builds its optimiser once (init_state). Without momentum it changes nothing.
    keep_optimizer_state: bool = True
    # Number B of criteria inputs x_N ~ N(0, 1) (the paper uses one).
    criteria_inputs: int = 1
    # Who is in J_k. "similarity": σ_kj ≥ τ (eq. 3). The ablations and controls take k plus random_partners
    # others: "random" drawn anew each round (the paper's "random matching", Table 3), "bottom" the least
    # similar (its "worst matching", "the most dissimilar models"), "top" the most similar (hetfed's control at
    # the random matching's set size).
    matching: Literal["similarity", "random", "top", "bottom"] = "similarity"
    random_partners: int = 2
    # How J_k's members are weighted: "softmax" as eq. 8, softmax(α·σ_kj) over J_k, for every matching (the
    # paper weights its ablations as its method: the text changes only who is picked); "equal" 1 / |J_k| (the
    # weights hetfed's random matching first had, which measure sharing strength, not who is picked).
    match_weights: Literal["softmax", "equal"] = "softmax"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(-1.0 <= self.tau <= 1.0, f"tau must lie in [-1, 1], got {self.tau}")
        check(0.0 <= self.alpha < 1e6, f"alpha must lie in [0, 1e6), got {self.alpha}")
        check(self.lambda1 >= 0.0, f"lambda1 must be >= 0, got {self.lambda1}")
        check(self.mask_threshold >= 0.0, f"mask_threshold must be >= 0, got {self.mask_threshold}")
        check(self.min_similarity_set >= 1, f"min_similarity_set must be >= 1, got {self.min_similarity_set}")
        check(0.0 <= self.mask_init_density <= 1.0,
              f"mask_init_density must lie in [0, 1], got {self.mask_init_density}")
        check(1 <= self.criteria_inputs <= 1024, f"criteria_inputs must lie in [1, 1024], got {self.criteria_inputs}")
        check(self.random_partners >= 0, f"random_partners must be >= 0, got {self.random_partners}")


SPEC = AlgorithmSpec(
    name="simfed",
    summary="SimFed: factorised encoders (u × v ⊕ sparse mask); organizations matched by the similarity of their "
    "embeddings of shared random inputs receive personalised reflections of each other's factors; heads stay local.",
    config_type=SimFedConfig,
    upload=frozenset({K.FACTORIZED_WEIGHTS, K.CRITERIA_EMBEDDINGS, K.EVAL_METRICS}),
    required_upload=frozenset({K.FACTORIZED_WEIGHTS, K.CRITERIA_EMBEDDINGS, K.EVAL_METRICS}),
    download=frozenset({K.FACTORIZED_WEIGHTS}),
    model_private=True,
    shared_label_space=False,  # heads stay local: organizations may count their classes differently
    figures=(Figure("mask_density", "mask_density"), Figure("trained_mask_density", "trained_mask_density"),
             Figure("kept_mask_density", "kept_mask_density")),
    unsummed_because=("the server matches each organization's factors with its peers' by the similarity of their "
                      "criteria embeddings"),
)


def decode_mask(indices: np.ndarray, values: np.ndarray, shape: Sequence[int],
                dtype: DTypeLike = np.float32) -> np.ndarray:
    """The dense mask of ``shape`` a sparse mask stands for: ``values`` at the flat row-major ``indices`` (strictly
    increasing, as they travel), zeros elsewhere, as ``dtype`` (exact: float32 values widen or stay bit for bit)."""
    dims = tuple(int(s) for s in shape)
    if any(s < 0 for s in dims):
        raise ValueError(f"mask shape must be non-negative, got {dims}")
    idx = np.asarray(indices)
    val = np.asarray(values)
    if idx.ndim != 1 or val.ndim != 1 or idx.shape != val.shape:
        raise ValueError(
            f"mask indices and values must be 1-D of one length, got {idx.shape} and {val.shape}"
        )
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"mask indices must be integers, got {idx.dtype}")
    size = math.prod(dims)
    if idx.size:
        if idx[0] < 0 or idx[-1] >= size or np.any(np.diff(idx) <= 0):
            raise ValueError(
                f"mask indices must be strictly increasing (so distinct) within [0, {size}) for shape {dims}"
            )
        if not np.all(np.isfinite(val)):
            raise ValueError("mask values hold non-finite numbers")
    out = np.zeros(size, dtype=dtype)
    out[idx.astype(np.int64)] = val.astype(dtype)
    return out.reshape(dims)
